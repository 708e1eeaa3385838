"""changefeed.compaction without Spark: the reference plan, the I5 model,
the DSN -> JDBC conversion, argument checks, and the apply step's safety guards
against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from helpers import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.compaction import (
    COMPACTION_LOCK_KEY,
    CompactionStore,
    CompactionSummary,
    Cutoffs,
    GcRegion,
    PlanEntry,
    PreviousRun,
    RunLog,
    Scope,
    choose_scope,
    covers,
    jdbc_from_dsn,
    merge_subs,
    notifications,
    plan_feed,
    run_compaction,
    simulate,
    uncovered,
)
from changefeed.compaction.durations import format_duration, parse_duration
from changefeed.compaction.errors import CompactionError
from changefeed.compaction.frames import block_ranges, read_predicates
from changefeed.compaction.jdbc import find_jdbc_jar
from changefeed.compaction.scope import delta_of
from changefeed.schemas import ORIGIN, Position

# --------------------------------------------------------------------------- unions


def test_merge_subs_is_the_union_and_whole_resource_absorbs() -> None:
    assert merge_subs([("nic",), ("alias", "nic")]) == ("alias", "nic")
    assert merge_subs([("nic",), (), ("alias",)]) == ()
    assert merge_subs([]) == ()  # nothing to merge: no sub-resource at all


def test_covers() -> None:
    assert covers((), ("nic",)) and covers((), ())
    assert covers(("alias", "nic"), ("nic",))
    assert not covers(("nic",), ("alias",))
    assert not covers(("nic",), ())  # only the whole resource covers the whole resource


def test_uncovered_treats_whole_resource_as_covering_every_sub_resource() -> None:
    before = notifications([("vm", "a", ("nic",)), ("vm", "b", ())])
    assert uncovered(before, notifications([("vm", "a", ()), ("vm", "b", ())])) == set()
    assert uncovered(before, notifications([("vm", "a", ("alias",)), ("vm", "b", ("nic",))])) == {
        ("vm", "a", "nic"),
        ("vm", "b", None),
    }


# --------------------------------------------------------------------------- the plan

SUBS = st.sampled_from([(), ("nic",), ("alias",), ("alias", "nic"), ("disk", "nic")])
AGE = st.sampled_from(["garbage", "candidate", "young"])


@st.composite
def feeds(draw: st.DrawFn) -> tuple[list[PlanEntry], Position]:
    n = draw(st.integers(0, 40))
    ids = draw(st.permutations(range(1, n + 1)))
    entries = []
    for i in range(n):
        age = draw(AGE)
        entries.append(
            PlanEntry(
                Position(draw(st.integers(1, 30)), ids[i]),
                draw(st.sampled_from(["vm", "net"])),
                draw(st.sampled_from(["a", "b", "c", "d"])),
                draw(SUBS),
                garbage=age == "garbage",
                candidate=age != "young",
            )
        )
    low_water = draw(st.sampled_from([ORIGIN, *(e.position for e in entries)]))
    return entries, low_water


def _replay(
    feed: dict[Position, tuple[str, str, tuple[str, ...]]], cursor: Position
) -> set[tuple[str, str, str | None]]:
    return notifications(v for p, v in feed.items() if p > cursor)


@given(feeds(), st.data())
@settings(max_examples=300, deadline=None)
def test_reference_plan_keeps_every_resumable_notification(
    feed: tuple[list[PlanEntry], Position], data: st.DataObject
) -> None:
    """I5 on the reference algorithm: for every cursor at or after the new low-water
    mark, a resume after the plan delivers every notification it delivered before."""
    entries, low_water = feed
    head = max((e.position for e in entries), default=ORIGIN)
    plan = plan_feed(entries, head)
    before = {e.position: (e.resource, e.changed_resource_id, e.sub_resources) for e in entries}
    after, new_low = simulate(entries, plan, low_water)
    assert new_low >= low_water
    assert all(p <= new_low for p in plan.garbage)
    extra = data.draw(st.lists(st.tuples(st.integers(0, 31), st.integers(0, 41)), max_size=5))
    cursors = {ORIGIN, low_water, new_low, *before, *(Position(t, i) for t, i in extra)}
    for cursor in cursors:
        if cursor < new_low:
            continue  # not resumable: answered with resumed=false
        assert uncovered(_replay(before, cursor), _replay(after, cursor)) == set()
    # The result is a fixed point: planning again changes nothing.
    again = [
        PlanEntry(
            p,
            r,
            i,
            s,
            garbage=p in {e.position for e in entries if e.garbage},
            candidate=p in {e.position for e in entries if e.candidate},
        )
        for p, (r, i, s) in after.items()
    ]
    replan = plan_feed(again, head)
    assert not replan.garbage and not replan.drops and not replan.updates


@given(feeds(), st.data())
@settings(max_examples=200, deadline=None)
def test_partial_application_then_replanning_converges(
    feed: tuple[list[PlanEntry], Position], data: st.DataObject
) -> None:
    """Idempotence on the reference: apply any prefix of a plan (in the job's order:
    garbage, keepers, drops), plan again from what is left, apply that: the same
    feed and low-water mark as one clean run."""
    entries, low_water = feed
    head = max((e.position for e in entries), default=ORIGIN)
    plan = plan_feed(entries, head)
    clean, clean_low = simulate(entries, plan, low_water)
    steps = (
        [("gc", p) for p in sorted(plan.garbage)]
        + [("keep", p) for p in sorted(plan.updates)]
        + [("drop", p) for p in sorted(plan.drops)]
    )
    cut = data.draw(st.integers(0, len(steps)))
    by_pos = {e.position: e for e in entries}
    low = low_water
    for kind, p in steps[:cut]:
        e = by_pos.get(p)
        if kind == "gc":
            by_pos.pop(p)
            low = max(low, p)
        elif kind == "keep" and e is not None:
            by_pos[p] = PlanEntry(
                p,
                e.resource,
                e.changed_resource_id,
                plan.updates[p],
                garbage=e.garbage,
                candidate=e.candidate,
            )
        elif kind == "drop":
            by_pos.pop(p)
    partial = list(by_pos.values())
    rerun = plan_feed(partial, head)
    final, final_low = simulate(partial, rerun, low)
    assert final == clean
    assert final_low == clean_low


def test_plan_ignores_entries_after_the_head() -> None:
    e = PlanEntry(Position(9, 9), "vm", "a", (), garbage=True, candidate=True)
    assert plan_feed([e], Position(9, 8)).garbage == frozenset()


def test_keeper_is_latest_position_not_latest_id() -> None:
    old = PlanEntry(Position(5, 100), "vm", "a", ("nic",), garbage=False, candidate=True)
    new = PlanEntry(Position(6, 1), "vm", "a", ("alias",), garbage=False, candidate=True)
    plan = plan_feed([old, new], Position(10, 0))
    assert plan.drops == {Position(5, 100): Position(6, 1)}
    assert plan.updates == {Position(6, 1): ("alias", "nic")}


# --------------------------------------------------------------------------- incremental runs

FEED = __import__("uuid").UUID("12345678-1234-5678-1234-567812345678")
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _previous(**changes: object) -> PreviousRun:
    fields: dict[str, object] = {
        "run_id": 7,
        "finished": True,
        "cutoffs": Cutoffs(Position(50, 500), _at(1000), _at(5000)),
        "horizon": 55,
        "feed_id": FEED,
        "index_intact": True,
        "last_full": _at(5000),
        "names": ("nic",),
    }
    fields.update(changes)
    return PreviousRun(**fields)  # type: ignore[arg-type]


NOW = Cutoffs(Position(60, 600), _at(1600), _at(5600))


@pytest.mark.parametrize(
    ("previous", "requested", "reason"),
    [
        (None, False, "no previous run"),
        (_previous(), True, "requested"),
        (_previous(finished=False), False, "run 7 did not finish"),
        (_previous(feed_id=None), False, "restored or recreated"),
        (_previous(horizon=80), False, "restored"),
        (_previous(index_intact=False), False, "index of kept entries is gone"),
        (_previous(last_full=_at(0)), False, "older than the max age"),
        (_previous(last_full=None), False, "older than the max age"),
        (_previous(names=None), False, "did not record its sub-resource names"),
    ],
)
def test_a_run_is_full_when_the_previous_one_does_not_cover_the_feed(
    previous: PreviousRun | None, requested: bool, reason: str
) -> None:
    scope = choose_scope(
        NOW,
        previous,
        horizon=65,
        feed_id=FEED,
        max_age=4600,
        taken=_at(6200),
        full_requested=requested,
    )
    assert scope.full and reason in scope.reason


def test_an_incremental_run_reads_after_the_previous_head_and_two_bands_of_ages() -> None:
    scope = choose_scope(NOW, _previous(), horizon=65, feed_id=FEED, max_age=4600, taken=_at(6200))
    assert scope == Scope(
        False,
        "after run 7",
        since=Position(50, 500),
        gc_band=(_at(1000), _at(1600)),
        lag_band=(_at(5000), _at(5600)),
        kept_until=_at(5000),
    )
    # Longer durations than last time: nothing aged into either band.
    longer = Cutoffs(NOW.head, _at(900), _at(4000))
    scope = choose_scope(
        longer, _previous(), horizon=65, feed_id=FEED, max_age=4600, taken=_at(6200)
    )
    assert scope.gc_band is None and scope.lag_band is None and scope.kept_until == _at(4000)
    # A max age shorter than the last lag: the lag band starts at the new gc cutoff.
    short = Cutoffs(NOW.head, _at(5300), _at(5900))
    scope = choose_scope(
        short, _previous(), horizon=65, feed_id=FEED, max_age=4600, taken=_at(6200)
    )
    assert scope.gc_band == (_at(1000), _at(5300)) and scope.lag_band == (_at(5300), _at(5900))


@st.composite
def two_runs(draw: st.DrawFn) -> dict[str, object]:
    """A feed with publication times, the first run's bounds, entries that come
    after it, and the second run's bounds (time moved on, durations may differ)."""
    n = draw(st.integers(0, 50))
    ids = draw(st.permutations(range(1, n + 1)))
    rows = []
    for i in range(n):
        rows.append(
            (
                Position(draw(st.integers(1, 40)), ids[i]),
                draw(st.sampled_from(["vm", "net"])),
                draw(st.sampled_from(["a", "b", "c", "d", "e"])),
                draw(SUBS),
                draw(st.integers(0, 100)),  # published
            )
        )
    head1 = Position(draw(st.integers(0, 30)), draw(st.integers(0, n + 1)))
    t1 = draw(st.integers(60, 110))
    age1, lag1 = sorted(draw(st.lists(st.integers(1, 60), min_size=2, max_size=2)), reverse=True)
    t2 = t1 + draw(st.integers(0, 40))
    age2, lag2 = sorted(draw(st.lists(st.integers(1, 60), min_size=2, max_size=2)), reverse=True)
    head2 = max(head1, Position(draw(st.integers(0, 41)), draw(st.integers(0, n + 1))))
    return {
        "rows": rows,
        "run1": Cutoffs(head1, _at(t1 - age1), _at(t1 - lag1)),
        "run2": Cutoffs(head2, _at(t2 - age2), _at(t2 - lag2)),
        "t2": t2,
    }


