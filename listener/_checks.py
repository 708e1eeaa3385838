"""The checks of settings that every object taking them shares.

A value the listener cannot work with is refused when the object holding it
is made, with the setting's name (``ListenerConfigError``), never found
later inside the connection loop: a count that is not a whole number (a NaN
buffer size would never overflow), a number of seconds that is not a finite
positive number, a flag that is not a bool. What a registration may carry
(the instance, the service, resource and sub-resource names, how many, the
cursor) is the registration schema's rule: ``check_registration`` asks the
schema rather than restating it.

Pure code.
"""

from __future__ import annotations

from collections.abc import Sequence

from changefeed.backoff import finite_number
from changefeed.schemas import ChangeKind, Registration
from changefeed.schemas.validation import bounded, schema_error

from ._errors import ListenerConfigError

__all__ = [
    "check_change_kinds",
    "check_count",
    "check_flag",
    "check_registration",
    "check_seconds",
]


def check_count(key: str, value: object, *, optional: bool = False) -> None:
    """``value`` is a whole number of at least 1 (or None, when ``optional``).

    Raises:
        ListenerConfigError: it is not.
    """
    if value is None and optional:
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        hint = " (or None)" if optional else ""
        raise ListenerConfigError(key, f"must be a whole number of at least 1{hint}, got {value!r}")


def check_seconds(key: str, value: object, *, optional: bool = False) -> None:
    """``value`` is a finite number of seconds above 0 (or None, when ``optional``).

    Raises:
        ListenerConfigError: it is not.
    """
    if value is None and optional:
        return
    if not (finite_number(value) and value > 0):
        hint = " (or None)" if optional else ""
        raise ListenerConfigError(key, f"must be a finite number > 0{hint}, got {value!r}")


def check_flag(key: str, value: object) -> None:
    """``value`` is True or False (a string "no" would be true).

    Raises:
        ListenerConfigError: it is not.
    """
    if not isinstance(value, bool):
        raise ListenerConfigError(key, f"must be True or False, got {value!r}")


def check_change_kinds(kinds: Sequence[object], key: str) -> tuple[ChangeKind, ...]:
    """``kinds`` as change kinds whose sub-resources are tuples of names.

    Args:
        key: the setting they came from (``change_kind`` or ``change_kinds``).

    Raises:
        ListenerConfigError: one is not a ``ChangeKind``, or its sub-resources are one
            string (``ChangeKind("vm", "nic")`` would register ``n``, ``i``, ``c``).
    """
    checked = []
    for index, kind in enumerate(kinds):
        where = key if key == "change_kind" else f"{key}[{index}]"
        if not isinstance(kind, ChangeKind):
            raise ListenerConfigError(where, f"must be a ChangeKind, got {kind!r}")
        subs = kind.sub_resources
        if not isinstance(subs, tuple | list):
            raise ListenerConfigError(
                f"{where}.sub_resources", f"must be a tuple of names, got {subs!r}"
            )
        checked.append(kind if isinstance(subs, tuple) else ChangeKind(kind.resource, tuple(subs)))
    return tuple(checked)


_SETTINGS = {"instance": "instance", "service": "service", "since": "cursor"}
_FIELDS = {"subResources": "sub_resources"}


def check_registration(registration: Registration, kinds_key: str) -> None:
    """``registration`` (what the listener will send) follows the registration schema.

    Args:
        kinds_key: the setting the change kinds came from, to name the one at fault.

    Raises:
        ListenerConfigError: it does not: named after the setting that made it so
            (``service``, ``change_kinds[1].sub_resources[0]``, ``cursor``).
    """
    error = schema_error("registration", registration.to_json())
    if error is None:
        return
    limit, value = error.validator_value, error.instance
    if error.validator == "maxItems" and isinstance(value, list):
        message = f"at most {limit} allowed, got {len(value)}"  # not the whole list again
    elif error.validator == "maxLength" and isinstance(value, str):
        message = f"at most {limit} characters, got {len(value)}"
    else:
        message = bounded(error.message)
    raise ListenerConfigError(_setting(tuple(error.absolute_path), kinds_key), message)


def _setting(path: tuple[str | int, ...], kinds_key: str) -> str:
    """The setting behind a registration field: ``resources/1/subResources/0`` is
    ``change_kinds[1].sub_resources[0]``."""
    if not path:
        return "registration"
    head, *rest = path
    if head in _SETTINGS:
        return _SETTINGS[str(head)]
    if head == "changeKind":  # v1: the one change kind
        rest = [0, *rest]
    key = kinds_key
    if rest and kinds_key != "change_kind":
        key += f"[{rest[0]}]"
    for part in rest[1:]:
        key += f"[{part}]" if isinstance(part, int) else "." + _FIELDS.get(part, part)
    return key
