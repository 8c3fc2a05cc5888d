"""Embedding tables over HTTP: the data plane's ``POST /v1/create_table``, ``/v1/pull_rows``,
``/v1/push_rows`` (msgpack or framed bodies, as the other verbs: docs/PROTOCOL.md §3), and the
JSON ``GET /v1/tables``, ``/v1/tables/{name}``, ``/v1/tables/{name}/rows?ids=...`` for people.

With ``wire_dtype`` a pull's rows travel narrowed to float16 or bfloat16
(:mod:`client_sdk.wire.halves`; big ones narrowed off the loop, the gathered rows being the
request's own), and a push's half-precision gradients are widened to float32 by its operation.

Each data-plane handler reads its body once (:func:`server.routes_data.message`; the tensors
``ids`` and ``grads`` stay views of that buffer), checks the fields it needs (400 naming the
field), and calls the shard's :class:`~server.embedding.EmbeddingTables` (``app.state.tables``)
synchronously on the event loop: a pull's rows are gathered and a push's applied with no
``await`` between check and write. A small pull of float32 rows, and a small push_rows, are
answered from the shard's HTTP protocol itself when they can be (:mod:`server.immediate`), with
this module's argument checks and the same bytes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from client_sdk import wire
from client_sdk.wire import halves

from .embedding import EmbeddingTables
from .errors import ShardError
from .narrowed import NARROW_ON_LOOP
from .routes_data import BODY_DOC, bad_field, message, reply, required, writer

__all__ = ["MAX_INSPECT_IDS", "router", "table_name", "whole_tensors"]

#: Ids ``GET /v1/tables/{name}/rows`` shows at most.
MAX_INSPECT_IDS = 1000

router = APIRouter(prefix="/v1", tags=["embedding tables"])


def _tables(request: Request) -> EmbeddingTables:
    return request.app.state.tables


def _name(msg: dict[str, Any], verb: str) -> str:
    name = required(msg, "name", verb)
    if type(name) is not str:
        raise bad_field(verb, "name", "a table name (string)", name)
    return name


def _whole(msg: dict[str, Any], keys: tuple[str, ...], verb: str, body: wire.Buffer | None) -> dict:
    """The request's tensors ``keys``, every one of its framed body's (nothing after them)."""
    return wire.tensors_of({k: required(msg, k, verb) for k in keys}, body, verb, whole=True)


@router.post("/create_table", openapi_extra=BODY_DOC)
async def create_table(request: Request) -> Response:
    """Create an embedding table unless it exists: `{"name", "spec": {"dim", "dtype"?,
    "initializer"?, "optimizer"?, "seed"?}}` -> `{"created", "version"}`; a table that exists
    with another spec is 409 naming the field."""
    msg, _ = await message(request)
    name = _name(msg, "create_table")
    spec = required(msg, "spec", "create_table")
    return reply(request, _tables(request).create(name, spec))


@router.post("/pull_rows", openapi_extra=BODY_DOC)
async def pull_rows(request: Request) -> Response:
    """Read rows: `{"name", "ids": int64 tensor [n], "wire_dtype"?}` -> `{"rows": float32
    tensor [n, dim] (float16 or bfloat16 with `wire_dtype`), "version"}` (repeats allowed; an
    id without a row gets its initializer's row)."""
    msg, body = await message(request, tensors=True)
    name = _name(msg, "pull_rows")
    narrow = _wire_dtype(msg)
    ids = _whole(msg, ("ids",), "pull_rows", body)["ids"]
    table, rows = _tables(request).pull(name, ids)
    if narrow is not None:
        rows = await _narrowed(table.name, rows, narrow)
    return reply(request, {"rows": rows, "version": table.version}, tensors=True)


def _wire_dtype(msg: dict[str, Any]) -> str | None:
    """A pull_rows' ``wire_dtype``: ``None`` (float32), or the half precision its rows travel
    in; 400 naming the field for anything else."""
    value = msg.get("wire_dtype")
    if value is None:
        return None
    try:
        return halves.check_wire_dtype(value)
    except wire.WireError as exc:
        raise ShardError(
            "bad_request", f"pull_rows: {exc.message}", {"field": "wire_dtype"}
        ) from None


async def _narrowed(name: str, rows: np.ndarray, wire_dtype: str) -> np.ndarray:
    """``rows`` (this request's own array) narrowed to ``wire_dtype``; 422 ``bad_tensor``
    naming the table for a row beyond float16's range."""
    args = (rows, wire_dtype, f"embedding table {name!r}: the rows pulled")
    try:
        if rows.nbytes <= NARROW_ON_LOOP:
            return halves.narrow_array(*args)
        return await asyncio.to_thread(halves.narrow_array, *args)
    except wire.WireError as exc:
        raise ShardError(exc.code, exc.message, {"table": name, "wire_dtype": wire_dtype}) from None


@router.post("/push_rows", openapi_extra=BODY_DOC)
async def push_rows(request: Request) -> Response:
    """Apply row gradients once per (worker_id, seq): `{"name", "ids": int64 tensor [n],
    "grads": float tensor [n, dim], "worker_id", "seq"}` -> `{"status", "version", "rows",
    "created"}` (repeated ids' gradients summed first)."""
    msg, body = await message(request, tensors=True)
    worker_id, seq = writer(msg, "push_rows", required=True)
    name = _name(msg, "push_rows")
    tensors = _whole(msg, ("ids", "grads"), "push_rows", body)
    result = _tables(request).push(name, worker_id, seq, tensors["ids"], tensors["grads"])
    return reply(request, result)


# The argument checks the requests the shard's HTTP protocol answers itself share
# (server/immediate.py).
table_name = _name
whole_tensors = _whole


# -- inspection (JSON) ----------------------------------------------------------------------


@router.get("/tables", tags=["inspection (JSON)"])
async def list_tables(request: Request) -> dict[str, Any]:
    """The embedding tables of this shard: name, dim, rows, bytes, version, optimizer."""
    tables = _tables(request)
    return {
        "tables": [
            {
                "name": t.name,
                "dim": t.dim,
                "dtype": t.spec.dtype,
                "rows": len(t),
                "bytes": t.nbytes,
                "version": t.version,
                "optimizer": t.spec.optimizer.to_wire(),
            }
            for t in sorted(tables.tables.values(), key=lambda t: t.name)
        ]
    }


@router.get("/tables/{name:path}/rows", tags=["inspection (JSON)"])
async def table_rows(
    request: Request, name: str, ids: str = Query(..., description="ids, comma-separated")
) -> dict[str, Any]:
    """Rows of ids given as `?ids=1,2,3` (at most 1,000): each with its values and whether the
    shard stores it (else it is the initializer's row, as a pull would answer)."""
    parsed = _parse_ids(ids)
    tables = _tables(request)
    table = tables.get(name)
    array = np.array(parsed, dtype=np.int64)
    _, rows = tables.pull(name, array)
    stored = table.index.lookup(array) >= 0
    return {
        "name": table.name,
        "dim": table.dim,
        "rows": [
            {"id": i, "stored": bool(s), "values": [float(x) for x in row]}
            for i, s, row in zip(parsed, stored.tolist(), rows.tolist())
        ],
    }


@router.get("/tables/{name:path}", tags=["inspection (JSON)"])
async def table_info(request: Request, name: str) -> dict[str, Any]:
    """One table: spec, rows, bytes, version, and the ids updated most (`hottest`)."""
    tables = _tables(request)
    return tables.describe(tables.get(name))


def _parse_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ShardError(
            "bad_request", "ids: give at least one id, e.g. ?ids=1,2,3", {"field": "ids"}
        )
    if len(parts) > MAX_INSPECT_IDS:
        raise ShardError(
            "bad_request",
            f"ids: at most {MAX_INSPECT_IDS} ids per request, got {len(parts)}: ask for fewer",
            {"field": "ids", "limit": MAX_INSPECT_IDS},
        )
    out = []
    for p in parts:
        try:
            value = int(p, 10)
        except ValueError:
            raise ShardError(
                "bad_request", f"ids: {p[:40]!r} is not an integer id", {"field": "ids"}
            ) from None
        if not -(1 << 63) <= value < (1 << 63):
            raise ShardError("bad_request", f"ids: {p[:40]} is outside int64", {"field": "ids"})
        out.append(value)
    return out