Row = tuple[Position, str, str, tuple[str, ...], int]
"""One of two_runs' rows: (position, resource, changed resource id, sub-resources,
published: seconds after T0)."""


def _entries(rows: list[Row], cut: Cutoffs) -> list[PlanEntry]:
    return [
        PlanEntry(p, r, i, s, garbage=_at(t) < cut.gc, candidate=_at(t) < cut.lag)
        for p, r, i, s, t in rows
    ]


@given(two_runs())
@settings(max_examples=400, deadline=None)
def test_an_incremental_run_after_a_full_one_plans_what_a_full_run_would(
    case: dict[str, object],
) -> None:
    """The scope's argument, on the reference: after a finished full run, the
    garbage and the merge of what an incremental run reads (the entries after the
    previous head, the two bands of ages, the indexed keepers of the ids they
    touch) leave the feed exactly as a full run would."""
    rows, run1, run2 = case["rows"], case["run1"], case["run2"]
    assert isinstance(rows, list) and isinstance(run1, Cutoffs) and isinstance(run2, Cutoffs)
    # Run 1 (full) on the entries it could see: everything at or before its head
    # is final; entries after it may be in transactions still open.
    first = plan_feed(_entries(rows, run1), run1.head)
    state, _ = simulate(_entries(rows, run1), first, ORIGIN)
    keys: dict[tuple[str, str], Position] = {}
    for e in _entries(rows, run1):
        if e.position <= run1.head and e.candidate and not e.garbage:
            key = (e.resource, e.changed_resource_id)
            keys[key] = max(keys.get(key, e.position), first.drops.get(e.position, e.position))
    published = {p: _at(t) for p, _, _, _, t in rows}
    after1 = [(p, r, i, s, t) for p, r, i, s, t in rows if p in state]
    after1 = [(p, r, i, state[p][2], t) for p, r, i, s, t in after1]
    entries2 = _entries(after1, run2)
    full = plan_feed(entries2, run2.head)
    expected, _ = simulate(entries2, full, ORIGIN)

    previous = PreviousRun(1, True, run1, 0, FEED, True, run1.lag, names=())
    t2 = case["t2"]
    assert isinstance(t2, int)
    scope = choose_scope(run2, previous, horizon=0, feed_id=FEED, max_age=10_000, taken=_at(t2))
    assert not scope.full
    garbage, members = delta_of(entries2, published, scope, keys, run2.head)
    assert garbage == full.garbage
    flagged = [*members, *(e for e in entries2 if e.position in garbage)]
    incremental = plan_feed(flagged, run2.head)
    got, _ = simulate(entries2, incremental, ORIGIN)
    assert got == expected


