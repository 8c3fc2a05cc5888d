"""The data plane: ``POST /v1/{init,pull,push,assign,increment,wait,poll}`` (docs/PROTOCOL.md §3);
``set_optimizer`` and ``delete`` are :mod:`server.routes_control`'s, the embedding tables'
verbs :mod:`server.routes_tables`'s, both built on the helpers this module shares with them.

Each handler reads the body once into one buffer (:func:`server.bodies.read_body`), decodes the
message (tensors become views of that buffer, never copied out), checks the verb's fields (the
field checks below: 400 with the field's name), calls the store, and answers in the request's
encoding family with :class:`server.bodies.EncodedResponse`, which writes the arrays' own
memory as it is. Handlers are coroutines on the event loop; the store calls they make are
synchronous, except a push (which may compute off the loop,
:meth:`~server.store.ParameterStore.push_async`), ``set_optimizer`` and ``delete`` (which first
wait for such a push of their variables to finish), and the wait before an assign or increment
for such a push to finish (:meth:`~server.store.ParameterStore.settled`). These verbs ignore
fields they do not know. On a shard the handlers
are reached straight from :mod:`server.direct_routes`, and a small pull in the table layout, a
small push and an increment are answered from the shard's HTTP protocol itself when they can be
(:mod:`server.immediate`), with this module's argument checks and the same bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from client_sdk import wire
from client_sdk.wire import halves

from .bodies import EncodedResponse, read_body
from .errors import ShardError
from .headers import header
from .httptools_protocol import gathers
from .narrowed import narrow_pull
from .store import (
    COUNTER_KINDS,
    MAX_POLL_SECONDS,
    MAX_SEQ,
    MAX_WAIT_SECONDS,
    ParameterStore,
    PullRows,
    finite_rows,
)

__all__ = [
    "BODY_DOC",
    "bad_field",
    "increment_args",
    "message",
    "pull_args",
    "pull_table",
    "push_args",
    "reply",
    "required",
    "router",
    "writer",
]

_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": f"One msgpack map ({wire.MSGPACK}) or a framed body "
        f"({wire.FRAME}); see docs/PROTOCOL.md.",
        "content": {
            wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}},
            wire.FRAME: {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "responses": {
        "200": {
            "description": "msgpack (or framed) map",
            "content": {wire.MSGPACK: {}, wire.FRAME: {}},
        }
    },
}

router = APIRouter(prefix="/v1", tags=["data plane (msgpack)"])


async def _message(
    request: Request, scan: bool = False, tensors: bool = False
) -> tuple[dict[str, Any], wire.Buffer | None]:
    """The request's message, and the body its tensors' ``offset``s point into: the framed
    body, or ``None`` for a msgpack one (its tensors are inline; an ``offset`` there would
    read the message's own bytes as a tensor, so such a tensor is refused, 422). A verb
    without ``tensors`` refuses a framed body with bytes after its header; one with them
    decodes its tensors with ``whole=True``, which refuses bytes after the last."""
    config = request.app.state.config
    body, kind = await read_body(request, config.max_request_bytes, scan)
    msg = wire.unpack(body, kind, config.max_request_names)
    if not isinstance(msg, dict):
        raise ShardError("bad_request", f"the body must be a msgpack map, got {type(msg).__name__}")
    if kind != wire.FRAME:
        return msg, None
    if not tensors:
        wire.check_end(body, wire.header_end(body))
    return msg, body


def _reply(request: Request, msg: dict[str, Any], tensors: bool = False) -> EncodedResponse:
    """The reply in the request's encoding family; only pull replies hold ``tensors``."""
    if not tensors:
        return EncodedResponse(wire.encode(msg, tensors=False))
    return EncodedResponse(wire.encode(msg, frame=None if _accepts_frame(request) else False))


def _accepts_frame(request: Request) -> bool:
    return wire.FRAME in header(request.scope, b"accept", "").lower()


def _store(request: Request) -> ParameterStore:
    return request.app.state.store


# -- field checks ---------------------------------------------------------------------------


def _required(msg: Mapping[str, Any], key: str, verb: str) -> Any:
    if key not in msg:
        raise ShardError(
            "bad_request", f"{verb}: missing field {key!r} (see docs/PROTOCOL.md)", {"field": key}
        )
    return msg[key]


def _bad_field(verb: str, key: str, expected: str, got: Any) -> ShardError:
    shown = (
        repr(got)
        if isinstance(got, (int, float, str)) and len(repr(got)) <= 40
        else type(got).__name__
    )
    return ShardError(
        "bad_request", f"{verb}: field {key!r} must be {expected}, got {shown}", {"field": key}
    )


_STR = {str}


def _name_list(msg: Mapping[str, Any], key: str, verb: str) -> list[str]:
    names = _required(msg, key, verb)
    if type(names) is not list or not set(map(type, names)) <= _STR:
        raise _bad_field(verb, key, "a list of variable names (strings)", names)
    return names


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Versions are signed 64-bit ints on the wire (docs/PROTOCOL.md §3): a push's staleness, the
#: version before it minus the one offered, must fit one too.
MAX_VERSION = (1 << 63) - 1


def _versions(msg: Mapping[str, Any], verb: str) -> dict[str, int] | None:
    versions = msg.get("versions")
    if versions is None:
        return None
    if not isinstance(versions, dict):
        raise _bad_field(verb, "versions", "a map of name -> int in 0..2**63-1", versions)
    for k, v in versions.items():
        if type(k) is not str or type(v) is not int or not 0 <= v <= MAX_VERSION:
            raise _bad_field(verb, "versions", "a map of name -> int in 0..2**63-1", versions)
    return versions


def _held_list(msg: Mapping[str, Any], names: list[str], verb: str = "pull") -> list[int | None]:
    """A table pull's ``versions`` given as a list parallel to ``names``, checked."""
    versions = msg["versions"]
    if len(versions) != len(names):
        raise _bad_field(verb, "versions", f"a list as long as 'names' ({len(names)})", versions)
    for v in versions:
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_VERSION):
            raise _bad_field(verb, "versions", "a list of ints in 0..2**63-1 or nils", versions)
    return versions


