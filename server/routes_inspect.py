"""JSON endpoints for people and dashboards: cluster, variables, one variable, workers,
health and readiness.

All are coroutines that run on the event loop and read the store synchronously, so what they
report is one consistent state; but for the listing of every variable, which a shard makes in
pieces with the loop free between them, so that one holding millions of variables goes on
answering its data plane meanwhile. Statistics are computed in float64 over blocks, so
inspecting a huge variable does not allocate a copy of it, and scaled so that they are finite
for any finite value (JSON has no NaN or infinity: a statistic that is not finite is null).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from client_sdk import wire
from client_sdk.partitions import Layout

from . import __version__
from .errors import ShardError
from .follow import follow
from .store import ParameterStore, Variable

__all__ = ["MAX_JSON_VALUES", "router", "value_stats"]

#: Summaries ``GET /v1/variables`` makes between two turns of the event loop.
LISTING_PIECE = 256
#: ``?values=true`` returns variables up to this many elements as JSON.
MAX_JSON_VALUES = 65_536
_BLOCK = 1 << 20

router = APIRouter(tags=["inspection (JSON)"])
logger = logging.getLogger("paramshard.server")


def _store(request: Request) -> ParameterStore:
    return request.app.state.store


def value_stats(value: np.ndarray) -> dict[str, float | None]:
    """``l2_norm``, ``min``, ``max``, ``mean`` of a value (``None`` for an empty one).

    Finite for any finite value, however large: the sum of squares is taken over the value
    divided by its largest magnitude (float64 1e200 squared would overflow) and the mean as
    the sum of the value divided by its size. A statistic that is still not finite (a value
    holding NaN or an infinity) is ``None``: JSON has no such numbers."""
    flat = value.reshape(-1)
    if flat.size == 0:
        return {"l2_norm": None, "min": None, "max": None, "mean": None}
    lo, hi = math.inf, -math.inf
    for start in range(0, flat.size, _BLOCK):
        block = flat[start : start + _BLOCK]
        lo = min(lo, float(block.min()))
        hi = max(hi, float(block.max()))
    scale = max(abs(lo), abs(hi))
    if not math.isfinite(scale) or scale == 0.0:
        scale = 1.0
    total = squares = 0.0
    with np.errstate(all="ignore"):
        for start in range(0, flat.size, _BLOCK):
            block = flat[start : start + _BLOCK].astype(np.float64)
            total += float(np.divide(block, flat.size).sum())
            np.divide(block, scale, out=block)
            squares += float(np.dot(block, block))
    return {
        name: stat if math.isfinite(stat) else None
        for name, stat in (
            ("l2_norm", scale * math.sqrt(squares)),
            ("min", lo),
            ("max", hi),
            ("mean", total),
        )
    }


@router.get("/v1/cluster", response_model=None)
async def cluster(request: Request) -> Response:
    """This shard's place in the fleet, its incarnation and what it holds.

    Workers check their shard list against it and find a group's primary through it, so it
    answers whatever state the shard is in: the fleet fields come from the configuration,
    and each part read from the shard's state (:data:`_CLUSTER_PARTS`) that raises (a bug) is
    logged with its traceback and shown in ``errors`` instead (``{part: message}``), never as
    a 500."""
    state = request.app.state
    config = state.config
    body: dict[str, Any] = {
        "shard_index": config.shard_index,
        "num_shards": config.num_shards,
        "incarnation": state.incarnation,
        "protocol_version": wire.PROTOCOL_VERSION,
        "features": list(_FEATURES),
        "version": __version__,
        "started_at": state.started_at,
        "max_table_ids": config.max_table_ids,
        "max_table_rows": config.max_table_rows,
        "max_request_bytes": config.max_request_bytes,
        "max_request_names": config.max_request_names,
        "partition_bytes": config.partition_bytes,
        "data_dir": config.data_dir is not None,  # where it is: the shard's log only
    }
    errors: dict[str, str] = {}
    for part, read in _CLUSTER_PARTS:
        try:
            body.update(read(state))
        except Exception as exc:
            logger.exception("GET /v1/cluster: its part %r failed (a bug)", part)
            errors[part] = f"{type(exc).__name__}: {exc}"[:300]
    if errors:
        body["errors"] = errors
    return Response(json.dumps(body, default=_plain), media_type=wire.JSON)


_FEATURES = (
    wire.FEATURE_TABLES,
    wire.FEATURE_PACKED,
    wire.FEATURE_COUNTER_KIND,
    wire.FEATURE_POLL,
    wire.FEATURE_SET_OPTIMIZER,
    wire.FEATURE_DELETE,
    wire.FEATURE_EMBEDDING_TABLES,
    wire.FEATURE_WIRE_DTYPE,
    wire.FEATURE_ROWS_WIRE_DTYPE,
    wire.FEATURE_GROUPS,
)


def _plain(obj: Any) -> Any:
    """A value of ``/v1/cluster`` that is not JSON by itself (a numpy scalar): as JSON."""
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def _held(state: Any) -> dict[str, Any]:
    store = state.store
    return {
        "variables": len(store),
        "bytes": store.nbytes,
        "tables": len(state.tables),
        "table_bytes": sum(t.nbytes for t in state.tables.tables.values()),
        "partitioned": len(store.layouts),
        "state_version": store.state_version,
        "polls_waiting": store.waiters.polls,
        # Since the start, for rates (``paramshard status``): pushes applied, pulls answered
        # 200.
        "pushes_applied": store.dedup.totals.pushes,
        "pulls_answered": state.traffic.statuses("pull").get(200, 0),
    }


def _durability(state: Any) -> dict[str, Any]:
    durability = state.durability
    return {
        "restored": durability.restored,
        "last_snapshot": durability.last,
        "cannot_persist": durability.cannot_persist,
    }


def _admission(state: Any) -> dict[str, Any]:
    return {
        "admission": state.gate.stats(),
        "auth": {"mode": state.auth.mode, "refused": dict(state.auth.refused)},
        "half_cache": state.narrowed.stats(),
    }


def _replication(state: Any) -> dict[str, Any]:
    replication = state.replication
    leadership = getattr(state, "leadership", None)  # set once the lifespan started it
    return {
        "replication": (state.role.view.to_json() if replication is None else replication.stats()),
        "leadership": leadership.status() if leadership is not None else None,
    }


#: The parts of ``/v1/cluster`` read from the shard's state, each on its own (:func:`cluster`).
_CLUSTER_PARTS = (
    ("held", _held),
    ("durability", _durability),
    ("admission", _admission),
    ("replication", _replication),
)


@router.get("/v1/workers")
async def workers(request: Request) -> dict[str, Any]:
    """Every worker that wrote with a seq: when last seen, writes applied, duplicates (retries
    of writes already applied, answered without applying them again), highest seq; what
    became of its gradients and their staleness percentiles."""
    return {"workers": _store(request).dedup.summaries()}


def _summary(var: Variable) -> dict[str, Any]:
    """A variable's summary; a counter's with its ``value`` (a number, small to send)."""
    summary = var.summary()
    if var.kind == "counter" and var.value.size == 1:
        value = var.value.item()
        summary["value"] = value if not isinstance(value, float) or math.isfinite(value) else None
    return summary


@router.get("/v1/variables", response_model=None)
async def variables(request: Request) -> Response:
    """A summary of every variable on this shard, sorted by name; a counter's with its value;
    a partitioned variable's layout with its parts."""
    return Response(await _listing(_store(request)), media_type=wire.JSON)


