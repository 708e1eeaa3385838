"""Whether a process is there, by its PID (POSIX)."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "pid_exists"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is running: it exists and is not a zombie (exited, not yet
    reaped by its parent)."""
    if not pid_exists(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def pid_exists(pid: int) -> bool:
    """Whether ``pid`` exists at all, zombie or not (one this user may not signal
    counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
