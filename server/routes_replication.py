"""Between the replicas of a shard index: ``POST /v1/replicate`` (docs/PROTOCOL.md §6), the
batches of log entries a primary forwards to its backups (:mod:`server.replication`).

A write token is needed when the shard has tokens (the primary sends the first of its
``--token``s). A shard without replicas refuses it (409 ``conflict``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from client_sdk import wire

from .bodies import read_body, read_sized
from .errors import ShardError
from .routes_data import BODY_DOC, reply

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["replication (msgpack)"])


@router.post("/replicate", openapi_extra=BODY_DOC)
async def replicate(request: Request) -> Response:
    """Apply a primary's batch of log entries in lsn order: `{"epoch", "primary", "entries":
    [[lsn, epoch, method, args, kwargs], ...]}` -> `{"applied_lsn", "epoch"}`; 409
    `stale_epoch` for an epoch below the highest this replica has seen."""
    state = request.app.state
    replication = state.replication
    if replication is None:
        raise ShardError(
            "conflict",
            "this shard is not a replica of a group (no --replica-group): it takes no "
            "forwarded entries",
            {"role": "standalone"},
        )
    body, kind = await read_body(request, state.config.max_request_bytes, False)
    msg = wire.unpack(body, kind)
    return reply(request, await replication.replicate(msg, body if kind == wire.FRAME else None))


@router.post("/stage", openapi_extra=BODY_DOC)
async def stage(request: Request) -> Response:
    """Hold a body a primary streams while it receives it, under its `X-Paramshard-Stage` id,
    until a forwarded entry names it: -> `{"staged": <bytes>}`. Never applied on its own."""
    replication = request.app.state.replication
    if replication is None:
        raise ShardError(
            "conflict",
            "this shard is not a replica of a group (no --replica-group): it holds no stages",
            {"role": "standalone"},
        )
    return reply(request, await replication.stages.receive(request, read_sized))
