"""Checkpointed listeners against the example API (real uvicorn, real PostgreSQL, a real
SQLite file): what a restart does with a checkpoint.

* A shared listener (``vm`` and ``server``, one Controller each, one of them
  typed) stopped cleanly and started again resumes from its checkpoint: no
  bootstrap route is walked, the publisher counts a resumed registration, and
  the callbacks see exactly the changes made while it was away.
* A checkpoint the publisher will not resume (``resumed: false``: the feed was
  trimmed past its cursor, or the cursor is another feed's) bootstraps, and
  the callbacks see exactly the difference from the loaded mirrors: adds,
  updates and deletes, nothing else.
* A checkpoint taken while fetches are slow and out of order is consistent:
  every change its cursor has passed is in its mirror or among its pending
  ids, and a service started from it (the file as a crash would leave it)
  converges by resuming.
* ``async for`` keeps the cursor of what the application was done with; a
  store that fails is logged and counted and loses nothing; a checkpoint that
  cannot be read means a bootstrap; a second listener on the same file is
  refused at start; a file changed under a listener gets a whole save next;
  a store of the application's own
  (docs/examples/postgres_checkpoint_store.py) works the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import random
import sqlite3
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import fresh_database, metric_value, wait_until
from prometheus_client import CollectorRegistry, generate_latest
from test_convergence import SlowTransport
from test_listener_shared import create_servers
from test_listener_support import (
    VmApiServer,
    api_servers,
    api_state,
    burst,
    capture_events,
    create_vms,
)

from changefeed.listener import (
    BackoffPolicy,
    ChangeItem,
    ChangeKind,
    Checkpoint,
    CheckpointRefused,
    CheckpointStatus,
    Controller,
    Listener,
    ListenerConfig,
    Resynced,
    SqliteCheckpointStore,
)
from changefeed.publisher.retention import trim_expired

EXAMPLE_STORE = (
    Path(__file__).resolve().parent.parent / "docs" / "examples" / "postgres_checkpoint_store.py"
)
KINDS = (ChangeKind("vm", ("nic", "alias", "server")), ChangeKind("server"))
CONFIG = ListenerConfig(
    backoff=BackoffPolicy(initial=0.02, maximum=0.2), page_limit=25, checkpoint_interval=0.2
)

Call = tuple[str, Any, Any]


@dataclass(frozen=True)
class Server:
    uuid: str
    hostname: str

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Server:
        return cls(str(doc["uuid"]), str(doc["hostname"]))


class Service:
    """A listener of ``vm`` and ``server`` with a Controller each (servers typed), one
    checkpoint store, and the callbacks each controller made."""

    def __init__(
        self, url: str, store: Any, vm_options: Mapping[str, Any] | None = None, **listener: Any
    ) -> None:
        self.listener = Listener(
            url,
            instance="0b5c5a52-4f6f-4c3b-8d8e-3d3b1b1c9a11",
            service="checkpointed",
            change_kinds=KINDS,
            config=listener.pop("config", CONFIG),
            checkpoint=store,
            rng=random.Random(5),
            **listener,
        )
        self.calls: dict[str, list[Call]] = {"vm": [], "server": []}
        self.vms: Controller[dict[str, Any]] = Controller(
            self.listener, resource="vm", reconcile=self._recorder("vm"), **(vm_options or {})
        )
        self.servers = Controller[Server](
            self.listener,
            resource="server",
            decode=Server.from_json,
            encode=asdict,
            reconcile=self._recorder("server"),
        )

    def _recorder(self, resource: str) -> Any:
        def reconcile(key: str, old: Any, new: Any) -> None:
            self.calls[resource].append((key, old, new))

        return reconcile

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Service]:
        async with self.vms, self.servers:
            yield self

    async def converged(self, dsn: str) -> bool:
        servers = {k: Server.from_json(v) for k, v in (await api_servers(dsn)).items()}
        return (
            dict(self.vms.mirror) == await api_state(dsn) and dict(self.servers.mirror) == servers
        )


def walks(api: VmApiServer) -> int:
    """Bootstrap walks the API served (``/vms`` and ``/servers`` share one admission)."""
    return int(api.app.state.vmapi.vms.stats()["walksStarted"])


async def registrations(client: httpx.AsyncClient, resumed: bool) -> float:
    """Registrations of ``vm`` the publisher counted, resumed or not (0 before the first)."""
    metrics = (await client.get("/metrics")).text
    try:
        return metric_value(
            metrics,
            "changefeed_registrations_total",
            resource="vm",
            resumed=str(resumed).lower(),
        )
    except KeyError:
        return 0.0


async def test_a_restart_resumes_from_the_checkpoint_and_calls_back_what_changed(
    dsn: str, tmp_path: Path
) -> None:
    store = SqliteCheckpointStore(tmp_path / "checkpoint.sqlite")
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        server_ids = await create_servers(client, 4)
        vm_ids = await create_vms(client, 30)
        first = Service(api.ws_url, store)
        async with first.running():
            await first.vms.wait_synced(20)
            await first.servers.wait_synced(20)
        assert first.listener.status().bootstraps == 1 and walks(api) == 2
        saved = first.listener.status().checkpoint
        assert saved is not None and saved.saves >= 1 and not saved.loaded
        before = await api_state(dsn)

        # Away: renames, a migration, a delete and a new VM; a renamed and a new server.
        await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "renamed"})
        await client.patch(f"/vms/{vm_ids[1]}", json={"server_uuid": server_ids[1]})
        await client.delete(f"/vms/{vm_ids[2]}")
        (new_vm,) = await create_vms(client, 1, "new")
        await client.patch(f"/servers/{server_ids[0]}", json={"hostname": "cn-renamed"})
        (new_server,) = await create_servers(client, 1, "new")
        after, servers = await api_state(dsn), await api_servers(dsn)
        resumed_before = await registrations(client, resumed=True)

        registry = CollectorRegistry()
        second = Service(api.ws_url, store, registry=registry)
        async with second.running():
            await second.vms.wait_synced(20)
            await second.servers.wait_synced(20)
            await wait_until(lambda: second.converged(dsn), 15, message="converged")
            assert await second.listener.save_checkpoint()
            exported = generate_latest(registry).decode()
            name = second.listener.name
            assert (
                metric_value(exported, "changefeed_listener_checkpoint_saves_total", listener=name)
                >= 1
            )
            assert (
                metric_value(exported, "changefeed_listener_checkpoint_age_seconds", listener=name)
                < 60
            )
            failing = "changefeed_listener_checkpoint_failing_saves"
            assert metric_value(exported, failing, listener=name) == 0
            status = second.listener.status()
            assert status.resumes == 1 and status.bootstraps == 0 and status.not_resumed == {}
            assert status.checkpoint is not None and status.checkpoint.loaded
            assert status.checkpoint.resumed_from and status.checkpoint.loaded_items == 30 + 4
        assert walks(api) == 2  # no bootstrap route was walked again
        assert await registrations(client, resumed=True) == resumed_before + 1
        assert sorted(second.calls["vm"]) == sorted(
            [
                (vm_ids[0], before[vm_ids[0]], after[vm_ids[0]]),
                (vm_ids[1], before[vm_ids[1]], after[vm_ids[1]]),
                (vm_ids[2], before[vm_ids[2]], None),
                (new_vm, None, after[new_vm]),
            ]
        )
        assert sorted(second.calls["server"], key=lambda c: c[0]) == sorted(
            [
                (
                    server_ids[0],
                    Server(server_ids[0], "cn-0"),
                    Server.from_json(servers[server_ids[0]]),
                ),
                (new_server, None, Server.from_json(servers[new_server])),
            ],
            key=lambda c: c[0],
        )


async def _copy_tables(source: str, target: str) -> None:
    """The example API's rows of ``source`` into ``target`` (same tables; no feed entries)."""
    src, dst = await asyncpg.connect(source), await asyncpg.connect(target)
    try:
        for table, columns in (
            ("servers", "uuid, hostname, status, ram, datacenter"),
            ("vms", "uuid, alias, nics, server_uuid"),
        ):
            rows = [tuple(r) for r in await src.fetch(f"SELECT {columns} FROM vmapi.{table}")]
            await dst.copy_records_to_table(
                table, schema_name="vmapi", records=rows, columns=columns.split(", ")
            )
    finally:
        await src.close()
        await dst.close()


