"""The example DNS controller: derives DNS records from the example API's feed, as Triton CNS does.

It follows two resources on one connection, ``vm`` (sub-resources ``nic``,
``alias`` and ``server``) and ``server`` (``hostname``), with one ``Listener``
and a ``Controller`` for each, and keeps, in storage it owns, one record per
name. A VM with IPs answers to two names:

    ``<alias>.<zone>``     its alias, when the alias is a DNS label
    ``<hostname>.<zone>``  the host name of the server it runs on

and each name resolves to the IPs of the nics of every VM that answers to
it: the VMs sharing an alias, and the VMs a server hosts (a server whose VMs
have no IPs has no record). The records live in the PostgreSQL table
``cns.records(name text primary key, ips text[] not null, vm uuid not null)``
(created idempotently; ``vm`` is the smallest uuid among the VMs behind the
name), plus the same records in memory for printing. ``derive_records`` is
the pure definition: after writes stop, the table equals
``derive_records(<every VM>, zone, <every server>)`` of what the API holds.

An alias becomes a name only when it is a valid DNS label once lowercased
(``[a-z0-9]``, inner ``-``, at most 63 characters); a host name only when
each of its dot-separated labels is one and the name fits in 253 characters.

The two controllers deliver in their own order: a VM may arrive before the
server it runs on, a migration before the server's rename. Each callback
records what it learned (a VM's alias, IPs and server; a server's host name)
and rewrites the names of every VM that changed with it, so the records
follow whichever arrives last.

It must never write the example API's tables, never leave the table and the
in-memory view disagreeing after a failed write (memory changes only after
the transaction commits), and never answer a failure by dropping records:
a failed write is retried by the controller with back-off.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import asyncpg
import httpx
from prometheus_client import CollectorRegistry

from changefeed.listener import BackoffPolicy, Controller, Listener, ListenerConfig
from changefeed.logs import log_event
from changefeed.schemas import ChangeKind

__all__ = [
    "SCHEMA_SQL",
    "SERVER_KIND",
    "VM_KIND",
    "DnsController",
    "Record",
    "derive_records",
    "dns_label",
    "ensure_schema",
    "host_name",
    "render_records",
    "vm_names",
]

log = logging.getLogger(__name__)

SCHEMA_SQL = """
CREATE SCHEMA IF NOT EXISTS cns;
CREATE TABLE IF NOT EXISTS cns.records (
    name text PRIMARY KEY,
    ips  text[] NOT NULL,
    vm   uuid NOT NULL
);
"""
"""The DNS service's own table."""

_SCHEMA_LOCK = 0x636E_735F_7265  # "cns_re": concurrent start-ups create the table once
_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
VM_KIND = ChangeKind("vm", ("nic", "alias", "server"))
"""What the DNS service follows of a VM: its addresses, its name, and where it runs."""
SERVER_KIND = ChangeKind("server", ("hostname",))
"""What it follows of a server: its host name (not its status or RAM)."""

_UPSERT = (
    "INSERT INTO cns.records (name, ips, vm) VALUES ($1, $2, $3) "
    "ON CONFLICT (name) DO UPDATE SET ips = EXCLUDED.ips, vm = EXCLUDED.vm"
)


@dataclass(frozen=True, slots=True)
class Record:
    """One DNS name and the addresses it resolves to."""

    name: str
    ips: tuple[str, ...]
    vm: str


def dns_label(alias: Any) -> str | None:
    """The DNS label of a VM alias, or None when the alias cannot be one."""
    if not isinstance(alias, str):
        return None
    label = alias.lower()
    return label if _LABEL.match(label) else None


def _ip_key(ip: str) -> tuple[int, int, str]:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return (9, 0, ip)
    return (address.version, int(address), ip)


def host_name(hostname: Any, zone: str) -> str | None:
    """``<hostname>.<zone>`` for a server's host name, or None when it cannot be a name."""
    if not isinstance(hostname, str):
        return None
    labels = hostname.lower().split(".")
    if not all(_LABEL.match(label) for label in labels):
        return None
    name = f"{'.'.join(labels)}.{zone}"
    return name if len(name) <= 253 else None


