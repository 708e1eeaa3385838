"""The listener's pure core: lifecycle, failure disposition, buffer, frame decoding, mirror,
settings and the exported names. No sockets."""

from __future__ import annotations

import importlib
import pathlib
import random
import types

import orjson
import pytest

import changefeed.listener as listener_pkg
from changefeed.listener import (
    ConnectionState,
    ListenerConfig,
    ListenerConfigError,
    ListenerError,
)
from changefeed.listener._backoff import BackoffPolicy
from changefeed.listener._backoff import RegistrationBackoff as Backoff
from changefeed.listener._errors import BadPublisherFrame, LifecycleError
from changefeed.listener._inbox import (
    BUFFER_KINDS,
    Buffer,
    MemoryBuffer,
    decode_frame,
    make_buffer,
    register_buffer_kind,
)
from changefeed.listener._lifecycle import (
    MAX_RETRY_AFTER,
    TRANSITIONS,
    Disposition,
    Lifecycle,
    disposition,
    retry_floor,
)
from changefeed.listener._mirror import Change, Mirror
from changefeed.schemas import ChangeItem, ChangeKind, CloseCode, ErrorFrame

S = ConnectionState


def item(n: int, rid: str = "vm-1") -> ChangeItem:
    return ChangeItem(ChangeKind("vm", ("nic",)), rid, f"cursor-{n}", "2026-11-21T23:00:00.123Z")


# -- names -----------------------------------------------------------------------


PUBLIC = {
    # the two classes and their settings
    "Listener",
    "Controller",
    "ListenerConfig",
    "BackoffPolicy",
    # what the application sees
    "Event",
    "Resynced",
    "ChangeItem",
    "ChangeKind",
    "ListenerStatus",
    "BootstrapProgress",
    "ConnectionState",
    "ControllerStats",
    # what it writes
    "ReconcileHandler",
    "AddHandler",
    "UpdateHandler",
    "DeleteHandler",
    "Fetcher",
    "EventSource",
    "Buffer",
    "register_buffer_kind",
    # checkpoints: the store it uses or brings, what a store keeps, and their status
    "SqliteCheckpointStore",
    "CheckpointStore",
    "Checkpoint",
    "MirrorCheckpoint",
    "JsonItems",
    "CheckpointStatus",
    # what it may catch
    "ListenerError",
    "ListenerConfigError",
    "RegistrationRefused",
    "RetriesExhausted",
    "CheckpointError",
    "CheckpointRefused",
}


def test_the_public_api_is_exactly_what_an_application_uses() -> None:
    assert set(listener_pkg.__all__) == PUBLIC
    assert len(listener_pkg.__all__) == len(PUBLIC)  # no name twice
    for name in listener_pkg.__all__:
        assert getattr(listener_pkg, name).__doc__, name
    public_modules = {
        name
        for name, value in vars(listener_pkg).items()
        if isinstance(value, types.ModuleType) and not name.startswith("_")
    }
    assert public_modules == set()  # every module is private: _lifecycle, _workqueue, ...


def test_every_private_module_is_documented_and_errors_share_one_root() -> None:
    folder = pathlib.Path(listener_pkg.__file__).parent
    modules = sorted(p.stem for p in folder.glob("_*.py") if p.stem != "__init__")
    assert "_lifecycle" in modules and "_workqueue" in modules
    for module in modules:
        mod = importlib.import_module(f"changefeed.listener.{module}")
        assert mod.__doc__ and "__all__" in vars(mod), module
    errors = importlib.import_module("changefeed.listener._errors")
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), ListenerError)


# -- lifecycle ---------------------------------------------------------------------


