"""Registration as a decision, without sockets or a database (publisher/registration.py)."""

from __future__ import annotations

import uuid

import msgspec
import orjson
import pytest

from changefeed.publisher import PublisherConfig, ResourceConfig
from changefeed.publisher.feed import FeedState, ResumeFacts
from changefeed.publisher.registration import (
    Refusal,
    Request,
    check_capacity,
    check_registration,
    plan_resume,
    read_cursor,
)
from changefeed.schemas import ORIGIN, ChangeKind, Cursor, CursorCodec, Position

CONFIG = PublisherConfig(
    dsn="postgresql://unused/x",
    resources=(
        ResourceConfig("vm", "/vms", ("nic", "alias")),
        ResourceConfig("server", "/servers"),
    ),
    max_registrations=2,
    max_connections=10,
)
FEED = uuid.uuid4()
CODEC = CursorCodec(b"the feed's own key", FEED.bytes)


def frame(**doc: object) -> str:
    base: dict[str, object] = {"instance": "i-1", "service": "dns"}
    base.update(doc)
    return orjson.dumps(base).decode()


VM = {"resource": "vm", "subResources": ["nic"]}


def test_capacity_is_decided_before_the_frame_is_read() -> None:
    assert check_capacity(CONFIG, draining=False, connections=10) is None
    full = check_capacity(CONFIG, draining=False, connections=11)
    assert isinstance(full, Refusal) and full.code == "too_many_connections" and full.retry_after
    going = check_capacity(CONFIG, draining=True, connections=1)
    assert isinstance(going, Refusal) and going.code == "unavailable"


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("not json", "bad_frame"),
        (frame(), "invalid_registration"),
        (frame(changeKind={"resource": "vmz", "subResources": []}), "unknown_resource"),
        (frame(resources=[VM, VM, VM]), "too_many_registrations"),
        (
            frame(resources=[VM, {"resource": "server", "subResources": []}], extra=1),
            "invalid_registration",
        ),
    ],
)
def test_bad_registrations_are_refused_with_their_code(text: str, code: str) -> None:
    refusal = check_registration(text, config=CONFIG, access=frozenset({"*"}))
    assert isinstance(refusal, Refusal) and refusal.code == code, refusal


def test_the_token_must_be_allowed_every_resource_and_more_kinds_than_allowed_are_refused() -> None:
    v2 = frame(resources=[VM, {"resource": "server", "subResources": []}])
    forbidden = check_registration(v2, config=CONFIG, access=frozenset({"vm"}))
    assert isinstance(forbidden, Refusal) and forbidden.code == "forbidden"
    many = msgspec.structs.replace(CONFIG, max_registrations=1)
    too_many = check_registration(v2, config=many, access=frozenset({"*"}))
    assert isinstance(too_many, Refusal) and too_many.code == "too_many_registrations"


def test_a_valid_registration_names_its_interest_routes_and_undeclared_sub_resources() -> None:
    text = frame(changeKind={"resource": "vm", "subResources": ["nic", "disk"]}, batch=True)
    request = check_registration(text, config=CONFIG, access=frozenset({"vm"}))
    assert isinstance(request, Request)
    assert [r.bootstrap_route for r in request.routes] == ["/vms"]
    assert request.undeclared == (("vm", ("disk",)),)
    assert request.interest.kinds == (ChangeKind("vm", ("nic", "disk")),)
    assert request.registration.batch


def test_a_cursor_of_another_feed_is_not_garbage_but_one_with_a_wrong_digest_is() -> None:
    other = CursorCodec(b"another key", uuid.uuid4().bytes).encode(Position(5, 6), 1)
    assert read_cursor(other, CODEC) is None
    forged = CursorCodec(b"another key", FEED.bytes).encode(Position(5, 6), 1)
    refusal = read_cursor(forged, CODEC)
    assert isinstance(refusal, Refusal) and refusal.code == "bad_cursor"
    assert read_cursor(CODEC.encode(Position(5, 6), 7), CODEC) == Cursor(Position(5, 6), 7)


HEAD = Position(100, 100)


def facts(
    *,
    stamp: int | None = 7,
    newest: Position = HEAD,
    low_water: Position = ORIGIN,
    compacted: Position = ORIGIN,
    feed_id: uuid.UUID = FEED,
    next_txid: int = 200,
) -> ResumeFacts:
    state = FeedState(feed_id, b"key", low_water, compacted)
    return ResumeFacts(state=state, newest=newest, next_txid=next_txid, stamp=stamp)


@pytest.mark.parametrize(
    ("since", "told", "decision"),
    [
        (Cursor(Position(50, 50), 7), facts(), (True, None)),
        (Cursor(Position(50, 50), 7), facts(feed_id=uuid.uuid4()), (False, "other_feed")),
        (Cursor(Position(150, 150), 7), facts(), (False, "cursor_ahead")),
        (Cursor(Position(50, 50), 7), facts(next_txid=50), (False, "cursor_ahead")),
        (Cursor(Position(50, 50), 7), facts(low_water=Position(60, 60)), (False, "cursor_expired")),
        (Cursor(Position(50, 50), 7), facts(stamp=8), (False, "unknown_position")),
        (Cursor(Position(50, 50), 7), facts(stamp=None), (False, "unknown_position")),
        # An entry merged away by compaction, or the low-water mark itself: resumable.
        (Cursor(Position(50, 50), 7), facts(stamp=None, compacted=Position(60, 60)), (True, None)),
        (Cursor(Position(60, 60), 7), facts(stamp=None, low_water=Position(60, 60)), (True, None)),
        (Cursor(Position(50, 10), 7), facts(), (False, "too_far_behind")),
    ],
)
def test_plan_resume_says_whether_and_why_not(
    since: Cursor, told: ResumeFacts, decision: tuple[bool, str | None]
) -> None:
    assert plan_resume(since, told, feed_id=FEED, head=HEAD, replay_limit=80) == decision


def test_the_origin_of_a_feed_never_trimmed_is_resumable() -> None:
    origin = Cursor(ORIGIN, 0)
    decided = plan_resume(origin, facts(stamp=None), feed_id=FEED, head=HEAD, replay_limit=1000)
    assert decided == (True, None)