def test_block_ranges_cover_the_table_without_overlap() -> None:
    assert block_ranges(0, 4) == [(0, None)]
    assert block_ranges(10, 3) == [(0, 3), (3, 6), (6, None)]
    assert block_ranges(2, 8) == [(0, 1), (1, None)]


def test_read_predicates_bound_each_partition_to_its_pages_and_the_head() -> None:
    from changefeed.compaction import FeedSnapshot

    snap = FeedSnapshot(7, datetime.now(UTC), Position(5, 42), ORIGIN, 10)
    preds = read_predicates(snap, [(0, 5), (5, None)], "published < now()")
    assert preds[0] == (
        "ctid < '(5,0)'::tid AND (txid, id) <= ('5'::xid8, 42) AND published < now()"
    )
    assert preds[1].startswith("ctid >= '(5,0)'::tid AND (txid, id) <= ")


# --------------------------------------------------------------------------- DSN -> JDBC


@pytest.mark.parametrize(
    ("dsn", "url", "props"),
    [
        (
            "postgresql://postgres@127.0.0.1:5432/feeds",
            "jdbc:postgresql://127.0.0.1:5432/feeds",
            {"user": "postgres"},
        ),
        (
            "postgres://u%40corp:p%3Aw%2Fd@[::1]:6432/my%20db?sslmode=verify-full"
            "&application_name=cf&connect_timeout=5",
            "jdbc:postgresql://[::1]:6432/my%20db",
            {
                "user": "u@corp",
                "password": "p:w/d",
                "sslmode": "verify-full",
                "ApplicationName": "cf",
                "connectTimeout": "5",
            },
        ),
        (
            "postgresql://app:secret@db1:5432,db2/feeds?target_session_attrs=read-write",
            "jdbc:postgresql://db1:5432,db2/feeds",
            {"user": "app", "password": "secret", "targetServerType": "primary"},
        ),
        (
            "postgresql:///feeds?host=db&port=7000&user=me",
            "jdbc:postgresql://db:7000/feeds",
            {"user": "me"},
        ),
        ("postgresql://bob@db", "jdbc:postgresql://db/bob", {"user": "bob"}),
    ],
)
def test_jdbc_from_dsn(dsn: str, url: str, props: dict[str, str]) -> None:
    target = jdbc_from_dsn(dsn, env={})
    assert target.url == url
    assert dict(target.properties) == {**props, "driver": "org.postgresql.Driver"}


