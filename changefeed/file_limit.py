"""Enough file descriptors for the connections a server process is configured to hold.

A publisher holds one descriptor per listener, and a few hundred besides
(database pools, log files, the listening sockets). Many hosts start
processes with a soft ``RLIMIT_NOFILE`` of 1,024 while ``max_connections``
defaults to 10,000: past the limit, ``accept()`` fails, and the server drops
new connections before the publisher sees them, with nothing to say so.
"""

from __future__ import annotations

try:
    import resource
except ImportError:  # not on this platform (Windows): nothing to raise
    resource = None  # type: ignore[assignment]

__all__ = ["RESERVE", "fit_file_limit"]

RESERVE = 256
"""Descriptors a server process needs besides one per connection."""


def fit_file_limit(connections: int) -> tuple[int, int] | None:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards ``connections`` +
    ``RESERVE``, as far as the hard limit allows (never lower it).

    Returns:
        ``(soft limit now, descriptors wanted)`` when the limit stays below what is
        wanted (the caller says so), else None.
    """
    if resource is None:
        return None
    wanted = connections + RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return None
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return None if soft >= wanted else (soft, wanted)