def test_happy_path_and_resume_path() -> None:
    seen: list[tuple[S, S]] = []
    life = Lifecycle(lambda old, new: seen.append((old, new)))
    for state in (S.CONNECTING, S.REGISTERED, S.BOOTSTRAPPING, S.LIVE, S.BACKING_OFF):
        life.to(state)
    for state in (S.CONNECTING, S.REGISTERED, S.LIVE):  # resumed: no bootstrap
        life.to(state)
    life.to(S.STOPPED)
    assert life.state is S.STOPPED and life.transitions == 9
    assert seen[0] == (S.IDLE, S.CONNECTING) and seen[-1] == (S.LIVE, S.STOPPED)


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ((), S.LIVE),
        ((S.CONNECTING,), S.LIVE),  # no ack yet
        ((S.CONNECTING, S.REGISTERED, S.LIVE), S.BOOTSTRAPPING),
        ((S.CONNECTING, S.BACKING_OFF), S.LIVE),  # must register again first
        ((S.STOPPED,), S.CONNECTING),  # terminal
    ],
)
def test_impossible_transitions_raise(path: tuple[S, ...], bad: S) -> None:
    life = Lifecycle()
    for state in path:
        life.to(state)
    assert not life.can(bad)
    with pytest.raises(LifecycleError, match=f"to {bad.value}"):
        life.to(bad)


def test_every_state_can_fail_or_stop() -> None:
    for state in (S.CONNECTING, S.REGISTERED, S.BOOTSTRAPPING, S.LIVE):
        assert S.BACKING_OFF in TRANSITIONS[state]
    for state in S:
        if state is not S.STOPPED:
            assert S.STOPPED in TRANSITIONS[state]


def test_history_is_bounded() -> None:
    life = Lifecycle(history=4)
    for _ in range(5):
        life.to(S.CONNECTING)
        life.to(S.BACKING_OFF)
    assert len(life.history) == 4


# -- what a connection's end means ---------------------------------------------------


@pytest.mark.parametrize(
    "code", ["bad_frame", "invalid_registration", "unknown_resource", "unauthorized", "forbidden"]
)
def test_fatal_error_codes_stop(code: str) -> None:
    assert disposition(error_code=code) is Disposition.STOP


@pytest.mark.parametrize(
    "close",
    [CloseCode.BAD_FRAME, CloseCode.UNKNOWN_RESOURCE, CloseCode.UNAUTHORIZED, CloseCode.FORBIDDEN],
)
def test_fatal_close_codes_stop(close: int) -> None:
    assert disposition(close_code=close) is Disposition.STOP


@pytest.mark.parametrize(
    "close",
    [
        1001,
        1006,
        1011,
        CloseCode.REGISTRATION_TIMEOUT,
        CloseCode.FRAME_TOO_LARGE,
        CloseCode.TOO_MANY_CONNECTIONS,
        CloseCode.SLOW_LISTENER,
        CloseCode.UNAVAILABLE,
        None,
    ],
)
def test_retryable_close_codes(close: int | None) -> None:
    assert disposition(close_code=close) is Disposition.RETRY


def test_bad_cursor_retries_without_the_cursor() -> None:
    assert disposition(error_code="bad_cursor") is Disposition.RETRY_FRESH
    assert disposition(close_code=CloseCode.BAD_CURSOR) is Disposition.RETRY_FRESH


def test_an_expired_cursor_is_dropped_and_the_listener_bootstraps() -> None:
    """4011: the feed was trimmed past the cursor while the listener caught up."""
    assert disposition(close_code=CloseCode.CURSOR_EXPIRED) is Disposition.RETRY_FRESH
    assert disposition(4011, "cursor_expired") is Disposition.RETRY_FRESH
    assert disposition(error_code="cursor_expired") is Disposition.RETRY_FRESH


def test_unavailable_keeps_the_cursor_and_honours_retry_after_as_a_floor() -> None:
    """4010: back off ``retryAfter`` plus the drawn delay, and resume from the same cursor."""
    assert disposition(4010, "unavailable") is Disposition.RETRY
    assert disposition(close_code=CloseCode.UNAVAILABLE) is Disposition.RETRY
    assert retry_floor(None) == 0.0
    assert retry_floor(2.5) == 2.5
    assert retry_floor(0) == retry_floor(-1) == retry_floor(float("nan")) == 0.0
    assert retry_floor(10**9) == MAX_RETRY_AFTER  # a hint, not a sentence
    backoff = Backoff(BackoffPolicy(initial=0.1, maximum=0.4), random.Random(1))
    waited = backoff.failure(0.0, 5.0)
    assert 5.0 <= waited <= 5.1  # the hint, and the drawn delay on top
    assert backoff.delay == waited  # what status() and the metrics show
    assert 0.0 <= backoff.failure(0.0, None) <= 0.2