def _tensor_map(
    msg: Mapping[str, Any], key: str, verb: str, body: wire.Buffer | None
) -> dict[str, Any]:
    value = _required(msg, key, verb)
    if not isinstance(value, dict):
        raise _bad_field(verb, key, "a map of name -> tensor", value)
    return wire.tensors_of(value, body, key, whole=True)


# -- verbs ----------------------------------------------------------------------------------


#: The fields of an init entry that state the variable's training mode (docs/PROTOCOL.md §3).
_MODE_FIELDS = ("sync", "max_staleness", "staleness_policy")


@router.post("/init", openapi_extra=_BODY_DOC)
async def init(request: Request) -> Response:
    """Create variables that do not exist yet: `{"variables": {name: {"value": tensor,
    "optimizer"?: {...}, "sync"?: {"replicas", "timeout"}, "max_staleness"?,
    "staleness_policy"?}}}` -> `{"variables": {name: {"version", "created"}}}`; an entry
    `{"partitions", "dtype", "shape"}` records a partitioned variable's layout."""
    msg, body = await _message(request, tensors=True)
    entries = _required(msg, "variables", "init")
    if not isinstance(entries, dict):
        raise _bad_field("init", "variables", "a map of name -> {value, optimizer}", entries)
    values, specs, modes, partitioned = {}, {}, {}, {}
    for name, entry in entries.items():
        if isinstance(entry, dict) and "partitions" in entry and "value" not in entry:
            partitioned[name] = entry  # a partitioned variable's layout (server.store.layouts)
            continue
        if not isinstance(entry, dict) or "value" not in entry:
            raise ShardError(
                "bad_request",
                f"init: variables[{name!r}] must be a map with a "
                "'value' tensor and an optional 'optimizer'",
                {"variable": name if isinstance(name, str) else repr(name)},
            )
        values[name] = entry["value"]
        specs[name] = entry.get("optimizer")
        modes[name] = {k: entry[k] for k in _MODE_FIELDS if entry.get(k) is not None}
    decoded = wire.tensors_of(values, body, "variables", whole=True)
    result = _store(request).init(
        {n: (decoded[n], specs[n], modes[n]) for n in decoded}, partitioned
    )
    return _reply(request, {"variables": result})


@router.post("/pull", openapi_extra=_BODY_DOC)
async def pull(request: Request) -> Response:
    """Read values: `{"names": [...], "versions": {name: int}, "layout"?}` -> `{"variables":
    {name: {"version", "value"?}}}`, or with `"layout": "table"` (and a framed Accept) one tensor
    table `{"table": {"versions", "dtype", "shape"}}`, a row per requested name, in order (its
    `versions` may then be a list parallel to `names`); values already held at
    the current version are left out."""
    msg, _ = await _message(request)
    names, versions, table, layout = _pull_args(msg, _accepts_frame(request))
    narrow = _wire_dtype(msg, "pull", table)
    store = _store(request)
    await store.readable(names)
    if narrow is not None:
        return EncodedResponse(await _narrowed(request, names, versions, layout, narrow))
    if table:
        return EncodedResponse(_pull_table(store, names, versions, layout, gathers(request.scope)))
    return _reply(request, {"variables": store.pull(names, versions)}, tensors=True)


