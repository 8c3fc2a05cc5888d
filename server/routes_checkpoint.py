"""Fleet checkpoints: ``POST /v1/pause``, ``/v1/snapshot``, ``/v1/resume`` to take one, and
``GET /v1/checkpoints``, ``DELETE /v1/checkpoints/{id}`` to list and delete them
(docs/PROTOCOL.md §3).

A client checkpoints a fleet in three rounds, each sent to every shard at once: **pause** (stop
applying writes; the reply comes once no write is being applied), **snapshot** (capture the
state, at once and without a copy, and start writing it to the data dir, labelled with the
checkpoint id), **resume** (writes go on; the reply comes once the snapshot is on disk).
Because every shard is paused before any captures, the snapshots form one consistent cut of
the fleet, and writes stop only for as long as capturing takes. A pause holds for ``lease``
seconds at most, so a client that dies mid-checkpoint cannot stop a fleet.

The messages are small msgpack maps, read whole (at most :data:`MAX_BODY` bytes). A
checkpoint's snapshots are kept until a client deletes them (or ``--keep-checkpoints``), never
pruned like periodic ones; listing and deleting answer JSON, like the inspection endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from client_sdk import wire

from .durability import Durability
from .errors import ShardError
from .persistence import checkpoint_id_error

__all__ = ["DEFAULT_LEASE", "MAX_BODY", "MAX_LEASE", "router"]

MAX_BODY = 64 * 1024
DEFAULT_LEASE = 60.0
MAX_LEASE = 600.0

router = APIRouter(prefix="/v1", tags=["fleet checkpoints (msgpack)"])
logger = logging.getLogger("paramshard.server")

_DOC = {
    "requestBody": {
        "required": True,
        "description": "one msgpack map; see docs/PROTOCOL.md",
        "content": {wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
    },
    "responses": {"200": {"description": "msgpack map", "content": {wire.MSGPACK: {}}}},
}


async def _message(request: Request, verb: str) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "")
    kind = content_type.split(";")[0].strip().lower()
    if kind not in (wire.MSGPACK, wire.FRAME):
        raise ShardError(
            "unsupported_media_type",
            f"unsupported Content-Type {content_type!r}: send {wire.MSGPACK}",
            {"content_type": content_type},
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ShardError(
            "too_large",
            f"{verb}: a body of {declared} bytes is above the "
            f"{MAX_BODY} bytes a control message may have",
            {"limit": MAX_BODY},
        )
    body = await request.body()
    if len(body) > MAX_BODY:
        raise ShardError("too_large", f"{verb}: body above {MAX_BODY} bytes", {"limit": MAX_BODY})
    msg = wire.unpack(body, kind)
    if kind == wire.FRAME:  # no tensors: the body ends with its header
        wire.check_end(body, wire.header_end(body))
    if not isinstance(msg, dict):
        raise ShardError(
            "bad_request", f"{verb}: the body must be a msgpack map, got {type(msg).__name__}"
        )
    return msg


def _checkpoint(msg: dict[str, Any], verb: str, required: bool = True) -> str | None:
    checkpoint = msg.get("checkpoint")
    if checkpoint is None and not required:
        return None
    problem = checkpoint_id_error(checkpoint)
    if problem is not None:
        shown = repr(checkpoint) if isinstance(checkpoint, str) else type(checkpoint).__name__
        raise ShardError(
            "bad_request",
            f"{verb}: field 'checkpoint' must be set: {problem}; got {shown}",
            {"field": "checkpoint"},
        )
    return checkpoint


def _reply(msg: dict[str, Any]) -> Response:
    return Response(wire.encode(msg, frame=False).join(), media_type=wire.MSGPACK)


def _durability(request: Request) -> Durability:
    return request.app.state.durability


@router.post("/pause", openapi_extra=_DOC)
async def pause(request: Request) -> Response:
    """Stop applying writes for a fleet checkpoint: `{"checkpoint": id, "lease"?: seconds}` ->
    `{"checkpoint", "paused": true, "state_version"}`, once no write is being applied."""
    msg = await _message(request, "pause")
    checkpoint = _checkpoint(msg, "pause")
    lease = msg.get("lease", DEFAULT_LEASE)
    if lease is None:
        lease = DEFAULT_LEASE
    if (
        isinstance(lease, bool)
        or not isinstance(lease, (int, float))
        or not math.isfinite(lease)
        or not 0 < lease <= MAX_LEASE
    ):
        raise ShardError(
            "bad_request",
            f"pause: field 'lease' must be seconds in (0, {MAX_LEASE:g}], got {lease!r}",
            {"field": "lease"},
        )
    _durability(request).require()  # before anything is paused
    await request.app.state.gate.pause(checkpoint, float(lease))
    logger.info(
        "checkpoint %s: writes paused (lease %gs)",
        checkpoint,
        lease,
        extra={"event": "checkpoint", "outcome": "paused", "checkpoint": checkpoint},
    )
    return _reply(
        {
            "checkpoint": checkpoint,
            "paused": True,
            "state_version": request.app.state.store.state_version,
        }
    )


@router.post("/snapshot", openapi_extra=_DOC)
async def snapshot(request: Request) -> Response:
    """With a checkpoint id (the shard must be paused for it): capture the state now and start
    writing it, `{"checkpoint": id}` -> `{"checkpoint", "captured": true}`. Without: snapshot
    this shard and answer once written, `{}` -> `{"snapshot": {...}}`."""
    msg = await _message(request, "snapshot")
    checkpoint = _checkpoint(msg, "snapshot", required=False)
    gate = request.app.state.gate
    durability = _durability(request)
    if checkpoint is None:
        try:
            return _reply({"snapshot": await durability.snapshot()})
        except (OSError, asyncio.TimeoutError) as exc:
            raise _write_failed(exc) from None
    if gate.paused_for != checkpoint:
        raise ShardError(
            "conflict",
            f"snapshot: this shard is not paused for checkpoint "
            f"{checkpoint!r} (paused for: {gate.paused_for!r}); send /v1/pause "
            "first (its lease may have run out: use a longer one)",
            {"paused_for": gate.paused_for},
        )
    if durability.checkpoint_write(checkpoint) is None:  # a retry must not capture twice
        try:
            await durability.begin_snapshot(checkpoint, reason="checkpoint")
        except asyncio.TimeoutError as exc:
            raise _write_failed(exc) from None
    return _reply({"checkpoint": checkpoint, "captured": True})


@router.post("/resume", openapi_extra=_DOC)
async def resume(request: Request) -> Response:
    """End a checkpoint's pause, then wait until its snapshot is on disk: `{"checkpoint": id}`
    -> `{"checkpoint", "resumed": bool, "snapshot": {...} | nil}` (`resumed` is false if the
    shard was not paused for it; `snapshot` is nil if it captured none for it)."""
    msg = await _message(request, "resume")
    checkpoint = _checkpoint(msg, "resume")
    resumed = request.app.state.gate.resume(checkpoint)
    if resumed:
        logger.info(
            "checkpoint %s: writes resumed",
            checkpoint,
            extra={"event": "checkpoint", "outcome": "resumed", "checkpoint": checkpoint},
        )
    write = _durability(request).checkpoint_write(checkpoint)
    info = None
    if write is not None:
        try:
            info = await asyncio.shield(write)
        except OSError as exc:
            raise _write_failed(exc) from None
    return _reply({"checkpoint": checkpoint, "resumed": resumed, "snapshot": info})


def _write_failed(exc: Exception) -> ShardError:
    """503 for a snapshot that could not be taken: the disk refused it (``OSError``, with its
    strerror but not the data dir's path), or writes being applied did not finish in time."""
    if isinstance(exc, OSError):
        problem = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
        return ShardError(
            "unavailable",
            f"writing the snapshot to the data dir failed "
            f"({problem}): the shard's operator must check its disk (space, "
            "permissions; the shard's log names the directory); retry later",
            {"reason": "cannot_persist", "error": problem, "errno": exc.errno},
            headers={"Retry-After": "1"},
        )
    return ShardError(
        "unavailable",
        "the snapshot could not be captured: writes being applied did not finish in time; retry",
        {"reason": "busy"},
        headers={"Retry-After": "1"},
    )


@router.get("/checkpoints", tags=["fleet checkpoints (JSON)"])
async def checkpoints(request: Request) -> dict[str, Any]:
    """The fleet checkpoints this shard keeps, oldest first: `{"checkpoints": [{"checkpoint",
    "snapshot", "bytes"}, ...]}`. A checkpoint is kept until it is deleted (or, with
    `--keep-checkpoints N`, until N newer ones exist)."""
    return {"checkpoints": _durability(request).checkpoints()}


@router.delete("/checkpoints/{checkpoint}", tags=["fleet checkpoints (JSON)"])
async def delete_checkpoint(request: Request, checkpoint: str) -> dict[str, Any]:
    """Delete this shard's snapshot of a fleet checkpoint: `{"checkpoint", "removed": [file
    names]}`; 404 if it holds none, 409 if it is the shard's newest snapshot."""
    problem = checkpoint_id_error(checkpoint)
    if problem is not None:
        raise ShardError(
            "bad_request",
            f"DELETE /v1/checkpoints/{{id}}: {problem}; got {checkpoint[:80]!r}",
            {"field": "checkpoint"},
        )
    removed = await _durability(request).delete_checkpoint(checkpoint)
    return {"checkpoint": checkpoint, "removed": removed}