def _vm_ips(vm: Mapping[str, Any]) -> tuple[str, ...]:
    nics = vm.get("nics")
    if not isinstance(nics, list):
        return ()
    ips = {str(n["ip"]) for n in nics if isinstance(n, dict) and isinstance(n.get("ip"), str)}
    return tuple(sorted(ips, key=_ip_key))


def vm_names(
    vm: Mapping[str, Any], zone: str, hostnames: Mapping[str, str | None]
) -> dict[str, tuple[str, ...]]:
    """The names a VM answers to, each with the VM's IPs (none without IPs).

    Args:
        vm: the VM as the API serves it.
        zone: the zone names are made in.
        hostnames: server uuid -> its name (``host_name``), for the servers known.
    """
    ips = _vm_ips(vm)
    if not ips:
        return {}
    names: dict[str, tuple[str, ...]] = {}
    label = dns_label(vm.get("alias"))
    if label is not None:
        names[f"{label}.{zone}"] = ips
    server = vm.get("server_uuid")
    host = hostnames.get(str(server)) if server is not None else None
    if host is not None:
        names[host] = ips
    return names


def _record(name: str, members: Mapping[str, tuple[str, ...]]) -> Record | None:
    if not members:
        return None
    ips = sorted({ip for vm_ips in members.values() for ip in vm_ips}, key=_ip_key)
    return Record(name, tuple(ips), min(members))


def derive_records(
    vms: Iterable[Mapping[str, Any]], zone: str, servers: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Record]:
    """The records a set of VMs and servers yields: the definition the controller maintains."""
    hostnames = {str(s["uuid"]): host_name(s.get("hostname"), zone) for s in servers}
    by_name: dict[str, dict[str, tuple[str, ...]]] = {}
    for vm in vms:
        for name, ips in vm_names(vm, zone, hostnames).items():
            by_name.setdefault(name, {})[str(vm["uuid"])] = ips
    records = {name: _record(name, members) for name, members in by_name.items()}
    return {name: record for name, record in records.items() if record is not None}


def render_records(records: Mapping[str, Record]) -> str:
    """The records as an aligned text table, sorted by name."""
    if not records:
        return "(no records)"
    width = max(len(name) for name in records)
    return "\n".join(
        f"{name:<{width}}  {', '.join(rec.ips)}" for name, rec in sorted(records.items())
    )