def test_jdbc_password_never_in_url_or_repr() -> None:
    target = jdbc_from_dsn("postgresql://u:hunter2@h/db", env={})
    assert "hunter2" not in target.url and "hunter2" not in repr(target)


def test_jdbc_env_fills_in_what_the_dsn_leaves_out_as_for_asyncpg() -> None:
    """Spark reads the database the job's own connection (asyncpg, which honours libpq's
    variables) locks and writes: the one PGHOST, PGPORT and PGDATABASE name, not the one
    named after the user on localhost; and PGSSLMODE is kept, not dropped."""
    env = {
        "PGHOST": "db1,db2",
        "PGPORT": "6432",
        "PGDATABASE": "feeds",
        "PGSSLMODE": "verify-full",
        "PGTARGETSESSIONATTRS": "read-write",
    }
    target = jdbc_from_dsn("postgresql://u@/", env=env)
    assert target.url == "jdbc:postgresql://db1:6432,db2:6432/feeds"
    assert target.properties["sslmode"] == "verify-full"
    assert target.properties["targetServerType"] == "primary"
    spelled = jdbc_from_dsn("postgresql://u@h:5433/db?sslmode=disable", env=env)
    assert spelled.url == "jdbc:postgresql://h:5433/db"  # the DSN's own win
    assert spelled.properties["sslmode"] == "disable"
    with pytest.raises(CompactionError, match="PGSSLMODE"):
        jdbc_from_dsn("postgresql://u@h/db", env={"PGSSLMODE": "sometimes"})
    # A socket directory (libpq's, asyncpg's) is no host for JDBC: localhost, as before.
    socket_dir = jdbc_from_dsn("postgresql://u@/db", env={"PGHOST": "/var/run/postgresql"})
    assert socket_dir.url == "jdbc:postgresql://localhost/db"