@pytest.mark.parametrize("reason", ["cursor_expired", "other_feed"])
async def test_resumed_false_bootstraps_and_calls_back_only_the_difference(
    reason: str, dsn: str, tmp_path: Path, pg_server: Any
) -> None:
    store = SqliteCheckpointStore(tmp_path / "checkpoint.sqlite")
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(VmApiServer(dsn))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url))
        server_ids = await create_servers(client, 3)
        vm_ids = await create_vms(client, 20)
        first = Service(api.ws_url, store)
        async with first.running():
            await first.vms.wait_synced(20)
            await first.servers.wait_synced(20)
        loaded_vms, loaded_servers = await api_state(dsn), await api_servers(dsn)

        data = dsn
        if reason == "other_feed":
            # Another API, on another database (another feed) with a copy of the rows.
            data = await stack.enter_async_context(fresh_database(pg_server))
            api = await stack.enter_async_context(VmApiServer(data))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url))
            await _copy_tables(dsn, data)
        # What differs from the checkpoint, written as SQL (no entry needed: it bootstraps).
        conn = await asyncpg.connect(data)
        try:
            await conn.execute(
                "UPDATE vmapi.vms SET alias = 'changed-' || alias WHERE uuid = ANY($1::uuid[])",
                vm_ids[:3],
            )
            await conn.execute("DELETE FROM vmapi.vms WHERE uuid = ANY($1::uuid[])", vm_ids[3:5])
            await conn.execute(
                "UPDATE vmapi.servers SET hostname = 'cn-moved' WHERE uuid = $1::uuid",
                server_ids[0],
            )
            await conn.execute("DELETE FROM vmapi.servers WHERE uuid = $1::uuid", server_ids[2])
        finally:
            await conn.close()
        added = await create_vms(client, 2, "added")
        if reason == "cursor_expired":
            conn = await asyncpg.connect(dsn)
            try:
                await trim_expired(conn, "changefeed", timedelta(0))
            finally:
                await conn.close()
        vms, servers = await api_state(data), await api_servers(data)
        walked = walks(api)

        second = Service(api.ws_url, store)
        async with second.running():
            await second.vms.wait_synced(20)
            await second.servers.wait_synced(20)
            status = second.listener.status()
            assert status.not_resumed == {reason: 1} and status.resumes == 0
            assert status.bootstraps == 1 and walks(api) == walked + 2
            assert status.checkpoint is not None and status.checkpoint.resumed_from
            assert await second.converged(data)

    def diff(old: Mapping[str, Any], new: Mapping[str, Any], wrap: Any) -> list[Call]:
        keys = sorted(set(old) | set(new))
        return [
            (k, old.get(k) and wrap(old[k]), new.get(k) and wrap(new[k]))
            for k in keys
            if old.get(k) != new.get(k)
        ]

    expected_vms = diff(loaded_vms, vms, dict)
    assert len(expected_vms) == 3 + 2 + len(added)  # updates, deletes, adds
    assert sorted(second.calls["vm"]) == expected_vms
    expected_servers = diff(loaded_servers, servers, Server.from_json)
    assert [c[0] for c in expected_servers] == sorted([server_ids[0], server_ids[2]])
    assert sorted(second.calls["server"], key=lambda c: c[0]) == expected_servers