def _flag(msg: Mapping[str, Any], key: str, verb: str) -> bool:
    """The optional bool field ``key`` (absent or nil: false)."""
    value = msg.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise _bad_field(verb, key, "true or false (or absent)", value)
    return value


def _pull_args(
    msg: Mapping[str, Any], frame: bool, verb: str = "pull"
) -> tuple[list[str], Mapping[str, int] | list[int | None] | None, bool, tuple[bool, bool]]:
    """A pull's (or poll's) ``(names, versions held, whether to answer with a table,
    (whether the client reads a table's ``uniform`` map, whether it reads one of packed
    rows))``, checked; ``frame``: whether the client accepts a framed reply."""
    names = _name_list(msg, "names", verb)
    layout = _layout(msg, verb)
    uniform, packed = _flag(msg, "uniform", verb), _flag(msg, "packed", verb)
    table = layout == "table" and frame
    versions: Mapping[str, int] | list[int | None] | None
    if layout == "table" and type(msg.get("versions")) is list:
        versions = _held_list(msg, names, verb)
        if not table:  # answered in the map layout after all
            versions = {n: v for n, v in zip(names, versions) if v is not None}
    else:
        versions = _versions(msg, verb)
    return names, versions, table, (uniform, uniform and packed)


def _wire_dtype(msg: Mapping[str, Any], verb: str, table: bool) -> str | None:
    """A pull's (or poll's) ``wire_dtype``: ``None`` (float32 as it is), or the half
    precision its float32 values travel in (:mod:`client_sdk.wire.halves`), checked."""
    value = msg.get("wire_dtype")
    if value is None:
        return None
    try:
        wire_dtype = halves.check_wire_dtype(value)
    except wire.WireError as exc:
        raise ShardError("bad_request", f"{verb}: {exc.message}", {"field": "wire_dtype"}) from None
    if wire_dtype is not None and not table:
        raise ShardError(
            "bad_request",
            f"{verb}: 'wire_dtype' needs the table layout: send 'layout': 'table' and accept "
            f"{wire.FRAME} (docs/PROTOCOL.md, pull)",
            {"field": "wire_dtype"},
        )
    return wire_dtype


async def _narrowed(
    request: Request,
    names: list[str],
    versions: Mapping[str, int] | list[int | None] | None,
    layout: tuple[bool, bool],
    wire_dtype: str,
    ready: bool | None = None,
) -> wire.Encoded:
    """:func:`_pull_table` with its float32 values narrowed to ``wire_dtype`` (the rows'
    indices in the table's ``narrowed``; :func:`server.narrowed.narrow_pull`); 422
    ``bad_tensor`` for a value beyond float16's range."""
    store = _store(request)
    rows = store.pull_rows(names, versions)
    narrowed = await narrow_pull(rows, wire_dtype, request.app.state.narrowed, store.bound)
    if narrowed:
        rows.whole = None
    gather = gathers(request.scope)
    return _pull_table(store, names, versions, layout, gather, ready, rows, narrowed)


def _pull_table(
    store: ParameterStore,
    names: list[str],
    versions: Mapping[str, int] | list[int | None] | None,
    layout: tuple[bool, bool],
    gather: bool,
    ready: bool | None = None,
    rows: PullRows | None = None,
    narrowed: list[int] | None = None,
) -> wire.Encoded:
    """The pull reply in the table layout; with ``ready``, a poll's (its ``ready`` beside).
    ``rows``: the rows already read (``narrowed``: the indices of those narrowed)."""
    if rows is None:
        rows = store.pull_rows(names, versions)
    # No "names" column: the rows are the requested names, in request order.
    table: dict[str, Any] = {"versions": rows.versions}
    if narrowed:
        table["narrowed"] = narrowed
    msg: dict[str, Any] = {"table": table} if ready is None else {"ready": ready, "table": table}
    # Served by the shard's own protocol, the body goes out in one vectored write of its
    # pieces (EncodedResponse, on the same condition), which may then be the arrays.
    return wire.encode_table(
        msg,
        table,
        rows.values,
        rows.dtypes,
        rows.shapes,
        arrays_as_chunks=gather,
        uniform=layout[0],
        packed=layout[1],
        laid_out=rows.whole,
    )