def test_jdbc_env_fills_in_user_and_password() -> None:
    target = jdbc_from_dsn("postgresql://h/db", env={"PGUSER": "u", "PGPASSWORD": "p"})
    assert target.properties["user"] == "u" and target.properties["password"] == "p"


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("mysql://h/db", "expected postgresql://"),
        ("host=h dbname=x", "expected postgresql://"),
        ("postgresql://h/db?frobnicate=1", "'frobnicate' is not supported"),
        ("postgresql:///db?host=/var/run/postgresql", "unix-socket"),
        ("postgresql://h:0/db", "bad port"),
        ("postgresql://h:x/db", "bad port"),
        ("postgresql://h/db?sslmode=sometimes", "sslmode='sometimes'"),
        ("postgresql://h/db?target_session_attrs=weird", "target_session_attrs"),
    ],
)
def test_jdbc_from_dsn_refuses_clearly(dsn: str, message: str) -> None:
    with pytest.raises(CompactionError, match=message):
        jdbc_from_dsn(dsn, env={})


def test_find_jdbc_jar(tmp_path: object) -> None:
    with pytest.raises(CompactionError, match="does not exist"):
        find_jdbc_jar("/nonexistent/postgresql.jar")
    with pytest.raises(CompactionError, match="CHANGEFEED_JDBC_JAR"):
        find_jdbc_jar(None, env={"CHANGEFEED_JDBC_JAR": "/nonexistent.jar"})


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_age": 0, "compaction_lag": 1}, "max_age must be a positive"),
        ({"max_age": 60, "compaction_lag": -1}, "compaction_lag must be a positive"),
        # Shorter than a microsecond rounds to a lag of nothing on the way to a cutoff.
        ({"max_age": 60, "compaction_lag": 1e-10}, "compaction_lag must be at least 1ms"),
        ({"max_age": 0.0005, "compaction_lag": 0.0001}, "max_age must be at least 1ms"),
        ({"max_age": 60, "compaction_lag": 600}, "must not be shorter than compaction_lag"),
        # 800000 days before now is no date: refused, not an OverflowError mid-run.
        ({"max_age": 800_000 * 86400, "compaction_lag": 60}, r"max_age must be at most 100 years"),
        ({"max_age": 600, "compaction_lag": 60, "batch_size": 0}, "batch_size"),
        ({"max_age": 600, "compaction_lag": 60, "schema": "Bad-Name"}, "schema name"),
        ({"max_age": 600, "compaction_lag": 60, "keepers": "index"}, "keepers must be one of"),
    ],
)
def test_run_compaction_refuses_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CompactionError, match=message):
        run_compaction("postgresql://h/db", **kwargs)  # type: ignore[arg-type]


def test_compaction_error_is_its_own_root() -> None:
    assert CompactionError.__mro__[1:] == (Exception, BaseException, object)


def _modules_after(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``statement``."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_publisher_does_not_import_the_compaction_job_nor_spark() -> None:
    loaded = _modules_after("import changefeed.publisher, changefeed.publisher.service")
    assert "changefeed.publisher.service" in loaded
    assert not {m for m in loaded if m.startswith(("changefeed.compaction", "pyspark", "py4j"))}


def test_the_compaction_job_does_not_import_the_publisher() -> None:
    """Every module of the package, imported in a fresh interpreter."""
    loaded = _modules_after(
        "import importlib, pkgutil, changefeed.compaction as c\n"
        "for m in pkgutil.iter_modules(c.__path__, 'changefeed.compaction.'):\n"
        "    importlib.import_module(m.name)"
    )
    assert {"changefeed.compaction.submit", "changefeed.compaction.session"} <= loaded
    assert not {m for m in loaded if m.startswith("changefeed.publisher")}
    assert not {m for m in loaded if m.startswith(("pyspark", "py4j"))}  # only run_compaction


def test_every_module_is_documented_and_exports_its_names() -> None:
    import changefeed.compaction as package

    for name in package.__all__:
        assert hasattr(package, name), name
    for info in pkgutil.iter_modules(package.__path__, "changefeed.compaction."):
        module = importlib.import_module(info.name)
        assert module.__doc__ and "__all__" in vars(module), info.name
        for name in module.__all__:
            assert hasattr(module, name), (info.name, name)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("500ms", 0.5), ("10m", 600.0), (" 24h ", 86400.0), ("1.5d", 129600.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "-5m", "10 minutes", "5w"])
