"""Text from peers, made safe to show on a terminal or in a line-based log. Pure code.

Instance and service names, peers' reasons and request paths come from
listeners and clients. Written raw, a control character can move the cursor,
recolour or retitle an operator's terminal, or start what looks like a new
log line; a format character such as U+202E (right-to-left override) can make
``abc<U+202E>gnp.exe`` read as ``abcexe.png``. ``visible`` writes every
character that is not printable (Python's ``str.isprintable``: controls,
format and unassigned characters, separators other than the space) as its
escape, the way ``repr`` would, and leaves everything else as it was. The
dashboard escapes the same characters the same way in the browser
(``publisher/static/dashboard.js``: Unicode categories Other and Separator
but the space); ``tests/test_dashboard.py`` checks that both show a name alike.
"""

from __future__ import annotations

__all__ = ["visible"]


def visible(text: str) -> str:
    """``text`` with each character a terminal would act on or hide written as its
    escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