async def test_a_checkpoint_taken_during_slow_out_of_order_fetches_is_consistent(
    dsn: str, tmp_path: Path
) -> None:
    slow = asyncio.Event()
    store = SqliteCheckpointStore(tmp_path / "checkpoint.sqlite")
    async with (
        VmApiServer(dsn) as api,
        httpx.AsyncClient(base_url=api.url) as client,
        httpx.AsyncClient(transport=SlowTransport(slow, delay=0.5), timeout=10) as slow_http,
    ):
        await create_servers(client, 2)
        vm_ids = await create_vms(client, 60)
        config = ListenerConfig(
            backoff=CONFIG.backoff,
            page_limit=25,
            checkpoint_interval=3600,  # saved by hand
        )
        # Four workers, one id per fetch: fetches overlap and end out of order.
        options = {"concurrency": 4, "fetch_batch": 1}
        service = Service(api.ws_url, store, options, config=config, http=slow_http)
        async with service.running():
            await service.vms.wait_synced(20)
            slow.set()
            changes = await burst(dsn, vm_ids, 2)
            await wait_until(
                lambda: service.vms.stats().items >= changes, 20, message="items handed over"
            )
            assert not service.vms.queue.idle  # fetches under way, others waiting
            assert await service.listener.save_checkpoint()
            taken = await store.load()
            # The disk as a kill at this moment leaves it.
            crash = SqliteCheckpointStore(tmp_path / "crash.sqlite")
            assert taken is not None
            await crash.save(taken)
            slow.clear()
        final = await api_state(dsn)
        part = taken.mirrors[service.vms.name]
        pending, saved = set(part.pending), dict(part.items)
        # Every VM was renamed after the checkpoint's cursor started: each one is either
        # saved as it is now, or pending (fetched again after a load). None is skipped.
        for vm in vm_ids:
            assert saved.get(vm) == final[vm] or vm in pending, vm
        assert pending  # the test did catch fetches under way

        restarted = Service(api.ws_url, crash, config=config)
        walked = walks(api)
        async with restarted.running():
            await restarted.vms.wait_synced(20)
            await wait_until(lambda: restarted.converged(dsn), 15, message="converged")
            status = restarted.listener.status()
            assert status.resumes == 1 and status.bootstraps == 0
        assert walks(api) == walked
        # Each pending id was called back (with what the checkpoint saved as old).
        called = {key for key, _, _ in restarted.calls["vm"]}
        assert pending <= called


