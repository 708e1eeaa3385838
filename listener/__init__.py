"""The listener side of changefeed: a listener that registers, buffers, backs off and
resumes, and controllers that keep mirrors of the publisher's resources current.

Follow a feed and act on every change::

    listener = Listener("ws://vmapi.example:8080/changefeeds", instance=INSTANCE_UUID,
                        service="tcns", change_kind=ChangeKind("vm", ("nic", "alias")))

    async def reconcile(id: str, old: dict | None, new: dict | None) -> None:
        ...  # old/new: the VM as the application last saw it / as it is now (None: absent)

    controller = Controller(listener, reconcile=reconcile)
    await controller.run()      # or: async with controller: await controller.wait_synced(60)

Several resources on one connection, one controller each (each with its own
mirror, work queue and callbacks)::

    listener = Listener(url, instance=INSTANCE_UUID, service="tcns",
                        change_kinds=[ChangeKind("vm", ("nic", "alias")), ChangeKind("server")])
    vms = Controller(listener, resource="vm", reconcile=on_vm)
    servers = Controller(listener, resource="server", reconcile=on_server)
    async with vms, servers:
        ...

Keep checkpoints, so that a restart resumes instead of bootstrapping (the
mirrors and the cursor, saved together; callbacks see only what changed)::

    listener = Listener(url, instance=INSTANCE_UUID, service="tcns", change_kinds=[...],
                        checkpoint=SqliteCheckpointStore("/var/lib/tcns/checkpoint.sqlite"))

Or read the raw events (``Resynced`` after each bootstrap, then ``ChangeItem``)::

    async with listener:
        async for event in listener:
            ...

This module's ``__all__`` is the whole public API; the ``_``-modules are
internal. A frame's way to a callback reads in four of them::

    _session.Session      websocket adapter: reads a frame, hands it on undecoded
    _inbox.Inbox          decodes it into the buffer; hands events out in feed
                          order (``async for``, or each controller's resource)
    _workqueue.WorkQueue  the controller's keyed, coalescing queue of ids
    _reconcile.Reconciler the controller's core: ids in, workers fetch, write
                          the mirror and call the application back

Around them: ``_connection`` (the connection loop: one session per attempt,
back-off), ``_listener`` and ``_controller`` (the faces: settings, start and
stop, status), ``_attachments`` (the controllers attached to a listener),
``_checkpointer``, ``_sqlite_store`` (checkpoint rows) and ``_sqlite_file``
(the file: claimed, checked, moved aside), ``_metrics``
(Prometheus, from the figures each status declares on its fields in
``_figures``). Pure code, tested without sockets: ``_lifecycle`` (the
connection state machine and what a failure means), ``_backoff`` (the
listener's settings of changefeed's one back-off policy), ``_checks`` (what
a setting may be),
``_workqueue``, ``_mirror``, ``_checkpoint`` (what a checkpoint holds and the
rules for using one), and ``_attachments``' rules. Every exception is a
``ListenerError`` (tree in ``_errors``). See docs/listener.md.

What the package must never do: block or slow the publisher (the socket is
read as fast as it delivers; a full buffer means abort and re-register, never
waiting), retry without back-off, or lose a change silently.
"""

from changefeed.schemas import ChangeItem, ChangeKind

from ._backoff import BackoffPolicy
from ._checkpoint import (
    Checkpoint,
    CheckpointStatus,
    CheckpointStore,
    JsonItems,
    MirrorCheckpoint,
)
from ._config import ListenerConfig
from ._controller import Controller
from ._errors import (
    CheckpointError,
    CheckpointRefused,
    ListenerConfigError,
    ListenerError,
    RegistrationRefused,
    RetriesExhausted,
)
from ._events import BootstrapProgress, ControllerStats, Event, ListenerStatus, Resynced
from ._handlers import (
    AddHandler,
    DeleteHandler,
    EventSource,
    Fetcher,
    ReconcileHandler,
    UpdateHandler,
)
from ._inbox import Buffer, register_buffer_kind
from ._lifecycle import ConnectionState
from ._listener import Listener
from ._sqlite_store import SqliteCheckpointStore

__all__ = [
    "AddHandler",
    "BackoffPolicy",
    "BootstrapProgress",
    "Buffer",
    "ChangeItem",
    "ChangeKind",
    "Checkpoint",
    "CheckpointError",
    "CheckpointRefused",
    "CheckpointStatus",
    "CheckpointStore",
    "ConnectionState",
    "Controller",
    "ControllerStats",
    "DeleteHandler",
    "Event",
    "EventSource",
    "Fetcher",
    "JsonItems",
    "Listener",
    "ListenerConfig",
    "ListenerConfigError",
    "ListenerError",
    "ListenerStatus",
    "MirrorCheckpoint",
    "ReconcileHandler",
    "RegistrationRefused",
    "Resynced",
    "RetriesExhausted",
    "SqliteCheckpointStore",
    "UpdateHandler",
    "register_buffer_kind",
]
