"""The one error for a part of changefeed used without the extra that installs it.

``pip install changefeed`` is the listener side; the publisher, the bootstrap
routes and the compaction job need modules only an extra brings
(pyproject.toml). Importing them without it says which extra to install,
in one wording everywhere.
"""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(what: str, extra: str, exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error to raise (``from exc``) when ``what`` is used without ``extra``:
    ``exc`` says which module was missing."""
    module = (exc.name or "").partition(".")[0]
    return ModuleNotFoundError(
        f"{what} needs changefeed[{extra}] (no module {module!r}):"
        f" pip install 'changefeed[{extra}]'",
        name=module,
    )