def test_error_code_wins_over_close_code_and_http_status() -> None:
    assert disposition(1000, "slow_listener") is Disposition.RETRY
    assert disposition(None, None, 401) is Disposition.STOP
    assert disposition(None, None, 403) is Disposition.STOP
    assert disposition(None, None, 503) is Disposition.RETRY


# -- buffer ----------------------------------------------------------------------------


async def test_memory_buffer_takes_whole_frames_or_none() -> None:
    buffer = MemoryBuffer(5)
    assert isinstance(buffer, Buffer)
    assert await buffer.put([item(i) for i in range(3)])
    assert not await buffer.put([item(i) for i in range(3, 6)])  # 3 + 3 > 5: refused whole
    assert len(buffer) == 3
    assert await buffer.put([item(3), item(4)])
    assert len(buffer) == 5 == buffer.capacity == buffer.peak
    assert [i.cursor for i in await buffer.take(2)] == ["cursor-0", "cursor-1"]
    assert [i.cursor for i in await buffer.take(10)] == ["cursor-2", "cursor-3", "cursor-4"]
    assert await buffer.take(1) == []
    await buffer.put([item(9)])
    await buffer.clear()
    assert len(buffer) == 0


def test_buffer_kinds() -> None:
    assert isinstance(make_buffer("memory", 10), MemoryBuffer)
    with pytest.raises(ListenerConfigError, match="unknown kind 'redis'"):
        make_buffer("redis", 10)
    with pytest.raises(ListenerConfigError, match="at least 1"):
        MemoryBuffer(0)
    register_buffer_kind("test-kind", MemoryBuffer)
    try:
        assert ListenerConfig(buffer_kind="test-kind").buffer_kind == "test-kind"
    finally:
        del BUFFER_KINDS["test-kind"]


# -- frames -------------------------------------------------------------------------------


def test_decode_single_and_batch_frames() -> None:
    one = item(1)
    assert decode_frame(one.encode()) == [one]
    batch = "[" + ",".join(item(n).encode() for n in range(3)) + "]"
    items = decode_frame(batch)
    assert isinstance(items, list), items  # not an ErrorFrame
    assert [i.cursor for i in items] == ["cursor-0", "cursor-1", "cursor-2"]
    assert decode_frame(b"[]") == []
    extra = orjson.dumps({**one.to_json(), "future": 1})  # extra members are allowed
    assert decode_frame(extra) == [one]


def test_decode_error_frame() -> None:
    frame = ErrorFrame("slow_listener", "your queue overflowed").encode()
    assert decode_frame(frame) == ErrorFrame("slow_listener", "your queue overflowed")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("not json", "not valid JSON"),
        ('{"changeKind": {"resource": "vm"}}', "required"),
        ('{"error": {"code": 1}}', "malformed error frame"),
        ('[{"changeKind": {"resource": "vm", "subResources": []}}]', "changedResourceId"),
        ("42", "(document)"),
        (
            '{"changeKind": {"resource": "vm", "subResources": [{}]}, "changedResourceId": "a",'
            ' "cursor": "c", "published": "p"}',
            "subResources/0",
        ),
        (
            '{"changeKind": {"resource": "vm", "subResources": [1]}, "changedResourceId": "a",'
            ' "cursor": "c", "published": "p"}',
            "subResources/0",
        ),
    ],
)
def test_decode_refuses_bad_frames_precisely(raw: str, says: str) -> None:
    with pytest.raises(BadPublisherFrame, match=says.replace("(", r"\(").replace(")", r"\)")):
        decode_frame(raw)


# -- mirror --------------------------------------------------------------------------------


def test_mirror_replace_reports_adds_updates_deletes_and_stays_read_only() -> None:
    mirror: Mirror[int] = Mirror()
    view = mirror.view()
    assert mirror.replace({"a": 1, "b": 2}) == [
        Change("a", None, 1),
        Change("b", None, 2),
    ]
    changes = mirror.replace({"b": 3, "c": 4})
    assert {(c.id, c.old, c.new) for c in changes} == {("b", 2, 3), ("c", None, 4), ("a", 1, None)}
    assert dict(view) == {"b": 3, "c": 4}  # the view is live
    assert mirror.replace({"b": 3, "c": 4}) == []  # nothing changed
    with pytest.raises(TypeError):
        view["x"] = 1  # type: ignore[index]
    assert mirror.put("d", 5) is None and mirror.put("d", 6) == 5
    assert mirror.delete("d") == 6 and mirror.delete("d") is None
    assert mirror.replaces == 3 and "b" in mirror and len(mirror) == 2