def _writer(msg: Mapping[str, Any], verb: str, required: bool) -> tuple[Any, Any]:
    """``(worker_id, seq)`` of a write (both or neither when optional), checked."""
    if not required:
        if "worker_id" not in msg and "seq" not in msg:
            return None, None
        if "worker_id" not in msg or "seq" not in msg:
            given, other = ("seq", "worker_id") if "seq" in msg else ("worker_id", "seq")
            raise ShardError(
                "bad_request",
                f"{verb}: {given!r} without {other!r}: a write is "
                "applied once per (worker_id, seq), so send both, or neither "
                "(docs/PROTOCOL.md)",
                {"field": other},
            )
    worker_id = _required(msg, "worker_id", verb)
    if not isinstance(worker_id, str) or not 0 < len(worker_id) <= 256:
        raise _bad_field(verb, "worker_id", "a string of 1-256 characters", worker_id)
    seq = _required(msg, "seq", verb)
    if not _int(seq) or not 0 <= seq <= MAX_SEQ:
        raise _bad_field(verb, "seq", "an int in 0..2**63-1", seq)
    return worker_id, seq


def _layout(msg: Mapping[str, Any], verb: str) -> str:
    layout = msg.get("layout")
    if layout is None:
        return "map"
    if layout not in ("map", "table"):
        raise _bad_field(verb, "layout", "'map' or 'table' (or absent)", layout)
    return layout


def _table_map(
    kind: str, msg: Mapping[str, Any], key: str, verb: str, body: wire.Buffer | None
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """A verb's tensor field sent as a tensor table: ``{name: tensor}``, every row a tensor;
    and the rows as one block when they have one dtype and shape (``wire.table_rows``).
    ``kind``: the request's content type, lower-case, without parameters."""
    value = _required(msg, key, verb)
    if kind != wire.FRAME:
        raise ShardError(
            "bad_request",
            f"{verb}: a tensor table ('layout': 'table') needs a framed body ({wire.FRAME})",
            {"field": key},
        )
    names, arrays, block = wire.table_rows(value, body, key, with_block=True, whole=True)
    out = dict(zip(names, arrays))
    if len(out) != len(names):
        raise _bad_field(verb, f"{key}.names", "a list of distinct names", names)
    missing = [n for n, a in out.items() if a is None]
    if missing:
        raise ShardError(
            "bad_request",
            f"{verb}: {key} row {missing[0]!r} has no tensor "
            "(nil dtype): every row of this table needs one",
            {"field": key, "variable": missing[0]},
        )
    return out, block


@router.post("/push", openapi_extra=_BODY_DOC)
async def push(request: Request) -> Response:
    """Apply gradients once per (worker_id, seq): `{"worker_id", "seq", "grads": {name:
    tensor}, "versions"?}` -> `{"variables": {name: {"status", "version", "staleness", ...}}}`
    (status `applied`, `accepted` into a sync round, `dropped` with a `reason`, `duplicate`).
    With `"layout": "table"` (framed bodies), `grads` is one tensor table."""
    msg, body = await _message(request, scan=True, tensors=True)
    kind = header(request.scope, b"content-type", "").split(";")[0].strip().lower()
    # Gradients a FiniteScan found finite while the body arrived (same header, same bytes).
    finite = getattr(request.state, "finite", None) or {}
    worker_id, seq, grads, versions, finite, block = _push_args(msg, kind, body, finite)
    result = await _store(request).push_async(
        worker_id, seq, grads, versions, finite=finite, block=block
    )
    return _reply(request, {"variables": result})


def _push_args(
    msg: Mapping[str, Any], kind: str, body: wire.Buffer | None, finite: Mapping[str, float]
) -> tuple[str, int, dict[str, Any], dict[str, int] | None, Mapping[str, float], Any]:
    """A push's ``(worker_id, seq, grads, versions, finite, block)``, checked: ``finite``
    as given, or found by one pass over a table of same-shaped gradients."""
    worker_id, seq = _writer(msg, "push", required=True)
    versions = _versions(msg, "push")
    block = None
    if _layout(msg, "push") == "table":
        if isinstance(msg.get("grads"), dict) and "versions" in msg["grads"]:
            raise ShardError(
                "bad_request",
                "push: 'versions' is not a column of the 'grads' "
                "table: send it at the top level of the message, as a map "
                "{name: version} (docs/PROTOCOL.md, push)",
                {"field": "grads.versions"},
            )
        grads, block = _table_map(kind, msg, "grads", "push", body)
        if not finite:  # a table of same-shaped gradients is checked in one pass
            finite = finite_rows(list(grads), block)
    else:
        grads = _tensor_map(msg, "grads", "push", body)
    return worker_id, seq, grads, versions, finite, block


@router.post("/assign", openapi_extra=_BODY_DOC)
async def assign(request: Request) -> Response:
    """Overwrite values: `{"values": {name: tensor}, "worker_id"?, "seq"?}` ->
    `{"variables": {name: {"status", "version"}}}`."""
    msg, body = await _message(request, tensors=True)
    worker_id, seq = _writer(msg, "assign", required=False)
    values = _tensor_map(msg, "values", "assign", body)
    store = _store(request)
    await store.settled(values)
    return _reply(request, {"variables": store.assign(values, worker_id, seq)})


@router.post("/increment", openapi_extra=_BODY_DOC)
async def increment(request: Request) -> Response:
    """Atomic fetch-and-add: `{"name", "delta"?, "kind"?, "worker_id"?, "seq"?}` ->
    `{"value", "version", "status"}`."""
    msg, _ = await _message(request)
    name, delta, worker_id, seq, kind = _increment_args(msg)
    store = _store(request)
    await store.settled([name])
    return _reply(request, store.increment(name, delta, worker_id, seq, kind))


def _increment_args(msg: Mapping[str, Any]) -> tuple[str, int | float, Any, Any, str | None]:
    """An increment's ``(name, delta, worker_id, seq, kind)``, checked."""
    worker_id, seq = _writer(msg, "increment", required=False)
    name = _required(msg, "name", "increment")
    if not isinstance(name, str):
        raise _bad_field("increment", "name", "a variable name (string)", name)
    delta = msg.get("delta", 1)
    if delta is None:
        delta = 1
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise _bad_field("increment", "delta", "an int or a float", delta)
    kind = msg.get("kind")
    if kind is not None and kind not in COUNTER_KINDS:
        raise _bad_field("increment", "kind", "'int' or 'float' (or absent)", kind)
    return name, delta, worker_id, seq, kind


@router.post("/wait", openapi_extra=_BODY_DOC)
async def wait(request: Request) -> Response:
    """Long-poll until variables exist: `{"names", "timeout"?}` -> `{"ready", "missing"}`."""
    msg, _ = await _message(request)
    names = _name_list(msg, "names", "wait")
    timeout = _timeout(msg, "wait", MAX_WAIT_SECONDS)
    return _reply(request, await _store(request).wait(names, timeout))


def _timeout(msg: Mapping[str, Any], verb: str, most: float) -> float:
    """A long poll's optional ``timeout`` (default 10 s), checked to be in 0..``most``."""
    timeout = msg.get("timeout", 10.0)
    if timeout is None:
        timeout = 10.0
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 <= timeout <= most
    ):
        raise _bad_field(verb, "timeout", f"a number of seconds in 0..{most:g}", timeout)
    return float(timeout)


