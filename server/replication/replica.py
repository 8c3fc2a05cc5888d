"""One replica's replication, whole: :class:`Replication` joins the role, the log, the
forwarder (when primary) and the replayer (when backup) of a shard that is one replica of a
group, and is what the rest of the shard talks to: the app makes it (``app.state.replication``,
``None`` for a shard without replicas), starts and stops it with its lifespan, waits on
:meth:`Replication.synced` before it answers a write, hands ``POST /v1/replicate`` to
:meth:`Replication.replicate`, and shows :meth:`Replication.stats` in ``GET /v1/cluster``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import Any

from client_sdk import wire

from ..config import ShardConfig
from . import catchup
from .forward import Forwarder
from .log import ReplicationLog
from .replay import Replayer, writes_of
from .role import PRIMARY, Role
from .stages import STAGE_FROM, StageStore, Staging

__all__ = ["MAX_BATCH_BYTES", "Replication"]

logger = logging.getLogger("paramshard.replication")

#: Bytes of entries one forwarded batch holds at most (at least one entry; and at most half
#: of ``--max-request-bytes``, which the backup's admission holds it to).
MAX_BATCH_BYTES = 64 << 20


class Replication:
    """The replication of the shard whose state ``store`` and ``tables`` hold."""

    def __init__(
        self,
        config: ShardConfig,
        role: Role,
        store: Any,
        tables: Any,
        gate: Any = None,
        incarnation: str = "",
    ) -> None:
        self.config = config
        self.role = role
        self.store = store
        self.tables = tables
        self.log = ReplicationLog(role, config.replication_log_bytes)
        store.journal = self.log
        self.stages = StageStore(
            config.replication_log_bytes,
            max_age=config.replica_timeout,
            wait=config.replica_timeout / 4,
        )
        self.replayer = Replayer(
            role, self.log, writes_of(store, tables), self._install, self.stages
        )
        headers = {}
        if config.token:
            headers["authorization"] = f"Bearer {config.token[0]}"
        self.forwarder = Forwarder(
            role,
            self.log,
            timeout=config.replica_timeout,
            batch_bytes=min(MAX_BATCH_BYTES, config.max_request_bytes // 2),
            headers=headers,
        )
        if gate is not None:
            self.forwarder.snapshot = functools.partial(
                catchup.capture_files, store, gate, self.log, incarnation
            )

    def start(self) -> None:
        """Begin forwarding (on the event loop; the lifespan calls it)."""
        self.forwarder.start()

    async def stop(self) -> None:
        await self.forwarder.stop()

    def stage_body(self, buf: memoryview) -> Staging | None:
        """A big body arriving at this replica (``buf`` receives it), streamed to the backups
        as it does when this replica is primary (:mod:`server.replication.stages`)."""
        if buf.nbytes < STAGE_FROM:
            return None
        return self.forwarder.stage_body(buf)

    async def synced(self) -> None:
        """Return once every backup of the in-sync set has applied every write taken so far
        (what a write's answer waits for); 421 ``not_primary`` if this replica stops
        acknowledging first."""
        head = self.log.head
        if self.role.in_sync or not self.role.acknowledges:
            await self.forwarder.synced(head)

    async def replicate(self, msg: Mapping[str, Any], body: wire.Buffer | None) -> dict[str, Any]:
        """``POST /v1/replicate``'s answer: apply a batch, say the lsn applied up to."""
        applied = await self.replayer.apply(msg, body)
        return {"applied_lsn": applied, "lsn_epoch": self.log.last_epoch, "epoch": self.role.epoch}

    async def _install(self, install: dict[str, Any], values: Any) -> None:
        """Replace the whole state with a catch-up's (:mod:`server.replication.catchup`)."""
        config = self.config
        found = await asyncio.to_thread(
            catchup.install_files,
            install,
            values,
            config.shard_index,
            config.num_shards,
            config.max_table_rows,
        )
        self.store.restore(found.variables, found.dedup, found.layouts)
        self.tables.restore(found.tables)
        changes = install.get("changes")
        if type(changes) is int:
            self.store.mutations = changes  # as on the primary when it captured
        logger.info(
            "installed the primary's state at lsn %d (%d variables, %d tables)",
            install["lsn"],
            len(found.variables),
            len(found.tables),
        )

    def quiet(self) -> Any:
        """An async context in which no forwarded batch is applied (a snapshot's capture)."""
        return self.replayer.lock

    def position(self) -> dict[str, int]:
        """Where this replica is in its log: ``{"lsn", "epoch"}``, the newest write and the
        epoch it was written at (a snapshot records it)."""
        return {"lsn": self.log.head, "epoch": self.log.last_epoch}

    def restored(self, position: Any) -> None:
        """The state was restored from a snapshot that recorded ``position`` (or none): the
        log resumes after its lsn, that write's epoch known."""
        if isinstance(position, dict) and type(position.get("lsn")) is int:
            epoch = position.get("epoch")
            self.log.restart_at(
                max(0, position["lsn"]), epoch if type(epoch) is int and epoch >= 0 else 0
            )

    def stats(self) -> dict[str, Any]:
        """``GET /v1/cluster``'s ``replication``."""
        log = self.log
        out = self.role.view.to_json()
        out.update(
            lsn=log.head,
            lsn_epoch=log.last_epoch,
            log={
                "first_lsn": log.first,
                "entries": len(log),
                "bytes": log.nbytes,
                "max_bytes": log.max_bytes,
                "trimmed": log.trimmed,
                "released": log.released,
            },
            backups=self.forwarder.stats() if self.role.kind == PRIMARY else [],
            refused=self.replayer.refused,
            stages={**self.stages.stats(), **self.forwarder.stager.stats()},
            installed=self.replayer.installed,
            changes=self.store.mutations,
        )
        return out
