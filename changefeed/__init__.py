"""changefeed: change-feed publish/subscribe middleware after Joyent's RFD 5.

Subpackages: ``changefeed.schemas`` (wire protocol, feed SQL),
``changefeed.publisher`` (feed store, tailer, fan-out, Starlette routes),
``changefeed.bootstrap`` (keyset pagination, pager), ``changefeed.listener``
(listener, buffer, back-off, controller), ``changefeed.compaction`` (the Spark
compaction job; the publisher does not import it).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
