"""The listener side of changefeed: a listener that registers, buffers, backs off and
resumes, and a controller that keeps a mirror of the publisher's resources current.

Follow a feed and act on every change::

    listener = Listener("ws://vmapi.example:8080/changefeeds", instance=INSTANCE_UUID,
                        service="tcns", change_kind=ChangeKind("vm", ("nic", "alias")))

    async def reconcile(id: str, old: dict | None, new: dict | None) -> None:
        ...  # old/new: the VM as the application last saw it / as it is now (None: absent)

    controller = Controller(listener, reconcile=reconcile)
    await controller.run()      # or: async with controller: await controller.wait_synced(60)

Or read the raw events (``Resynced`` after each bootstrap, then ``ChangeItem``)::

    async with listener:
        async for event in listener:
            ...

Modules: ``lifecycle`` (the connection state machine), ``backoff`` (the
schedule), ``buffer`` (the buffer interface and the in-memory kind),
``frames`` (decoding), ``workqueue`` and ``mirror`` (the controller's queue
and store) are pure code; ``listener`` (one connection in ``session``) and
``controller`` are the websockets / httpx adapters around them; ``metrics``
exposes both on a Prometheus registry. Every exception is a ``ListenerError``
(tree in ``errors``). See docs/listener.md.

What the package must never do: block or slow the publisher (the socket is
read as fast as it delivers; a full buffer means abort and re-register, never
waiting), retry without back-off, or lose a change silently.
"""

from ._backoff import DEFAULT_ITEM_BACKOFF, Backoff, BackoffPolicy, ItemBackoff
from ._buffer import BUFFER_KINDS, Buffer, MemoryBuffer, make_buffer, register_buffer_kind
from ._config import ListenerConfig
from ._controller import Callback, Controller, ControllerStats, EventSource, Fetcher
from ._errors import (
    BadPublisherFrame,
    BootstrapFailed,
    BufferOverflow,
    LifecycleError,
    ListenerConfigError,
    ListenerError,
    PublisherClosed,
    RegistrationRefused,
    RetriesExhausted,
    SessionError,
)
from ._events import Event, ListenerStatus, Resynced
from ._frames import decode_frame
from ._lifecycle import (
    FATAL_ERROR_CODES,
    TRANSITIONS,
    ConnectionState,
    Disposition,
    Lifecycle,
    disposition,
)
from ._listener import Listener
from ._metrics import Sample, register_controller, register_listener
from ._mirror import Change, Mirror
from ._workqueue import WorkQueue

__all__ = [
    "BUFFER_KINDS",
    "DEFAULT_ITEM_BACKOFF",
    "FATAL_ERROR_CODES",
    "TRANSITIONS",
    "Backoff",
    "BackoffPolicy",
    "BadPublisherFrame",
    "BootstrapFailed",
    "Buffer",
    "BufferOverflow",
    "Callback",
    "Change",
    "ConnectionState",
    "Controller",
    "ControllerStats",
    "Disposition",
    "Event",
    "EventSource",
    "Fetcher",
    "ItemBackoff",
    "Lifecycle",
    "LifecycleError",
    "Listener",
    "ListenerConfig",
    "ListenerConfigError",
    "ListenerError",
    "ListenerStatus",
    "MemoryBuffer",
    "Mirror",
    "PublisherClosed",
    "RegistrationRefused",
    "Resynced",
    "RetriesExhausted",
    "Sample",
    "SessionError",
    "WorkQueue",
    "decode_frame",
    "disposition",
    "make_buffer",
    "register_buffer_kind",
    "register_controller",
    "register_listener",
]