def test_parse_duration_refuses_clearly(text: str) -> None:
    with pytest.raises(CompactionError, match=r"--max-age: expected a duration such as"):
        parse_duration(text, "--max-age")


@pytest.mark.parametrize("text", ["800000d", "100000000d", "36501d"])
def test_parse_duration_refuses_more_than_a_hundred_years(text: str) -> None:
    with pytest.raises(CompactionError, match=r"--max-age: must be at most 100 years \(36500d\)"):
        parse_duration(text, "--max-age")
    assert parse_duration("36500d") == 36500 * 86400


def test_format_duration() -> None:
    assert [format_duration(s) for s in (86400, 600, 7200, 90, 0.5)] == [
        "1d",
        "10m",
        "2h",
        "90s",
        "0.5s",
    ]


async def test_run_compaction_refuses_a_running_event_loop() -> None:
    with pytest.raises(CompactionError, match=r"asyncio\.to_thread"):
        run_compaction("postgresql://h/db", max_age=60, compaction_lag=60)


def test_summary_text() -> None:
    s = CompactionSummary(
        schema="changefeed",
        dry_run=True,
        max_age=86400,
        compaction_lag=600,
        scanned=1000,
        collected=400,
        merged=300,
        rewritten=50,
        groups=100,
        partitions=2,
        phases={"spark": 1.0, "scan-gc": 0.5},
        seconds=2.0,
    )
    text = s.to_text()
    assert "dry run" in text and "would delete 400 older than 1d" in text
    assert "would delete 300" in text and "older than 10m" in text
    assert "500 entries/s" in text and "total 2.0s" in text
    assert s.to_dict()["rows_per_second"] == 500.0


# --------------------------------------------------------------------------- PostgreSQL, no Spark


