"""A controller's life beside its listener, against the example API (real uvicorn, real
PostgreSQL, a real SQLite checkpoint file): how its end reaches the application.

* A controller that stops for good (its registration refused) ends the block it
  runs beside: ``async with controller: await stop.wait()`` raises
  ``RegistrationRefused`` instead of waiting for good; ``close()`` raises it, and
  ``done()`` / ``exception()`` say so.
* A controller attached to a listener and never run is an error the controllers
  that do run, or the block of a listener started without it (``async with
  listener``), see within ``controller_start_timeout``, not a listener that never
  starts; with nothing running, an ERROR line within the same time.
* One controller stopping does not stop the checkpoints of the others sharing its
  listener, and a restart from such a checkpoint resumes every one of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import wait_until
from test_listener_shared import FAST, create_servers, publisher_stats, shared_listener
from test_listener_support import VmApiServer, capture_events, create_vms

from changefeed.listener import (
    ConnectionState,
    Controller,
    ListenerConfigError,
    RegistrationRefused,
    SqliteCheckpointStore,
)


def _refused_controller(api: VmApiServer) -> Controller[Any]:
    """A controller whose listener's token the publisher refuses (HTTP 401: for good)."""
    listener = shared_listener(api.ws_url, token="revoked")
    return Controller(listener, resource="vm", name="vms")


async def test_a_controller_that_stops_for_good_ends_its_block_and_its_exit_raises(
    dsn: str,
) -> None:
    """``async with vms: await stop.wait()`` does not wait for good once the token is
    refused: the controller's end ends the block, and its exit raises why."""
    async with VmApiServer(dsn, auth_tokens=("s3cret",)) as api:
        vms = _refused_controller(api)
        stop = asyncio.Event()
        with pytest.raises(RegistrationRefused) as refused:
            async with asyncio.timeout(20):
                async with vms:
                    await stop.wait()  # never set: only the controller's end can end it
        assert refused.value.code == "http_401"
        assert vms.done() and vms.exception() is refused.value
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_close_raises_what_stopped_the_controller_and_a_block_of_its_own_wins(
    dsn: str,
) -> None:
    async with VmApiServer(dsn, auth_tokens=("s3cret",)) as api:
        # Entered from a task that has ended (as a framework's start-up hook may):
        # nothing to cancel, so close() is where the error shows.
        vms = _refused_controller(api)

        async def enter() -> None:
            await vms.__aenter__()

        await asyncio.create_task(enter())
        assert not vms.done() and vms.exception() is None
        await wait_until(vms.done, 20, message="the controller stopped")
        assert isinstance(vms.exception(), RegistrationRefused)
        for _ in range(2):  # each time: it stopped for good
            with pytest.raises(RegistrationRefused) as closed:
                await vms.close()
            assert closed.value is vms.exception()

        # A block that raises an error of its own as it is cancelled keeps it, and
        # exception() has the controller's.
        other = _refused_controller(api)
        with pytest.raises(KeyError):
            async with other:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    raise KeyError("the application's own") from None
        assert isinstance(other.exception(), RegistrationRefused)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

        # A controller closed by the application stopped cleanly: nothing to raise.
        async with VmApiServer(dsn) as open_api:
            listener = shared_listener(open_api.ws_url)
            fine = Controller(listener, resource="vm")
            servers = Controller(listener, resource="server")
            async with fine, servers:
                await fine.wait_synced(20)
            assert fine.done() and fine.exception() is None


