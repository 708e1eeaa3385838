"""Text from peers, made safe to show on a terminal or in a line-based log. Pure code.

Instance and service names, peers' reasons and request paths come from
listeners and clients. Written raw, a control character can move the cursor,
recolour or retitle an operator's terminal, or start what looks like a new
log line; a format character such as U+202E (right-to-left override) can make
``abc<U+202E>gnp.exe`` read as ``abcexe.png``. ``visible`` writes every
character that is not printable (Python's ``str.isprintable``: controls,
format and unassigned characters, separators other than the space) as its
escape, the way ``repr`` would, and leaves everything else as it was;
``json_visible`` escapes the same characters in a JSON line (a JSON log line,
``changefeed listen``'s output) the way JSON does, so the value parses alike. The
dashboard escapes the same characters the same way in the browser
(``publisher/static/dashboard.js``: Unicode categories Other and Separator
but the space); ``tests/test_dashboard.py`` checks that both show a name alike.
"""

from __future__ import annotations

__all__ = ["json_visible", "visible"]


def visible(text: str) -> str:
    """``text`` with each character a terminal would act on or hide written as its
    escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def json_visible(line: str) -> str:
    """A JSON text with each character ``visible`` would escape written as its JSON
    escape (``\\u202e``; a surrogate pair beyond the Basic Multilingual Plane): the
    same value to a JSON parser, and nothing a terminal acts on or hides.

    ``line`` must be compact JSON (no whitespace between tokens), as orjson writes
    it: its only characters that are not printable are then inside strings.
    """
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else _json_escape(ord(c)) for c in line)


def _json_escape(code: int) -> str:
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
