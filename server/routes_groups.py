"""Step groups on the wire: ``POST /v1/groups``, ``/v1/group_pull``, ``/v1/group_push``
(docs/PROTOCOL.md §3, Step groups).

A group is registered once (:mod:`server.store.groups` checks the list and keeps it); its pull
answers the group's values as one flat tensor with the versions as one int64 array, and its push
takes the gradients the same way and is an ordinary push of the group's variables
(:meth:`~server.store.ParameterStore.push_async`: one operation, once per ``(worker_id, seq)``,
journaled and replicated as any push). The argument checks and replies here are shared with the
shard's HTTP protocol, which answers a small group pull or push itself when it can
(:mod:`server.immediate`), with the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from client_sdk import wire
from client_sdk.wire import groups as group_wire
from client_sdk.wire.tensors import buffer_size

from .bodies import EncodedResponse
from .errors import ShardError
from .httptools_protocol import gathers
from .routes_data import BODY_DOC, bad_field, message, name_list, reply, required, writer
from .store import ParameterStore, finite_rows
from .store.checks import OneBound
from .store.groups import Group, GroupGrads, GroupVersions, RowsApplied

__all__ = [
    "group_pull_reply",
    "group_push_args",
    "group_push_reply",
    "router",
]

router = APIRouter(prefix="/v1", tags=["data plane (msgpack)"])


def _store(request: Request) -> ParameterStore:
    return request.app.state.store


def _group(store: ParameterStore, msg: Mapping[str, Any], verb: str) -> Group:
    gid = required(msg, "group", verb)
    if type(gid) is not str:
        raise bad_field(verb, "group", "a group id (string) from POST /v1/groups", gid)
    return store.groups.get(store, gid)


@router.post("/groups", openapi_extra=BODY_DOC)
async def register(request: Request) -> Response:
    """Register a step group: `{"names": [...]}` -> `{"group", "names", "dtype", "shapes",
    "nbytes", "versions"}`; the same list again gives the same group while the shard keeps
    it."""
    msg, _ = await message(request)
    names = name_list(msg, "names", "groups")
    config = request.app.state.config
    store = _store(request)
    group = store.groups.register(store, names, config.max_request_names, config.max_request_bytes)
    return reply(request, group.describe())


def group_pull_reply(store: ParameterStore, group: Group, as_arrays: bool) -> wire.Encoded:
    """A group pull's reply: the versions and the values, one flat tensor. Its header (the
    group's id, the tensors' types, sizes and offsets) is the same at every pull of a group,
    so it is encoded at the first and kept (:attr:`Group.pull_head
    <server.store.groups.Group.pull_head>`) with the padding around the versions."""
    versions, pieces = group.read(as_arrays)
    versions = np.ascontiguousarray(versions, group_wire.VERSIONS_DTYPE)
    kept = group.pull_head
    if kept is None:
        encoded = group_wire.encode(
            {"group": group.id}, versions, "values", group.dtype.str, pieces, group.nbytes
        )
        # [prefix, header, padding, versions, (padding,) *pieces]
        chunks = encoded.chunks
        kept = group.pull_head = (
            b"".join(chunks[:3]),
            b"".join(chunks[4 : len(chunks) - len(pieces)]),
        )
    before, between = kept
    chunks: list[wire.Buffer] = [before, versions.data.cast("B")]
    if between:
        chunks.append(between)
    chunks += pieces
    size = len(before) + versions.nbytes + len(between) + group.nbytes
    return wire.Encoded(wire.FRAME, chunks, size)


@router.post("/group_pull", openapi_extra=BODY_DOC)
async def group_pull(request: Request) -> Response:
    """A group's values: `{"group"}` -> a framed body `{"group", "versions": int64 tensor,
    "values": flat tensor}`."""
    msg, _ = await message(request)
    store = _store(request)
    group = _group(store, msg, "group_pull")
    await store.readable(group.names)
    group = _group(store, msg, "group_pull")  # a delete may have run meanwhile
    return EncodedResponse(group_pull_reply(store, group, gathers(request.scope)))


def group_push_args(
    store: ParameterStore, msg: Mapping[str, Any], body: wire.Buffer | None
) -> tuple[str, int, Group, GroupGrads, GroupVersions | None, Any, Any]:
    """A group push's ``(worker_id, seq, group, grads, versions, finite, block)``, checked
    (400 for a field, 422 for a gradient tensor that is not the group's dtype and size)."""
    worker_id, seq = writer(msg, "group_push", required=True)
    group = _group(store, msg, "group_push")
    if body is None:
        raise ShardError(
            "bad_request",
            f"group_push: the body must be framed ({wire.FRAME}): its 'grads' is one flat "
            "tensor after the header (docs/PROTOCOL.md, Step groups)",
            {"field": "grads"},
        )
    try:
        start = wire.header_end(body)
        offset, _ = group_wire.flat_tensor(
            msg,
            "grads",
            group.dtype,
            group.nbytes // group.dtype.itemsize,
            start,
            buffer_size(body),
        )
        held = group_wire.read_versions(msg, body, len(group.names))
    except wire.WireError as exc:
        raise ShardError(exc.code, f"group_push: {exc.message}", exc.details) from None
    if held is not None:
        end = msg["versions"]["offset"] + msg["versions"]["nbytes"]
        if msg["versions"]["offset"] < start or end > offset:
            raise ShardError(
                "bad_request",
                "group_push: 'versions' must lie between the header and 'grads'",
                {"field": "versions"},
            )
    flat = np.frombuffer(body, group.dtype, group.nbytes // group.dtype.itemsize, offset)
    grads, block = group.split(flat)
    versions = None if held is None else GroupVersions(group, held)
    return worker_id, seq, group, grads, versions, _finite(group, flat, block), block


def _finite(group: Group, flat: np.ndarray, block: np.ndarray | None) -> dict[str, float]:
    """The gradients found finite, each with at least its sum of squares (the store's
    ``finite``): all of them at once when the sum of squares of the whole flat buffer is
    finite (one reduction, whatever the shapes), else row by row for a uniform group
    (:func:`~server.store.finite_rows`), else none (the store checks each)."""
    if flat.dtype.kind == "f" and flat.dtype.itemsize >= 4 and flat.size:  # f2: the store
        with np.errstate(all="ignore"):
            total = float(np.dot(flat, flat))
        if math.isfinite(total):
            return OneBound.of(group.names, total)
    return finite_rows(group.names, block) if block is not None else {}


def group_push_reply(group: Group, result: Mapping[str, Mapping[str, Any]]) -> wire.Encoded:
    """A group push's reply: every variable's new version, in order, how many were applied,
    and the entries of those that were not (a retry's ``duplicate``, a sync round's
    ``accepted``, a ``dropped`` one)."""
    if isinstance(result, RowsApplied):  # every one applied
        versions, others = result.versions, {}
    else:
        versions = [entry["version"] for entry in result.values()]
        others = {name: entry for name, entry in result.items() if entry["status"] != "applied"}
    msg: dict[str, Any] = {
        "group": group.id,
        "versions": versions,
        "applied": len(result) - len(others),
    }
    if others:
        msg["variables"] = others
    return wire.encode(msg, tensors=False)


@router.post("/group_push", openapi_extra=BODY_DOC)
async def group_push(request: Request) -> Response:
    """Apply a group's gradients once per (worker_id, seq): a framed body `{"group",
    "worker_id", "seq", "versions"?: int64 tensor, "grads": flat tensor}` -> `{"group",
    "versions", "applied", "variables"?}`."""
    msg, body = await message(request, scan=False, tensors=True)
    store = _store(request)
    worker_id, seq, group, grads, versions, finite, block = group_push_args(store, msg, body)
    result = await store.push_async(
        worker_id, seq, grads, versions, finite=finite, block=block, group=group
    )
    return EncodedResponse(group_push_reply(group, result))