async def test_refused_while_another_job_holds_the_lock(feed_dsn: str) -> None:
    holder = await asyncpg.connect(feed_dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", COMPACTION_LOCK_KEY)
        with pytest.raises(CompactionError, match="another compaction job is running"):
            await asyncio.to_thread(
                run_compaction, feed_dsn, max_age=86400, compaction_lag=600, lock_wait=0.2
            )
    finally:
        await holder.close()


async def test_refused_without_a_feed_table(dsn: str) -> None:
    with pytest.raises(CompactionError, match="no feed table"):
        await asyncio.to_thread(run_compaction, dsn, max_age=86400, compaction_lag=600)


async def test_unreachable_database_is_a_compaction_error() -> None:
    from helpers import free_port

    with pytest.raises(CompactionError, match="cannot connect"):
        await asyncio.to_thread(
            run_compaction,
            f"postgresql://postgres@127.0.0.1:{free_port()}/x?connect_timeout=2",
            max_age=86400,
            compaction_lag=600,
        )


async def test_empty_feed_needs_no_spark(feed_dsn: str) -> None:
    summary = await asyncio.to_thread(
        run_compaction, feed_dsn, max_age=86400, compaction_lag=600, master="no-such-master"
    )
    assert summary.scanned == 0 and summary.head == ORIGIN and "spark" not in summary.phases


async def _insert(conn: asyncpg.Connection, rows: list[tuple[str, str, list[str], float]]) -> None:
    now = datetime.now(UTC)
    for resource, changed_id, subs, age in rows:
        await conn.execute(
            "INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id, published)"
            " VALUES ($1, $2, $3, $4)",
            resource,
            subs,
            changed_id,
            now - timedelta(seconds=age),
        )


async def _staged(
    conn: asyncpg.Connection, store: CompactionStore, rows: list[tuple[object, ...]]
) -> int:
    snap = await store.snapshot()
    runs = RunLog(conn, "changefeed")
    await runs.ensure()
    now = Cutoffs(snap.head, snap.taken, snap.taken)
    run_id = await runs.begin(now, Scope(True, "test"), horizon=snap.horizon, feed_id=snap.feed_id)
    table = await store.create_staging(run_id)
    for row in rows:
        await conn.execute(
            f"INSERT INTO {table} (kind, txid, id, keep_txid, keep_id, sub_resources)"
            " VALUES ($1, $2, $3, $4, $5, $6)",
            *row,
        )
    await store.index_staging(run_id)
    return run_id


WALKS = pytest.mark.parametrize(
    "server_version", [150000, 130000], ids=["page-walk", "keyset-walk (PostgreSQL 13)"]
)


@WALKS
async def test_drop_guard_keeps_an_entry_its_keeper_does_not_cover(
    feed_dsn: str, server_version: int
) -> None:
    """A stale or wrong plan cannot lose a notification: a drop needs a later entry of
    the same resource id that covers it, in the feed at the time of the delete."""
    conn = await asyncpg.connect(feed_dsn)
    try:
        await _insert(
            conn,
            [
                ("vm", "a", ["nic"], 7200),  # 1: would be dropped into 2
                ("vm", "a", ["alias"], 7100),  # 2: keeper, not (yet) covering nic
                ("vm", "b", ["nic"], 7000),  # 3: "keeper" 4 is another resource id
                ("vm", "c", ["nic"], 6900),  # 4
                ("vm", "d", ["nic"], 6800),  # 5: keeper 6 is earlier... in a bad plan
                ("vm", "d", [], 6700),  # 6
            ],
        )
        pos = {
            r["id"]: (r["txid"], r["id"])
            for r in await conn.fetch("SELECT txid::text::bigint AS txid, id FROM changefeed.feed")
        }
        store = CompactionStore(conn, "changefeed")
        await store.prepare()
        store.server_version = server_version
        run_id = await _staged(
            conn,
            store,
            [
                (3, *pos[1], *pos[2], None),
                (3, *pos[3], *pos[4], None),
                (3, *pos[6], *pos[5], None),
            ],
        )
        assert await store.apply_drops(run_id, 10) == 0
        assert await conn.fetchval("SELECT count(*) FROM changefeed.feed") == 6
        # Once the keeper carries the union, the same drop goes through.
        await conn.execute(
            f"INSERT INTO {store.staging_table(run_id)} VALUES (2, $1, $2, NULL, NULL, $3)",
            *pos[2],
            ["alias", "nic"],
        )
        assert await store.apply_keepers(run_id, 10) == 1
        assert await store.apply_drops(run_id, 10) == 1
        assert await store.apply_drops(run_id, 10) == 0  # idempotent
        subs = await conn.fetchval("SELECT sub_resources FROM changefeed.feed WHERE id = 2")
        assert subs == ["alias", "nic"]
    finally:
        await conn.close()


@WALKS
async def test_keeper_update_only_widens(feed_dsn: str, server_version: int) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        await _insert(conn, [("vm", "a", ["disk"], 7200), ("vm", "b", [], 7200)])
        rows = await conn.fetch("SELECT txid::text::bigint AS txid, id FROM changefeed.feed")
        store = CompactionStore(conn, "changefeed")
        await store.prepare()
        store.server_version = server_version
        run_id = await _staged(
            conn,
            store,
            [(2, r["txid"], r["id"], None, None, ["nic"]) for r in rows],
        )
        assert await store.apply_keepers(run_id, 1) == 2
        got = {
            r["changed_resource_id"]: r["sub_resources"]
            for r in await conn.fetch(
                "SELECT changed_resource_id, sub_resources FROM changefeed.feed"
            )
        }
        assert got == {"a": ["disk", "nic"], "b": []}
    finally:
        await conn.close()


async def test_gc_rechecks_age_and_never_lowers_the_low_water_mark(feed_dsn: str) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        await _insert(conn, [("vm", "a", [], 90000), ("vm", "b", [], 60), ("vm", "c", [], 90000)])
        rows = await conn.fetch(
            "SELECT txid::text::bigint AS txid, id FROM changefeed.feed ORDER BY id"
        )
        first, last = Position(*rows[0]), Position(*rows[-1])
        await conn.execute(
            "UPDATE changefeed.feed_state SET low_water_txid = $1::bigint::text::xid8,"
            " low_water_id = $2",
            first.txid,
            first.id,
        )
        store = CompactionStore(conn, "changefeed")
        await store.prepare()
        cutoff = datetime.now(UTC) - timedelta(days=1)
        # One region spanning all three entries: the young one survives.
        region = [GcRegion(first, last, 2)]
        assert await store.apply_gc(region, cutoff, 1000) == (2, 1)
        assert [
            r["changed_resource_id"]
            for r in await conn.fetch("SELECT changed_resource_id FROM changefeed.feed")
        ] == ["b"]
        assert await store.low_water() == last
        # A rerun deletes nothing and leaves the mark where it is.
        assert await store.apply_gc(region, cutoff, 1000) == (0, 1)
        assert await store.low_water() == last
    finally:
        await conn.close()


def test_spark_errors_report_the_innermost_java_cause() -> None:
    from changefeed.compaction.job import _spark_message

    class Java:
        def __init__(self, text: str, cause: Java | None = None) -> None:
            self.text, self.cause = text, cause

        def getCause(self) -> Java | None:
            return self.cause

        def toString(self) -> str:
            return self.text

    class Py4JLike(Exception):
        java_exception = Java(
            "org.apache.spark.SparkException: Job aborted",
            Java("org.postgresql.util.PSQLException: FATAL: password authentication failed"),
        )

    assert _spark_message(Py4JLike("An error occurred while calling o42.jdbc.")) == (
        "org.postgresql.util.PSQLException: FATAL: password authentication failed"
    )
    assert _spark_message(ValueError("first\nsecond")) == "first"


async def test_the_garbage_walk_is_bounded_whatever_the_ids_and_a_long_writer(
    feed_dsn: str,
) -> None:
    """Garbage with sparse ids (what merges leave behind), and in the middle of it,
    in feed order, a writer that kept its transaction open while it wrote 3,000
    entries still young: every transaction of the walk looks at no more than
    batch_size entries along the primary key, their number is what the stretch
    holds over batch_size (not one per id bucket), and only the garbage goes."""
    conn = await asyncpg.connect(feed_dsn)
    try:
        old = datetime.now(UTC) - timedelta(days=2)
        young = datetime.now(UTC)
        await conn.execute(
            """
            INSERT INTO changefeed.feed (id, txid, resource, changed_resource_id, published)
            OVERRIDING SYSTEM VALUE
            SELECT g * 997, (1000 + g)::text::xid8, 'vm', 'r' || g, $1
            FROM generate_series(1, 1000) AS g
            """,
            old,
        )
        await conn.execute(  # the long writer: one txid among the garbage's, late ids
            """
            INSERT INTO changefeed.feed (id, txid, resource, changed_resource_id, published)
            OVERRIDING SYSTEM VALUE
            SELECT 2000000 + g, '1500'::xid8, 'vm', 'w' || g, $1
            FROM generate_series(1, 3000) AS g
            """,
            young,
        )
        store = CompactionStore(conn, "changefeed")
        await store.prepare()
        region = GcRegion(Position(1001, 997), Position(2000, 997_000), 1000)
        steps: list[int] = []
        deleted, transactions = await store.apply_gc(
            [region], datetime.now(UTC) - timedelta(days=1), 100, steps.append
        )
        assert deleted == 1000 and transactions == len(steps) == 40  # 4,000 entries / 100
        assert sum(steps) == 1000
        left = await conn.fetchval("SELECT count(*) FROM changefeed.feed")
        assert left == 3000
        assert await store.low_water() == Position(2000, 997_000)
    finally:
        await conn.close()


async def test_the_announcement_raises_the_generation_and_never_lowers_the_horizon(
    feed_dsn: str,
) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        store = CompactionStore(conn, "changefeed")
        await store.prepare()
        assert await store.announce(Position(10, 5)) == (1, Position(10, 5))
        assert await store.announce(Position(9, 99)) == (2, Position(10, 5))
        assert await store.announce(Position(10, 6)) == (3, Position(10, 6))
        from changefeed.publisher.feed import FeedReader

        state = await FeedReader().state(conn)
        assert (state.rewrites.generation, state.rewrites.through) == (3, Position(10, 6))
        # Whatever streams from this server (the standby other tests start, or none),
        # the wait names exactly those standbys once they have replayed the announcement.
        streaming = await conn.fetch(
            "SELECT coalesce(application_name, client_addr::text, pid::text) AS name"
            " FROM pg_stat_replication"
        )
        assert await store.wait_for_standbys(30.0) == [r["name"] for r in streaming]
    finally:
        await conn.close()


async def test_refused_on_a_feed_schema_older_than_the_job_needs(feed_dsn: str) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        await conn.execute("DELETE FROM changefeed.schema_migrations WHERE version >= 6")
    finally:
        await conn.close()
    with pytest.raises(CompactionError, match=r"version 5; the job needs 6.*db init"):
        await asyncio.to_thread(run_compaction, feed_dsn, max_age=86400, compaction_lag=600)