def test_a_mirror_restored_encoded_decodes_each_resource_when_first_read() -> None:
    mirror: Mirror[dict[str, int]] = Mirror()
    loads: list[bytes] = []

    def load(raw: bytes) -> dict[str, int]:
        loads.append(raw)
        return dict(orjson.loads(raw))

    encoded = {"a": b'{"n":1}', "b": b'{"n":2}', "c": b'{"n":3}', "d": b'{"n":4}'}
    view = mirror.view()  # taken before the restore: it shows what is restored
    mirror.restore_encoded(encoded, load)
    assert len(mirror) == 4 and "a" in mirror and "z" not in mirror and not loads
    assert len(view) == 4 and "d" in view and not loads
    assert view["a"] == {"n": 1} and mirror.get("b") == {"n": 2} and mirror.get("z") is None
    assert loads == [b'{"n":1}', b'{"n":2}'] and mirror.encoded == 2
    values, still = mirror.copy_parts()  # a checkpoint passes the encoded ones through
    assert values == {"a": {"n": 1}, "b": {"n": 2}} and set(still) == {"c", "d"}
    assert mirror.put("c", {"n": 30}) == {"n": 3} and mirror.delete("d") == {"n": 4}
    assert dict(view) == {"a": {"n": 1}, "b": {"n": 2}, "c": {"n": 30}} and not mirror.encoded
    assert mirror.view() is view  # one live view for the mirror's whole life
    mirror.restore_encoded({"x": b"1", "y": b"2"}, lambda raw: {"n": int(raw)})
    changes = mirror.replace({"x": {"n": 1}, "z": {"n": 9}})  # the old ones decoded to compare
    assert [(c.id, c.old, c.new) for c in changes] == [("z", None, {"n": 9}), ("y", {"n": 2}, None)]


def test_a_mirror_view_taken_before_a_restore_shows_the_restored_resources() -> None:
    mirror: Mirror[int] = Mirror()
    view = mirror.view()
    mirror.restore({"a": 1, "b": 2})
    assert dict(view) == {"a": 1, "b": 2}
    mirror.restore_encoded({"c": b"3"}, int)
    assert dict(view) == {"c": 3} and view.get("a") is None


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"buffer_size": 0}, "buffer_size"),
        ({"buffer_kind": "disk"}, "buffer_kind"),
        ({"ping_interval": 0}, "ping_interval"),
        ({"ack_timeout": 0}, "ack_timeout"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"high_water": 0}, "high_water"),
        ({"page_limit": 0}, "page_limit"),
        # A NaN capacity would never overflow: the buffer would grow without bound.
        ({"buffer_size": float("nan")}, "buffer_size"),
        ({"buffer_size": 2.5}, "buffer_size"),
        ({"buffer_size": True}, "buffer_size"),
        ({"buffer_size": "100"}, "buffer_size"),
        ({"buffer_kind": ["memory"]}, "buffer_kind"),
        ({"page_limit": -5}, "page_limit"),
        ({"page_attempts": float("nan")}, "page_attempts"),
        ({"max_frame_bytes": 0}, "max_frame_bytes"),
        ({"max_attempts": 1.5}, "max_attempts"),
        ({"ping_timeout": float("inf")}, "ping_timeout"),
        ({"open_timeout": -1}, "open_timeout"),
        ({"close_timeout": float("nan")}, "close_timeout"),
        ({"http_timeout": "10"}, "http_timeout"),
        ({"checkpoint_interval": 0}, "checkpoint_interval"),
        ({"checkpoint_replay": float("inf")}, "checkpoint_replay"),
        ({"checkpoint_load_timeout": 0}, "checkpoint_load_timeout"),
        ({"high_water": float("nan")}, "high_water"),
        ({"resume": "no"}, "resume"),
        ({"batch": 1}, "batch"),
        ({"resync_on_overflow": None}, "resync_on_overflow"),
        ({"backoff": {"initial": 1}}, "backoff"),
    ],
)
def test_config_refuses_bad_values(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ListenerConfigError) as info:
        ListenerConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == key