async def test_async_for_resumes_after_the_last_event_the_application_was_done_with(
    dsn: str, tmp_path: Path
) -> None:
    store = SqliteCheckpointStore(tmp_path / "checkpoint.sqlite")
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 3)

        def listener() -> Listener:
            return Listener(
                api.ws_url,
                instance="9c1d1e52-4f6f-4c3b-8d8e-3d3b1b1c9a11",
                service="raw",
                change_kind=ChangeKind("vm"),
                config=CONFIG,
                checkpoint=store,
            )

        seen: list[str] = []
        first = listener()
        async with first:
            async for event in first:
                if isinstance(event, Resynced):
                    await burst(dsn, vm_ids, 3)  # nine items, in a known order
                    continue
                seen.append(event.changed_resource_id)
                if len(seen) == 5:
                    break  # the fifth was handed out, and never finished with
        assert first.status().checkpoint is not None
        second = listener()
        again: list[ChangeItem] = []
        async with second:
            async for event in second:
                assert isinstance(event, ChangeItem)  # resumed: no Resynced
                again.append(event)
                if len(again) == 5:
                    break
        order = [vm for _ in range(3) for vm in vm_ids]
        assert seen == order[:5]
        assert [item.changed_resource_id for item in again] == order[4:9]
        assert second.status().resumes == 1 and second.status().bootstraps == 0


def checkpoint_status(service: Service) -> CheckpointStatus:
    status = service.listener.status().checkpoint
    assert status is not None
    return status


class FlakyStore:
    """A real SQLite store whose saves fail while ``failing`` is set, and whose load fails
    once when ``broken`` is set: the disk full, the file unreadable."""

    def __init__(self, store: SqliteCheckpointStore) -> None:
        self.store = store
        self.failing = False
        self.broken = False

    async def load(self) -> Checkpoint | None:
        if self.broken:
            self.broken = False
            raise OSError("no such device")
        return await self.store.load()

    async def save(self, checkpoint: Checkpoint) -> None:
        if self.failing:
            raise OSError("no space left on device")
        await self.store.save(checkpoint)


async def test_failed_saves_lose_nothing_and_an_unreadable_checkpoint_bootstraps(
    dsn: str, tmp_path: Path
) -> None:
    flaky = FlakyStore(SqliteCheckpointStore(tmp_path / "checkpoint.sqlite"))
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 10)
        service = Service(api.ws_url, flaky)
        with capture_events() as events:
            async with service.running():
                await service.vms.wait_synced(20)
                await wait_until(lambda: checkpoint_status(service).saves >= 1, 10)
                flaky.failing = True
                await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "while-failing"})
                await client.delete(f"/vms/{vm_ids[1]}")
                await wait_until(lambda: checkpoint_status(service).save_failures >= 2, 10)
                # The status an embedding service reads says so while it lasts.
                failing = checkpoint_status(service)
                assert failing.failing and failing.consecutive_failures >= 2
                await wait_until(lambda: service.converged(dsn), 10, message="converged")
                flaky.failing = False
                saves = checkpoint_status(service).saves
                await wait_until(lambda: checkpoint_status(service).saves > saves, 10)
                assert not checkpoint_status(service).failing
        failed = events.named("listener.checkpoint.save_failed")
        assert failed and "no space left" in str(checkpoint_status(service).last_error)
        # The saves after the failures carried what the failed ones did not.
        saved = await flaky.store.load()
        assert saved is not None
        assert dict(saved.mirrors[service.vms.name].items) == await api_state(dsn)

        flaky.broken = True
        again = Service(api.ws_url, flaky)
        with capture_events() as events:
            async with again.running():
                await again.vms.wait_synced(20)
        assert events.named("listener.checkpoint.load_failed")
        status = again.listener.status()
        assert status.bootstraps == 1 and status.checkpoint is not None
        assert not status.checkpoint.loaded and "no such device" in str(
            status.checkpoint.last_error
        )
        # Bootstrapped from nothing: every VM is an add.
        assert len(again.calls["vm"]) == len(await api_state(dsn))