async def test_close_stops_a_controller_run_in_a_task_of_the_applications(dsn: str) -> None:
    """``close()`` stops a ``run()`` in the application's own task, not only the task of
    ``async with``: that ``run()`` returns and ``done()`` turns True, rather than the run
    going on with ``done()`` False; the other controller's run goes on."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 3)
        listener = shared_listener(api.ws_url)
        vms = Controller(listener, resource="vm")
        servers = Controller(listener, resource="server")
        runs = [asyncio.create_task(c.run()) for c in (vms, servers)]
        await vms.wait_synced(20)
        assert len(vms.mirror) == 3
        async with asyncio.timeout(10):
            await vms.close()  # returns once run() has
            assert vms.done() and vms.exception() is None
            # A clean stop: run() returns. (It is typed to return None, hence the
            # ignore: the test checks that it does.)
            assert await runs[0] is None  # type: ignore[func-returns-value]
        assert not runs[1].done()  # the other goes on
        async with asyncio.timeout(10):
            await servers.close()
            await runs[1]
        assert servers.done() and servers.exception() is None


async def test_a_controller_attached_and_never_run_is_an_error_within_the_timeout(
    dsn: str,
) -> None:
    """Past ``controller_start_timeout``, the listener stops with ``ListenerConfigError``
    (logged, naming the idle controller), rather than never starting with an INFO line
    only; the forgotten controller, run late, raises the same error."""
    async with VmApiServer(dsn) as api:
        config = dataclasses.replace(FAST, controller_start_timeout=0.5)
        listener = shared_listener(api.ws_url, config=config)
        vms = Controller(listener, resource="vm")
        forgotten = Controller(listener, resource="server", name="forgotten")
        with capture_events() as events, pytest.raises(ListenerConfigError) as stopped:
            await asyncio.wait_for(vms.run(), 10)
        assert "forgotten attached to listener tcns:vm+server did not run within 0.5s" in str(
            stopped.value
        )
        (logged,) = events.named("listener.controllers_not_running")
        assert logged["idle"] == ["forgotten"] and logged["running"] == [vms.name]
        assert listener.state is ConnectionState.STOPPED
        # Run late, the forgotten one stops at once, the same way.
        with pytest.raises(ListenerConfigError) as late:
            await asyncio.wait_for(forgotten.run(), 5)
        assert late.value is stopped.value


async def test_a_listener_started_ahead_of_a_controller_it_feeds_stops_within_the_timeout(
    dsn: str,
) -> None:
    """Started directly (``async with listener``) while an attached controller has
    not run: the listener takes events the controller misses, so past the timeout
    it stops with the error, which ends the block (nothing else there would say so:
    the listener is not iterable with controllers attached), and the controller
    run late raises it."""
    async with VmApiServer(dsn) as api:
        config = dataclasses.replace(FAST, controller_start_timeout=0.5)
        listener = shared_listener(api.ws_url, config=config)
        forgotten = Controller(listener, resource="vm", name="forgotten")
        with capture_events() as events:
            with pytest.raises(ListenerConfigError) as ended:
                async with asyncio.timeout(10), listener:
                    await asyncio.Event().wait()  # the application's own "until stopped"
            assert "forgotten attached to listener" in str(ended.value)
            assert listener.state is ConnectionState.STOPPED
            # Stopped means its connection is gone too (it kept buffering for nobody,
            # and a publisher restart then replaced the error with another).
            await wait_until(
                lambda: _listeners_connected(api, 0), 10, message="the connection closed"
            )
            await api.restart()
        (logged,) = events.named("listener.controllers_not_running")
        assert logged["idle"] == ["forgotten"] and logged["listener_started"] is True
        with pytest.raises(ListenerConfigError) as late:
            await asyncio.wait_for(forgotten.run(), 5)
        assert "forgotten attached to listener tcns:vm+server did not run within 0.5s of " in (
            str(late.value)
        )


async def _listeners_connected(api: VmApiServer, count: int) -> bool:
    return bool((await publisher_stats(api))["listeners"] == count)


async def test_a_refusal_reaches_a_controller_whose_queue_stays_full(dsn: str) -> None:
    """A controller whose fetches hang (its application's database is down) keeps its
    queue full, and the listener's hand-out waits for room: the token revoked meanwhile
    must still end ``run()`` with the refusal, not leave it waiting for good."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 2)
        listener = shared_listener(api.ws_url)
        hang = asyncio.Event()

        async def fetch(ids: Any) -> dict[str, Any]:
            await hang.wait()
            return {}

        vms = Controller(listener, resource="vm", fetch=fetch, max_pending=1, concurrency=1)
        servers = Controller(listener, resource="server")
        running = [asyncio.create_task(c.run()) for c in (vms, servers)]
        try:
            await wait_until(lambda: listener.state is ConnectionState.LIVE, 20)
            await create_vms(client, 5)  # more than the queue takes: the hand-out waits
            await wait_until(
                lambda: vms.queue.pending >= 1 and listener.status().buffer_size > 0, 20
            )
            api.overrides["auth_tokens"] = ("s3cret",)  # the listener has no token for it
            await api.restart()
            with pytest.raises(RegistrationRefused):
                await asyncio.wait_for(asyncio.shield(running[0]), 20)
            assert vms.done() and isinstance(vms.exception(), RegistrationRefused)
        finally:
            hang.set()
            await asyncio.gather(*running, return_exceptions=True)


async def test_a_lone_controller_never_run_is_reported_within_the_timeout() -> None:
    """Nothing runs, so nothing is missed yet: an ERROR line names the controller, and
    run late it still works (no server needed to see either)."""
    config = dataclasses.replace(FAST, controller_start_timeout=0.2)
    listener = shared_listener("ws://127.0.0.1:9/changefeeds", config=config)
    with capture_events() as events:
        Controller(listener, resource="vm", name="forgotten")
        await wait_until(
            lambda: events.named("listener.controllers_not_running"), 5, message="reported"
        )
    (logged,) = events.named("listener.controllers_not_running")
    assert logged["idle"] == ["forgotten"] and logged["running"] == []
    assert logged["listener_started"] is False
    assert listener.state is ConnectionState.IDLE


async def test_a_controller_whose_fetch_is_refused_for_good_stops_with_the_refusal(
    dsn: str,
) -> None:
    """The listener's token is revoked while it runs (its websocket stays open): the
    next fetch is answered 401, which retrying cannot heal. The controller stops
    with ``RegistrationRefused`` (``http_401``) instead of retrying for good; the
    other controller on the listener goes on."""
    allowed = {"writer": frozenset({"*"}), "reader": frozenset({"*"})}

    async def authorize(token: str) -> frozenset[str] | None:
        return allowed.get(token)

    async with (
        VmApiServer(dsn, authorize=authorize) as api,
        httpx.AsyncClient(base_url=api.url, headers={"Authorization": "Bearer writer"}) as client,
    ):
        vm_ids = await create_vms(client, 2)
        listener = shared_listener(api.ws_url, token="reader")
        vms = Controller(listener, resource="vm")
        servers = Controller(listener, resource="server")
        with capture_events() as events, pytest.raises(RegistrationRefused) as refused:
            async with vms, servers:
                await vms.wait_synced(20)
                del allowed["reader"]
                await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "after"})
                async with asyncio.timeout(20):
                    await asyncio.Event().wait()  # ended by the refusal
        assert refused.value.code == "http_401"
        assert vms.done() and vms.exception() is refused.value
        assert servers.done() and servers.exception() is None
        (logged,) = events.named("controller.fetch_refused")
        assert "HTTP 401" in logged["error"]