def test_listener_refuses_a_non_websocket_url() -> None:
    with pytest.raises(ListenerConfigError, match="ws:// or wss://"):
        listener_pkg.Listener(
            "http://127.0.0.1:1/changefeeds",
            instance="i",
            service="s",
            change_kind=ChangeKind("vm"),
        )


LISTENER = {
    "url": "ws://127.0.0.1:1/changefeeds",
    "instance": "de1aac97-6f85-4ba9-b51e-514f48a6a46c",
    "service": "tcns",
    "change_kind": ChangeKind("vm", ("nic",)),
}


@pytest.mark.parametrize(
    ("changes", "key", "says"),
    [
        ({"url": "http://127.0.0.1:1/changefeeds", "api_url": "http://127.0.0.1:1/"}, "url", "ws://"),
        ({"url": "ws:///changefeeds"}, "url", "ws://"),
        ({"api_url": "ftp://127.0.0.1/"}, "api_url", "http://"),
        ({"instance": ""}, "instance", "non-empty"),
        ({"service": ""}, "service", "non-empty"),
        ({"service": "x" * 257}, "service", "at most 256 characters, got 257"),
        ({"change_kind": ChangeKind("")}, "change_kind.resource", "non-empty"),
        ({"change_kind": ChangeKind("vm nic")}, "change_kind.resource", "does not match"),
        ({"change_kind": ChangeKind("vm", ("nic", ""))},
         "change_kind.sub_resources[1]", "non-empty"),
        # A str where a tuple belongs, on purpose: the ignore lets the check be tested.
        ({"change_kind": ChangeKind("vm", "nic")}, "change_kind.sub_resources", "tuple of names"),  # type: ignore[arg-type]
        ({"change_kind": ChangeKind("vm", tuple(f"s{n}" for n in range(33)))},
         "change_kind.sub_resources", "at most 32 allowed, got 33"),
        ({"change_kind": "vm"}, "change_kind", "must be a ChangeKind"),
        ({"change_kind": None, "change_kinds": []}, "change_kinds", "at least one"),
        ({"change_kind": None, "change_kinds": [ChangeKind("vm"), ChangeKind("vm", ("nic",))]},
         "change_kinds", "named twice"),
        ({"change_kind": None, "change_kinds": [ChangeKind("vm"), ChangeKind("server", ("",))]},
         "change_kinds[1].sub_resources[0]", "non-empty"),
        ({"change_kind": None, "change_kinds": [ChangeKind(f"r{n}") for n in range(33)]},
         "change_kinds", "at most 32 allowed, got 33"),
        ({"change_kinds": [ChangeKind("server")]}, "change_kinds", "not both"),
        ({"cursor": ""}, "cursor", "non-empty"),
        ({"cursor": "c" * 129}, "cursor", "at most 128 characters"),
        ({"config": {"buffer_size": 10}}, "config", "must be a ListenerConfig"),
        ({"buffer": [1, 2]}, "buffer", "must be a Buffer"),
    ],
)  # fmt: skip
def test_listener_refuses_what_the_publisher_or_the_connection_loop_would_refuse_later(
    changes: dict[str, object], key: str, says: str
) -> None:
    """Each setting a registration, a connection or the buffer could not work with is
    refused by the constructor, named, instead of failing inside the connection loop
    (a registration the publisher refuses ends the listener with RegistrationRefused)."""
    kwargs = {**LISTENER, **changes}
    url = kwargs.pop("url")
    with pytest.raises(ListenerConfigError) as info:
        listener_pkg.Listener(url, **kwargs)  # type: ignore[arg-type]
    assert info.value.key == key and says in str(info.value), str(info.value)


def test_listener_takes_sub_resources_as_a_list_and_keeps_them_as_a_tuple() -> None:
    kwargs = {**LISTENER, "change_kind": ChangeKind("vm", ["nic", "alias"])}  # type: ignore[arg-type]
    url = kwargs.pop("url")
    listener = listener_pkg.Listener(url, **kwargs)  # type: ignore[arg-type]
    assert listener.change_kinds == (ChangeKind("vm", ("nic", "alias")),)