class StuckSaveStore:
    """A store whose saves hang once ``stuck`` is set (its database stopped answering)."""

    def __init__(self) -> None:
        self.stuck = False
        self.saved: list[Checkpoint] = []

    async def load(self) -> Checkpoint | None:
        return None

    async def save(self, checkpoint: Checkpoint) -> None:
        if self.stuck:
            await asyncio.Event().wait()
        self.saved.append(checkpoint)


async def test_a_final_save_given_up_on_at_close_says_the_checkpoint_is_failing(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save still hanging when the listener closes is abandoned after the close's wait:
    the store does not hold where the listener got to, and the status says so (what
    ``changefeed listen`` turns into a non-zero exit)."""
    from changefeed.listener import _checkpointer

    monkeypatch.setattr(_checkpointer, "CLOSE_WAIT", 0.3)
    store = StuckSaveStore()
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 3)
        service = Service(api.ws_url, store)
        with capture_events() as events:
            async with service.running():
                await service.vms.wait_synced(15)
                await wait_until(lambda: checkpoint_status(service).saves >= 1, 10)
                assert not checkpoint_status(service).failing
                store.stuck = True
    assert events.named("listener.checkpoint.abandoned")
    status = checkpoint_status(service)
    assert status.failing and "abandoned" in str(status.last_error), status


class HangingStore:
    """An application's store whose ``load`` never returns (its database hangs); its saves
    are kept in memory."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.saved: list[Checkpoint] = []

    def __repr__(self) -> str:
        return "HangingStore(app-db)"

    async def load(self) -> Checkpoint | None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")

    async def save(self, checkpoint: Checkpoint) -> None:
        self.saved.append(checkpoint)


async def test_a_store_whose_load_hangs_is_given_up_on_and_the_listener_bootstraps(
    dsn: str,
) -> None:
    store = HangingStore()
    config = dataclasses.replace(CONFIG, checkpoint_load_timeout=0.3)
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 3)
        service = Service(api.ws_url, store, config=config)
        with capture_events() as events:
            async with service.running():
                await service.vms.wait_synced(15)
                await asyncio.wait_for(store.cancelled.wait(), 5)
                assert await service.listener.save_checkpoint()
    assert len(events.named("listener.checkpoint.load_failed")) == 1
    status = service.listener.status()
    assert status.bootstraps == 1 and status.checkpoint is not None
    assert not status.checkpoint.loaded
    error = str(status.checkpoint.last_error)
    assert error.startswith("load: CheckpointError: HangingStore(app-db): "), error
    assert "within 0.3s" in error and "checkpoint_load_timeout" in error
    assert store.saved and store.saved[0].whole  # nothing loaded: the first save is whole
    assert len(service.calls["vm"]) == 3