async def ensure_schema(conn: Any) -> None:
    """Create ``cns.records`` if it does not exist (safe when several start at once)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
        await conn.execute(SCHEMA_SQL)


class DnsController:
    """Keeps ``cns.records`` (and an in-memory copy) derived from the example API's feed.

    One Listener for ``vm`` and ``server`` (one websocket), one Controller each:
    ``vms`` and ``servers``.

    Args:
        publisher_url: the API's websocket, ``ws://host:port/changefeeds``.
        dsn: the DNS service's own database (the table lives in schema ``cns``).
        zone: the DNS zone names are made in.
        instance: this listener's instance UUID (default: a fresh one).
        service: the service name it registers with.
        listener_config: buffer, back-off, timeouts of its listener.
        http: HTTP client for bootstrap and fetches (default: the listener's own).
        token: bearer token for the API.
        concurrency: workers of each controller (concurrent fetches).
        fetch_batch: ids per fetch request.
        max_pending: ids a controller lets wait before it stops taking the feed.
        retry: per-id retry schedule of failed fetches and table writes (default:
            the controller's).
        registry: Prometheus registry for the listener and work-queue metrics.
        name: name in logs and metrics (the controllers add ``/vm`` and ``/server``).
    """

    def __init__(
        self,
        publisher_url: str,
        dsn: str,
        *,
        zone: str = "vms.example",
        instance: str | None = None,
        service: str = "cns",
        listener_config: ListenerConfig | None = None,
        http: httpx.AsyncClient | None = None,
        token: str | None = None,
        concurrency: int = 4,
        fetch_batch: int = 50,
        max_pending: int = 10_000,
        retry: BackoffPolicy | None = None,
        registry: CollectorRegistry | None = None,
        name: str | None = None,
    ) -> None:
        self.zone = zone.strip(".").lower()
        self.dsn = dsn
        self.listener = Listener(
            publisher_url,
            instance=instance or str(uuid.uuid4()),
            service=service,
            change_kinds=[VM_KIND, SERVER_KIND],
            config=listener_config,
            http=http,
            token=token,
            registry=registry,
            name=name,
        )
        settings: dict[str, Any] = {
            "concurrency": concurrency,
            "fetch_batch": fetch_batch,
            "max_pending": max_pending,
            "retry": retry,
            "registry": registry,
        }
        self.vms: Controller[dict[str, Any]] = Controller(
            self.listener,
            resource="vm",
            reconcile=self._vm_changed,
            name=name and f"{name}/vm",
            **settings,
        )
        self.servers: Controller[dict[str, Any]] = Controller(
            self.listener,
            resource="server",
            reconcile=self._server_changed,
            name=name and f"{name}/server",
            **settings,
        )
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self._lock = asyncio.Lock()
        # What the callbacks learned (the latest state, written or not):
        self._vm_states: dict[str, Mapping[str, Any]] = {}
        self._hostnames: dict[str, str | None] = {}  # server -> host_name(), None: no name
        self._hosted: dict[str, set[str]] = {}  # server -> the VMs that say they run on it
        # What the table holds (memory follows commits only):
        self._entries: dict[str, dict[str, tuple[str, ...]]] = {}  # vm -> {name: ips}
        self._unsure: dict[str, set[str]] = {}  # vm -> names a failed write may have changed
        self._by_name: dict[str, dict[str, tuple[str, ...]]] = {}  # name -> {vm: ips}
        self._records: dict[str, Record] = {}
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self.cleaned = 0

    # -- public face -----------------------------------------------------------

    @property
    def controller(self) -> Controller[dict[str, Any]]:
        """The VM controller (``vms``)."""
        return self.vms

    def records(self) -> dict[str, Record]:
        """A copy of the records, as last committed to the table."""
        return dict(self._records)

    async def stored_records(self) -> dict[str, Record]:
        """The records as the table holds them now."""
        conn = await asyncpg.connect(self.dsn, timeout=5.0)
        try:
            rows = await conn.fetch("SELECT name, ips, vm FROM cns.records")
        finally:
            await conn.close()
        return {r["name"]: Record(r["name"], tuple(r["ips"]), str(r["vm"])) for r in rows}

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until both first bootstraps have been applied (see Controller.wait_synced)."""
        async with asyncio.timeout(timeout):
            await asyncio.gather(self.vms.wait_synced(), self.servers.wait_synced())

    async def run(self) -> None:
        """Create the table, then follow the feed until cancelled.

        Raises:
            RegistrationRefused, RetriesExhausted: from the listener.
        """
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4, timeout=5.0)
        try:
            async with self._pool.acquire() as conn:
                await ensure_schema(conn)
            tasks = [
                asyncio.create_task(self.vms.run(), name="changefeed-dns-vms"),
                asyncio.create_task(self.servers.run(), name="changefeed-dns-servers"),
                asyncio.create_task(self._cleanup_after_sync(), name="changefeed-dns-cleanup"),
            ]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            pool, self._pool = self._pool, None
            await pool.close()

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self.run(), name="changefeed-dns")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the background task; raise the error that stopped it, unless the
        block raised one of its own."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if exc is None and not task.cancelled() and (failure := task.exception()) is not None:
            raise failure

    # -- reconcile -------------------------------------------------------------

    def _pool_or_fail(self) -> asyncpg.Pool[asyncpg.Record]:
        if self._pool is None:
            raise asyncpg.InterfaceError("the DNS controller is not running")
        return self._pool

    async def _vm_changed(
        self, vm: str, old: dict[str, Any] | None, new: dict[str, Any] | None
    ) -> None:
        async with self._lock:
            before = self._vm_states.get(vm)
            if before is not None and before.get("server_uuid") is not None:
                self._hosted.get(str(before["server_uuid"]), set()).discard(vm)
            if new is None:
                self._vm_states.pop(vm, None)
            else:
                self._vm_states[vm] = new
                if new.get("server_uuid") is not None:
                    self._hosted.setdefault(str(new["server_uuid"]), set()).add(vm)
            await self._rewrite([vm])

    async def _server_changed(
        self, server: str, old: dict[str, Any] | None, new: dict[str, Any] | None
    ) -> None:
        async with self._lock:
            if new is None:
                self._hostnames.pop(server, None)
            else:
                self._hostnames[server] = host_name(new.get("hostname"), self.zone)
            await self._rewrite(sorted(self._hosted.get(server, ())))

    async def _rewrite(self, vms: list[str]) -> None:
        """Bring the names of ``vms`` to what the callbacks last learned, in one transaction;
        memory follows only once it committed. Call with ``_lock`` held."""
        wanted = {
            vm: vm_names(self._vm_states[vm], self.zone, self._hostnames)
            if vm in self._vm_states
            else {}
            for vm in vms
        }
        changed = [
            vm for vm in vms if wanted[vm] != self._entries.get(vm, {}) or vm in self._unsure
        ]
        if not changed:
            return
        # A failed write may still have committed (the connection died after COMMIT
        # was sent): its names are written again, from what memory knows was
        # committed, whatever this change is.
        names: set[str] = set()
        for vm in changed:
            names |= (
                self._entries.get(vm, {}).keys() | wanted[vm].keys() | self._unsure.get(vm, set())
            )
        by_name = {name: dict(self._by_name.get(name, {})) for name in names}
        for vm in changed:
            for name in self._entries.get(vm, {}):
                by_name[name].pop(vm, None)
            for name, ips in wanted[vm].items():
                by_name[name][vm] = ips
        records = {name: _record(name, members) for name, members in by_name.items()}
        try:
            async with self._pool_or_fail().acquire(timeout=5.0) as conn, conn.transaction():
                for name, record in sorted(records.items()):
                    if record is None:
                        await conn.execute("DELETE FROM cns.records WHERE name = $1", name)
                    else:
                        await conn.execute(_UPSERT, name, list(record.ips), uuid.UUID(record.vm))
        except BaseException:
            for vm in changed:
                self._unsure[vm] = self._unsure.get(vm, set()) | names
            raise
        # Committed: only now does memory follow.
        self.writes += 1
        for vm in changed:
            self._unsure.pop(vm, None)
            if wanted[vm]:
                self._entries[vm] = wanted[vm]
            else:
                self._entries.pop(vm, None)
        for name, members in by_name.items():
            record = records[name]
            if record is None:
                self._by_name.pop(name, None)
                self._records.pop(name, None)
            else:
                self._by_name[name] = members
                self._records[name] = record
        log_event(log, "dns.reconciled", logging.DEBUG, vms=len(changed), names=sorted(names))

    async def _cleanup_after_sync(self) -> None:
        """After the first sync, drop rows left from an earlier run for names that are gone."""
        await self.wait_synced()
        while True:
            try:
                async with (
                    self._lock,
                    self._pool_or_fail().acquire(timeout=5.0) as conn,
                ):
                    status = await conn.execute(
                        "DELETE FROM cns.records WHERE NOT (name = ANY($1::text[]))",
                        list(self._records),
                    )
                self.cleaned = int(status.split()[-1])
                log_event(log, "dns.cleaned", stale=self.cleaned, records=len(self._records))
                return
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log_event(log, "dns.cleanup_failed", logging.WARNING, exc=exc)
                await asyncio.sleep(1.0)