async def _listing(store: ParameterStore) -> bytes:
    """``{"variables": [...]}``, made in pieces of :data:`LISTING_PIECE` summaries with the
    event loop free between two: a shard of a million variables goes on answering its data
    plane while it lists them. The names are those of the request's start; each summary is its
    variable's when its piece is made (one deleted meanwhile is left out)."""
    names = store.sorted_names()
    pieces = [b'{"variables":[']
    for start in range(0, len(names), LISTING_PIECE):
        if start:
            await asyncio.sleep(0)
        piece = []
        for name in names[start : start + LISTING_PIECE]:
            var = store.lookup(name)
            if var is not None:
                piece.append(_summary(var))
            elif (layout := store.layouts.get(name)) is not None:
                piece.append(_layout_summary(store, layout))
        if piece:
            if len(pieces) > 1:
                pieces.append(b",")
            pieces.append(json.dumps(piece, separators=(",", ":"))[1:-1].encode())
    pieces.append(b"]}")
    return b"".join(pieces)


def _layout_summary(store: ParameterStore, layout: Layout) -> dict[str, Any]:
    """A partitioned variable as the listing shows it: the logical variable (its dtype and
    full shape) and its parts, each with its rows and the shard that owns it."""
    return {
        "name": layout.name,
        "kind": "partitioned",
        "shape": list(layout.shape),
        "dtype": layout.dtype,
        "partitions": layout.parts,
        "parts": [
            {"name": part, "rows": rows, "shard": store.owner(part)}
            for part, rows in zip(layout.part_names(), layout.rows())
        ],
    }