@router.post("/poll", openapi_extra=_BODY_DOC)
async def poll(request: Request) -> Response:
    """Long-poll, then pull: `{"names", "versions"?, "min_version"?, "timeout"?, "layout"?}` ->
    a pull's reply plus `"ready"`. Answers once a named variable's version differs from
    `versions` (or, with `min_version`, once every one reached it), or at the timeout."""
    msg, _ = await _message(request)
    names, versions, table, layout = _pull_args(msg, _accepts_frame(request), "poll")
    narrow = _wire_dtype(msg, "poll", table)
    min_version = msg.get("min_version")
    if min_version is not None and (not _int(min_version) or not 0 <= min_version <= MAX_VERSION):
        raise _bad_field("poll", "min_version", "an int in 0..2**63-1 (or absent)", min_version)
    timeout = _timeout(msg, "poll", MAX_POLL_SECONDS)
    store = _store(request)
    ready = await store.poll(names, versions, min_version, timeout, _disconnected(request))
    await store.readable(names)
    if narrow is not None:
        return EncodedResponse(await _narrowed(request, names, versions, layout, narrow, ready))
    if table:
        return EncodedResponse(
            _pull_table(store, names, versions, layout, gathers(request.scope), ready)
        )
    return _reply(request, {"ready": ready, "variables": store.pull(names, versions)}, tensors=True)


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (its body has been read: the server's
    next message for this request is ``http.disconnect``); never, if the server keeps
    sending other messages instead."""
    for _ in range(3):  # at most the end-of-body message the server may still hold
        if (await request.receive())["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()


# What the data plane's other routers (server/routes_control.py, server/routes_tables.py) share
# with this one.
BODY_DOC = _BODY_DOC
message = _message
reply = _reply
required = _required
bad_field = _bad_field
writer = _writer
# ... and with the requests the shard's HTTP protocol answers itself (server/immediate.py).
pull_args = _pull_args
pull_table = _pull_table
push_args = _push_args
increment_args = _increment_args
name_list = _name_list
store_of = _store
