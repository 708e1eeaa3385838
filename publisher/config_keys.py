"""A config key's declaration, and reading the declarations back.

Each key of the config model (``publisher/config.py``) is declared once, as
``Annotated[type, key_doc(...)]``: its documentation, unit and bounds ride in a
``msgspec.Meta`` beside its type. msgspec checks the bounds when it parses a
file; this module reads the same declarations back for everything else that
needs them: which keys are durations, the words for a value out of bounds,
and the reference in docs/ (``config_reference.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

__all__ = ["bound_error", "declared", "duration_keys", "key_doc"]


def key_doc(
    text: str,
    unit: str = "",
    kind: str = "",
    *,
    duration: bool = False,
    ge: int | None = None,
    gt: int | None = None,
    le: int | None = None,
    lt: int | None = None,
) -> Meta:
    """A key's declaration besides its type: its documentation and unit, ``kind``
    naming its type in the reference when the type hint alone would mislead (a key
    the model leaves None until checked), whether TOML gives it as a duration, and
    its bounds (which msgspec checks when it parses a file)."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt}
    declared_bounds: dict[str, Any] = {k: v for k, v in bounds.items() if v is not None}
    declared_bounds["description"] = text
    declared_bounds["extra"] = {"unit": unit, "kind": kind, "duration": duration}
    meta: Meta = Meta(**declared_bounds)
    return meta


@functools.cache
def declared(cls: type[msgspec.Struct]) -> dict[str, tuple[mi.Type, Meta]]:
    """Each key of ``cls``: its type (msgspec's view of it) and its declaration."""
    keys: dict[str, tuple[mi.Type, Meta]] = {}
    for info, f in zip(
        mi.type_info(cls).fields,  # type: ignore[attr-defined]
        msgspec.structs.fields(cls),
        strict=True,
    ):
        metas = [m for m in getattr(f.type, "__metadata__", ()) if isinstance(m, Meta)]
        kind = info.type.type if isinstance(info.type, mi.Metadata) else info.type
        keys[f.name] = (kind, metas[0] if metas else Meta())
    return keys


def duration_keys(cls: type[msgspec.Struct]) -> set[str]:
    """The keys of ``cls`` that TOML gives as durations (``"30s"``, ``"24h"``)."""
    return {name for name, (_, meta) in declared(cls).items() if (meta.extra or {}).get("duration")}


def bound_error(meta: Meta, value: Any) -> str | None:
    """What is wrong with ``value`` under the bounds ``meta`` declares (None: nothing)."""
    seconds = " seconds" if (meta.extra or {}).get("duration") else ""
    if isinstance(value, float) and math.isnan(value):
        return "must be a number, not NaN"
    low, high = meta.ge if meta.ge is not None else meta.gt, meta.le
    if high is None and meta.lt is not None:
        high = meta.lt - 1
    too_low = (meta.ge is not None and value < meta.ge) or (
        meta.gt is not None and value <= meta.gt
    )
    too_high = (meta.le is not None and value > meta.le) or (
        meta.lt is not None and value >= meta.lt
    )
    if not (too_low or too_high):
        return None
    if low is not None and high is not None:
        return f"must be {low}-{high}, got {value!r}"
    if meta.gt is not None:
        return f"must be more than {meta.gt}{seconds}"
    if meta.ge is not None:
        return f"must be at least {meta.ge}{seconds}" if meta.ge else "must not be negative"
    return f"must be at most {high}"