async def test_one_controller_stopping_does_not_stop_the_checkpoints_of_the_others(
    dsn: str, tmp_path: Path
) -> None:
    """``servers`` stops while ``vms`` goes on: checkpoints go on too (rather than stopping
    for good with the first controller), still consistent for ``servers``, whose
    changes since it stopped are pending; a restart resumes both and calls ``servers``
    back for what changed while it was stopped."""
    store = SqliteCheckpointStore(tmp_path / "checkpoint.sqlite")
    config = dataclasses.replace(FAST, checkpoint_interval=0.2)
    calls: list[tuple[str, Any, Any]] = []

    def service() -> tuple[Any, Controller[Any], Controller[Any]]:
        listener = shared_listener(api.ws_url, config=config, checkpoint=store)

        def reconcile(key: str, old: Any, new: Any) -> None:
            calls.append((key, old and old["hostname"], new and new["hostname"]))

        vms = Controller(listener, resource="vm")
        servers = Controller(listener, resource="server", reconcile=reconcile)
        return listener, vms, servers

    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        server_ids = await create_servers(client, 2)
        vm_ids = await create_vms(client, 3)
        listener, vms, servers = service()
        async with vms:
            async with servers:
                await vms.wait_synced(20)
                await servers.wait_synced(20)
            await client.patch(f"/servers/{server_ids[0]}", json={"hostname": "renamed"})
            await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "later"})
            await wait_until(lambda: vms.mirror[vm_ids[0]]["alias"] == "later", 10, message="vm")
            assert await listener.save_checkpoint()
            status = listener.status().checkpoint
            assert status is not None and not status.frozen
            cursor = listener.cursor
        saved = await store.load()
        assert saved is not None and saved.cursor == cursor
        assert saved.mirrors[vms.name].items[vm_ids[0]]["alias"] == "later"
        parked = saved.mirrors[servers.name]
        assert server_ids[0] in parked.pending and parked.items[server_ids[0]]["hostname"] == "cn-0"

        calls.clear()
        listener, vms, servers = service()
        async with vms, servers:
            await servers.wait_synced(20)
            await wait_until(lambda: bool(calls), 10, message="the rename called back")
            again = listener.status()
            assert again.resumes == 1 and again.bootstraps == 0
        assert calls == [(server_ids[0], "cn-0", "renamed")]


async def test_a_controller_closed_without_running_no_longer_holds_up_the_others(
    dsn: str,
) -> None:
    """``close()`` a controller that will not run: the listener starts for the others,
    and no error comes from the wait for it."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_servers(client, 2)
        config = dataclasses.replace(FAST, controller_start_timeout=0.5)
        listener = shared_listener(api.ws_url, config=config)
        unused = Controller(listener, resource="vm", name="unused")
        servers = Controller(listener, resource="server")
        await unused.close()
        async with servers:
            await servers.wait_synced(20)
            await asyncio.sleep(1)  # past controller_start_timeout: nothing stops it
            assert not servers.done() and listener.state is ConnectionState.LIVE