def _example_store_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("postgres_checkpoint_store", EXAMPLE_STORE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_a_store_of_the_applications_own_postgresql_resumes_too(
    dsn: str, pg_server: Any
) -> None:
    """docs/examples/postgres_checkpoint_store.py: the same restart, with the checkpoint
    in the application's database: whole, then incremental saves, then a resume. A
    second store of the same name is refused while a listener holds it."""
    example = _example_store_module()
    async with (
        fresh_database(pg_server, prefix="app") as app_dsn,
        asyncpg.create_pool(app_dsn, min_size=1, max_size=2) as pool,
        VmApiServer(dsn) as api,
        httpx.AsyncClient(base_url=api.url) as client,
    ):
        store = example.PostgresCheckpointStore(pool, name="tcns-1")
        await store.setup()
        vm_ids = await create_vms(client, 12)
        await create_servers(client, 2)
        first = Service(api.ws_url, store)
        async with first.running():
            await first.vms.wait_synced(20)
            await first.servers.wait_synced(20)
            await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "live"})
            await wait_until(lambda: first.converged(dsn), 10, message="first converged")
            assert await first.listener.save_checkpoint()  # an incremental one
            with pytest.raises(CheckpointRefused, match="in use by another listener"):
                await example.PostgresCheckpointStore(pool, name="tcns-1").load()
        status = checkpoint_status(first)
        assert status.saves >= 2 and status.whole_saves == 1
        before = await api_state(dsn)
        await client.patch(f"/vms/{vm_ids[1]}", json={"alias": "away"})
        await client.delete(f"/vms/{vm_ids[2]}")
        second = Service(api.ws_url, store)
        async with second.running():
            await second.vms.wait_synced(20)
            await wait_until(lambda: second.converged(dsn), 15, message="converged")
            assert second.listener.status().resumes == 1
            assert second.listener.status().bootstraps == 0
        after = await api_state(dsn)
        assert sorted(second.calls["vm"]) == sorted(
            [(vm_ids[1], before[vm_ids[1]], after[vm_ids[1]]), (vm_ids[2], before[vm_ids[2]], None)]
        )
        assert second.calls["server"] == []
        saved = await store.load()
        await store.close()
        assert saved is not None and dict(saved.mirrors[second.vms.name].items) == after


@pytest.mark.parametrize("given", ["another store", "the same store", "a link to the file"])
async def test_a_second_listener_on_the_checkpoint_is_refused_at_start(
    dsn: str, tmp_path: Path, given: str
) -> None:
    """Two listeners on one file and name, each whole save overwriting the other's:
    the second is refused when it loads (``CheckpointRefused``: its controllers stop
    with it), and writes nothing, whether it was given a store of its own, the
    first's store object, or a store on a symbolic link to the file."""
    path = tmp_path / "checkpoint.sqlite"
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 5)
        store = SqliteCheckpointStore(path)
        first = Service(api.ws_url, store)
        async with first.running():
            await first.vms.wait_synced(20)
            assert await first.listener.save_checkpoint()
            if given == "a link to the file":
                (tmp_path / "link.sqlite").symlink_to(path)
            theirs = {
                "another store": lambda: SqliteCheckpointStore(path),
                "the same store": lambda: store,
                "a link to the file": lambda: SqliteCheckpointStore(tmp_path / "link.sqlite"),
            }[given]()
            second = Service(api.ws_url, theirs)
            with capture_events() as events, pytest.raises(CheckpointRefused) as refused:
                async with asyncio.timeout(20), second.running():
                    await asyncio.Event().wait()  # ended by the refusal
            assert "in use by" in str(refused.value)
            assert events.named("listener.checkpoint.refused")
            assert second.listener.status().registrations == 0  # it never registered
            status = checkpoint_status(second)
            assert status.saves == 0 and "CheckpointRefused" in str(status.last_error)
            assert await first.listener.save_checkpoint()  # the first goes on
        saved = await SqliteCheckpointStore(path).load()
        assert saved is not None and saved.cursor == first.listener.cursor


async def test_a_file_changed_under_a_listener_gets_a_whole_save_next(
    dsn: str, tmp_path: Path
) -> None:
    """The file no longer holds the save the listener's next one goes on top of (a
    writer that ignored the lock, an operator's edit): the incremental save is refused
    (``CheckpointError``, logged), and the next save is whole and succeeds."""
    path = tmp_path / "checkpoint.sqlite"
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 5)
        service = Service(api.ws_url, SqliteCheckpointStore(path))
        async with service.running():
            await service.vms.wait_synced(20)
            await service.servers.wait_synced(20)
            assert await service.listener.save_checkpoint()
            _rewrite_sequence(path, 1000)
            await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "after"})
            await wait_until(lambda: service.converged(dsn), 10, message="converged")
            assert not await service.listener.save_checkpoint()
            assert "another listener" in str(checkpoint_status(service).last_error)
            assert checkpoint_status(service).failing
            whole = checkpoint_status(service).whole_saves
            assert await service.listener.save_checkpoint()
            assert checkpoint_status(service).whole_saves == whole + 1
            assert not checkpoint_status(service).failing
        saved = await SqliteCheckpointStore(path).load()
        assert saved is not None and saved.sequence != 1000
        assert dict(saved.mirrors[service.vms.name].items) == await api_state(dsn)


def _rewrite_sequence(path: Path, sequence: int) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE changefeed_checkpoint SET sequence = ?", (sequence,))