@router.get("/v1/variables/{name:path}", response_model=None)
async def variable(
    request: Request,
    name: str,
    values: bool = Query(
        False,
        description=f"add the values as nested lists "
        f"(variables up to {MAX_JSON_VALUES:,} elements)",
    ),
    format: Literal["json", "npy"] = Query("json", description="'npy' returns a .npy file"),
) -> Response | dict[str, Any]:
    """One variable: its summary and statistics; `?values=true` adds the values,
    `?format=npy` returns the value as a `.npy` file (read it with `numpy.load`). Asked of a
    shard that does not own the name, the owner's answer (when the shard knows the fleet's
    URLs: `--fleet-urls`)."""
    store = _store(request)
    layout = store.layouts.get(name)
    if layout is not None:  # its values are the parts': pull it, or inspect each part
        return _layout_summary(store, layout)
    try:
        var: Variable = store.get(name)
    except ShardError as exc:
        if exc.code != "not_owner":
            raise
        return await follow(request, exc)
    await store.readable([name])
    if format == "npy":
        out = io.BytesIO()
        np.lib.format.write_array(out, var.value, allow_pickle=False)
        filename = name.replace("/", "_").replace(":", "_") + ".npy"
        return Response(
            out.getvalue(),
            media_type="application/octet-stream",
            headers={"content-disposition": f'attachment; filename="{filename}"'},
        )
    summary = {**_summary(var), **value_stats(var.value), **var.training_summary()}
    if values:
        if var.value.size > MAX_JSON_VALUES:
            raise ShardError(
                "too_large",
                f"{name} has {var.value.size:,} elements; ?values=true returns at most "
                f"{MAX_JSON_VALUES:,}: fetch it as ?format=npy (numpy.load) or pull it with "
                "the SDK",
                {"elements": var.value.size, "limit": MAX_JSON_VALUES},
            )
        if var.value.dtype.kind == "f" and not np.isfinite(var.value).all():
            raise ShardError(
                "bad_tensor",
                f"{name} holds NaN or infinite entries, which JSON cannot carry: fetch it as "
                "?format=npy (numpy.load) or pull it with the SDK",
                {"variable": name},
            )
        summary["values"] = var.value.tolist()
    return JSONResponse(summary)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """200 while the process serves (liveness: also while restoring or draining)."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(request: Request) -> JSONResponse:
    """200 once the shard's state is restored and while it takes requests; 503 while it
    restores, after a failed restore, while it cannot write snapshots (it refuses writes
    then), and while it drains on shutdown."""
    gate = request.app.state.gate
    ready = gate.ready and gate.persist_error is None
    status = "ready" if ready else "cannot_persist" if gate.ready else gate.phase
    body = {"status": status, "paused_for": gate.paused_for}
    if gate.phase == "failed":
        body["error"] = gate.reason
    elif status == "cannot_persist":
        body["error"] = gate.persist_error
    return JSONResponse(
        body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "1"}
    )
