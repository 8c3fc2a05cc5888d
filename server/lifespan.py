"""A shard's lifespan: what runs beside its requests, started when the app starts and stopped, in
order, when it stops (``create_app`` in :mod:`server.app` hands it to FastAPI).

Started: :class:`~server.durability.Durability` (restore, periodic snapshots), the replication
of a replica of a group, the task that closes the sync rounds that time out
(:func:`server.store.rounds.close_when_due`), the token file's watch, and the campaign for the
lead (:mod:`server.replication.leadership`). Stopped: the campaign first (a primary hands the
lead over at once), then the tasks and the replication, then the final snapshot; a failed final
snapshot is kept in ``app.state.shutdown_error`` for ``paramshard serve``'s exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from .admission import Gate
from .auth import Guard
from .durability import Durability
from .replication import Role
from .replication.leadership import from_state
from .replication.replica import Replication
from .store import ParameterStore
from .store.rounds import close_when_due

__all__ = ["lifespan"]

logger = logging.getLogger("paramshard.server")


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    durability: Durability = app.state.durability
    store: ParameterStore = app.state.store
    gate: Gate = app.state.gate
    await durability.start()
    replication: Replication | None = app.state.replication
    role: Role = app.state.role
    if replication is not None:
        replication.start()
    # Sync rounds that time out close from here, while the shard takes writes (not while it
    # restores, is paused for a checkpoint, cannot persist, or drains).
    rounds = asyncio.create_task(
        close_when_due(
            store.deadlines,
            store.close_due_rounds,
            lambda: (
                gate.ready
                and gate.paused_for is None
                and gate.persist_error is None
                and role.acknowledges
            ),  # a backup closes rounds as its primary's log says
        ),
        name="paramshard-sync-rounds",
    )
    guard: Guard = app.state.auth
    watch = (
        asyncio.create_task(guard.watch(), name="paramshard-token-file")
        if guard.token_file is not None
        else None
    )
    leadership = from_state(app.state)
    app.state.leadership = leadership
    if leadership is not None:
        leadership.start()
    try:
        yield
    finally:
        if leadership is not None:
            await leadership.stop()
        for task in (rounds, watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if replication is not None:
            await replication.stop()
        follow_client = getattr(app.state, "follow_client", None)
        if follow_client is not None:
            await follow_client.aclose()
        try:
            await durability.stop()
        except Exception as exc:
            app.state.shutdown_error = f"the final snapshot failed: {exc!r}"
            logger.exception("shard %s: final snapshot failed", app.state.config.fleet)
            raise
