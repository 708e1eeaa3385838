"""The example DNS controller: derives DNS records from the VM API's feed, as Triton CNS does.

It follows ``vm`` changes (sub-resources ``nic`` and ``alias``) with a
``Controller`` and keeps, in storage it owns, one record per name:

    ``<alias>.<zone>`` -> the IPs of the nics of every VM with that alias

in the PostgreSQL table ``cns.records(name text primary key, ips text[] not
null, vm uuid not null)`` (created idempotently; ``vm`` is the smallest uuid
among the VMs sharing the name), plus the same records in memory for
printing. ``derive_records`` is the pure definition: after writes stop, the
table equals ``derive_records(<every VM the API holds>, zone)``.

An alias becomes a name only when it is a valid DNS label once lowercased
(``[a-z0-9]``, inner ``-``, at most 63 characters); a VM without nics or with
another alias has no record.

It must never write the VM API's tables, never leave the table and the
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
    "DnsController",
    "Record",
    "derive_records",
    "dns_label",
    "ensure_schema",
    "render_records",
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


def _entry(vm: Mapping[str, Any], zone: str) -> tuple[str, tuple[str, ...]] | None:
    """A VM's (name, ips), or None when it has no record."""
    label = dns_label(vm.get("alias"))
    nics = vm.get("nics")
    if label is None or not isinstance(nics, list):
        return None
    ips = tuple(
        sorted(
            {str(n["ip"]) for n in nics if isinstance(n, dict) and isinstance(n.get("ip"), str)},
            key=_ip_key,
        )
    )
    return (f"{label}.{zone}", ips) if ips else None


def _record(name: str, members: Mapping[str, tuple[str, ...]]) -> Record | None:
    if not members:
        return None
    ips = sorted({ip for vm_ips in members.values() for ip in vm_ips}, key=_ip_key)
    return Record(name, tuple(ips), min(members))


def derive_records(vms: Iterable[Mapping[str, Any]], zone: str) -> dict[str, Record]:
    """The records a set of VMs yields: the definition the controller maintains."""
    by_name: dict[str, dict[str, tuple[str, ...]]] = {}
    for vm in vms:
        entry = _entry(vm, zone)
        if entry is not None:
            by_name.setdefault(entry[0], {})[str(vm["uuid"])] = entry[1]
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
    """Keeps ``cns.records`` (and an in-memory copy) derived from the VM API's feed.

    Args:
        publisher_url: the VM API's websocket, ``ws://host:port/changefeeds``.
        dsn: the DNS service's own database (the table lives in schema ``cns``).
        zone: the DNS zone names are made in.
        instance: this listener's instance UUID (default: a fresh one).
        service: the service name it registers with.
        listener_config: buffer, back-off, timeouts of its listener.
        http: HTTP client for bootstrap and fetches (default: the listener's own).
        token: bearer token for the VM API.
        concurrency: controller workers (concurrent fetches).
        fetch_batch: ids per fetch request.
        max_pending: ids the controller lets wait before it stops reading the feed.
        retry: per-VM retry schedule of failed fetches and table writes (default:
            the controller's).
        registry: Prometheus registry for the listener and work-queue metrics.
        name: name in logs and metrics.
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
            change_kind=ChangeKind("vm", ("nic", "alias")),
            config=listener_config,
            http=http,
            token=token,
            registry=registry,
            name=name,
        )
        self.controller = Controller(
            self.listener,
            reconcile=self._reconcile,
            concurrency=concurrency,
            fetch_batch=fetch_batch,
            max_pending=max_pending,
            retry=retry,
            registry=registry,
            name=name,
        )
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self._lock = asyncio.Lock()
        self._entries: dict[str, tuple[str, tuple[str, ...]]] = {}  # vm -> (name, ips)
        self._unsure: dict[str, set[str]] = {}  # vm -> names a failed write may have changed
        self._by_name: dict[str, dict[str, tuple[str, ...]]] = {}  # name -> {vm: ips}
        self._records: dict[str, Record] = {}
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self.cleaned = 0

    # -- public face -----------------------------------------------------------

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
        """Wait until the first bootstrap has been applied (see Controller.wait_synced)."""
        await self.controller.wait_synced(timeout)

    async def run(self) -> None:
        """Create the table, then follow the feed until cancelled.

        Raises:
            RegistrationRefused, RetriesExhausted: from the listener.
        """
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4, timeout=5.0)
        try:
            async with self._pool.acquire() as conn:
                await ensure_schema(conn)
            cleanup = asyncio.create_task(self._cleanup_after_sync())
            try:
                await self.controller.run()
            finally:
                cleanup.cancel()
                await asyncio.gather(cleanup, return_exceptions=True)
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
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- reconcile -------------------------------------------------------------

    def _pool_or_fail(self) -> asyncpg.Pool[asyncpg.Record]:
        if self._pool is None:
            raise asyncpg.InterfaceError("the DNS controller is not running")
        return self._pool

    async def _reconcile(self, vm: str, old: Any, new: Any) -> None:
        async with self._lock:
            entry = _entry(new, self.zone) if new is not None else None
            previous = self._entries.get(vm)
            unsure = self._unsure.get(vm, set())
            if entry == previous and not unsure:
                return
            # A failed write may still have committed (the connection died after
            # COMMIT was sent): its names are written again, from what memory
            # knows was committed, whatever this change is.
            names = {e[0] for e in (previous, entry) if e is not None} | unsure
            by_name = {name: dict(self._by_name.get(name, {})) for name in names}
            if previous is not None:
                by_name[previous[0]].pop(vm, None)
            if entry is not None:
                by_name[entry[0]][vm] = entry[1]
            records = {name: _record(name, members) for name, members in by_name.items()}
            try:
                async with self._pool_or_fail().acquire(timeout=5.0) as conn, conn.transaction():
                    for name, record in records.items():
                        if record is None:
                            await conn.execute("DELETE FROM cns.records WHERE name = $1", name)
                        else:
                            await conn.execute(
                                _UPSERT, name, list(record.ips), uuid.UUID(record.vm)
                            )
            except BaseException:
                self._unsure[vm] = names
                raise
            # Committed: only now does memory follow.
            self._unsure.pop(vm, None)
            self.writes += 1
            if entry is None:
                self._entries.pop(vm, None)
            else:
                self._entries[vm] = entry
            for name, members in by_name.items():
                record = records[name]
                if record is None:
                    self._by_name.pop(name, None)
                    self._records.pop(name, None)
                else:
                    self._by_name[name] = members
                    self._records[name] = record
        log_event(log, "dns.reconciled", logging.DEBUG, vm=vm, names=sorted(names))

    async def _cleanup_after_sync(self) -> None:
        """After the first sync, drop rows left from an earlier run for VMs that are gone."""
        await self.controller.wait_synced()
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
                log_event(log, "dns.cleanup_failed", logging.WARNING, error=repr(exc))
                await asyncio.sleep(1.0)
