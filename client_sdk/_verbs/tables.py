"""Embedding tables: ``create_table``, ``pull_rows``, ``push_rows``.

A table lives on every shard, each holding the rows that
:func:`client_sdk.placement.row_shard` gives it. ``create_table`` goes first to the shard that
would hold a dense variable of the same name (so a name taken by a variable is refused, 409,
before any shard creates the table), then to all the others at once. ``pull_rows`` and
``push_rows`` send each shard only its rows, one request per shard (or per
:data:`MAX_IDS_PER_REQUEST` ids), all shards at once; the ids go deduplicated: a pull's rows
are expanded back to the order asked for, a push's repeated ids have their gradients summed
before sending (the shard would sum them the same way: sorted by id, in the order given).

With ``PSClient(wire_dtype=)`` a pull asks for its rows narrowed to that dtype (widened back
to float32 here, as they are put in place), and a push narrows the summed gradients it sends
(:mod:`client_sdk.wire.halves`: one beyond float16's range is :class:`BadTensorError` before
anything is sent); every shard must list ``rows_wire_dtype``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _args, wire
from .._core import REPLY_HEADROOM, Core
from .._exceptions import BadTensorError, ProtocolError
from .._fleet import MAX_TABLE_IDS
from .._flow import Flow, ShardRequest
from .._replies import Message
from ..embedding import TableSpec, distinct, put_rows, segment_sums
from ..placement import row_shard
from ..wire import halves

__all__ = ["MAX_IDS_PER_REQUEST", "check_ids", "create_table", "pull_rows", "push_rows"]

#: Ids the SDK puts in one request at most (fewer where a shard's ``max_table_ids`` is lower).
MAX_IDS_PER_REQUEST = MAX_TABLE_IDS
_INT64_MAX = np.iinfo(np.int64).max


def _require_tables(core: Core) -> None:
    """:class:`ProtocolError` naming the first shard that has no embedding tables."""
    for shard, has in enumerate(core.fleet.embedding):
        if not has:
            url = core.url(shard)
            raise ProtocolError(
                f"shard {url} has no embedding tables (its /v1/cluster does not list "
                f"{wire.FEATURE_EMBEDDING_TABLES!r}): create_table, pull_rows and push_rows need "
                "every shard at this paramshard version; upgrade the fleet",
                shard=url,
            )


def create_table(core: Core, name: Any, spec: TableSpec) -> Flow[bool]:
    """Whether this call created the table (on at least one shard)."""
    name = _args.valid_name(name)
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    _require_tables(core)
    msg = {"name": name, "spec": spec.to_wire()}
    owner = core.fleet.place(name)
    order = [[owner], [s for s in range(core.n) if s != owner]]
    created = False
    for shards in order:
        if not shards:
            continue
        batch = [
            core.post(s, "create_table", msg, deadline, mutating=True, retry_safe=True)
            for s in shards
        ]
        for request, reply in zip(batch, core.collect(batch, (yield batch))):
            got = reply.msg.get("created")
            if type(got) is not bool:
                raise _bad_reply(core, request, "a 'created' flag")
            created = created or got
    core.table_dims[name] = spec.dim
    return created


def check_ids(ids: Any, verb: str) -> np.ndarray:
    """``ids`` as a 1-d int64 array; :class:`BadTensorError` for anything else."""
    array = np.asarray(ids)
    if array.size == 0 and array.ndim == 1:  # [] is float64 to numpy
        return np.zeros(0, np.int64)
    if array.dtype.kind not in "iu" or array.dtype == np.bool_:
        raise BadTensorError(
            f"{verb}: ids must be integers (an int64 array or a list of ints), got dtype "
            f"{array.dtype}",
            code="bad_tensor",
            details={"field": "ids"},
        )
    if array.ndim != 1:
        raise BadTensorError(
            f"{verb}: ids must be a 1-d array, got shape {list(array.shape)}",
            code="bad_tensor",
            details={"field": "ids"},
        )
    if array.dtype == np.uint64 and len(array) and int(array.max()) > _INT64_MAX:
        raise BadTensorError(
            f"{verb}: ids must fit int64, got {int(array.max())}",
            code="bad_tensor",
            details={"field": "ids"},
        )
    return np.ascontiguousarray(array, dtype=np.int64)


def _half(core: Core, parts: list[tuple[int, np.ndarray]], verb: str) -> str | None:
    """The client's ``wire_dtype`` (``None``: float32), once every shard of ``parts`` is known
    to take it for rows (else :class:`ProtocolError` naming the shard, nothing sent)."""
    wire_dtype = core.settings.wire_dtype
    if wire_dtype is not None:
        for shard in {shard for shard, _ in parts}:
            core.fleet.require(
                shard, wire.FEATURE_ROWS_WIRE_DTYPE, f"{verb} with wire_dtype={wire_dtype!r}"
            )
    return wire_dtype


def _parts(core: Core, name: str, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(shard, positions in ids)`` of every request: each shard's rows, in runs of at most
    the shard's ``max_table_ids`` (:data:`MAX_IDS_PER_REQUEST` at most); one empty request to
    shard 0 when there are no ids."""
    if not len(ids):
        return [(0, np.zeros(0, np.int64))]
    shards = row_shard(name, ids, core.n)
    out = []
    most = core.fleet.max_ids
    if core.n == 1 and len(ids) <= most[0]:
        return [(0, np.arange(len(ids)))]
    for shard in range(core.n):
        positions = (shards == shard).nonzero()[0] if core.n > 1 else np.arange(len(ids))
        for start in range(0, len(positions), most[shard]):
            out.append((shard, positions[start : start + most[shard]]))
    return out


def pull_rows(core: Core, name: Any, ids: Any) -> Flow[np.ndarray]:
    """The rows of ``ids`` (float32 [len(ids), dim]), in the order given."""
    name = _args.valid_name(name)
    ids = check_ids(ids, "pull_rows")
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    _require_tables(core)
    unique, inverse = distinct(ids)
    parts = _parts(core, name, unique)
    dim = core.table_dims.get(name)
    msg: dict[str, Any] = {"name": name}
    wire_dtype = _half(core, parts, "pull_rows")
    if wire_dtype is not None:
        msg["wire_dtype"] = wire_dtype
    batch = [
        core.post(
            shard,
            "pull_rows",
            {**msg, "ids": unique if len(parts) == 1 else unique[positions]},
            deadline,
            mutating=False,
            retry_safe=True,
            tensors=True,
            max_reply=core.max_reply if dim is None else REPLY_HEADROOM + 4 * dim * len(positions),
        )
        for shard, positions in parts
    ]
    replies = core.collect(batch, (yield batch))
    got = [
        _rows(core, request, reply, len(positions), dim)
        for request, reply, (_, positions) in zip(batch, replies, parts)
    ]
    core.table_dims[name] = width = got[0].shape[1]
    if len(got) == 1:  # every row from one request, in the order of unique: no merge
        return np.asarray(got[0].take(inverse, axis=0), dtype=np.float32)
    out = np.empty((len(unique), width), np.float32)
    for rows, (_, positions) in zip(got, parts):
        if rows.shape[1] != width:
            raise _bad_reply(core, batch[0], f"rows of one width, got {width} and {rows.shape[1]}")
        put_rows(out, positions, rows)  # a half-precision part: assigned, widened
    return out.take(inverse, axis=0)


def _rows(core: Core, request: ShardRequest, reply: Message, n: int, dim: int | None) -> np.ndarray:
    obj = reply.msg.get("rows")
    try:
        rows = wire.decode_tensor(obj, reply.body)
    except wire.WireError as exc:
        raise _bad_reply(core, request, f"a 'rows' tensor ({exc.message})") from exc
    if (
        (rows.dtype.kind != "f" and rows.dtype.name != "bfloat16")
        or rows.ndim != 2
        or rows.shape[0] != n
        or (dim is not None and rows.shape[1] != dim)
    ):
        raise _bad_reply(
            core,
            request,
            f"{n} rows of {dim if dim is not None else 'one'} width, got "
            f"{rows.dtype.str} {list(rows.shape)}",
        )
    return rows


def push_rows(core: Core, name: Any, ids: Any, grads: Any) -> Flow[dict[str, Any]]:
    """``{"rows": distinct ids applied, "created": rows made, "counted": ids only counted (not
    admitted yet), "duplicate": requests a shard had applied already}``."""
    name = _args.valid_name(name)
    ids = check_ids(ids, "push_rows")
    array = np.asarray(grads)
    if array.dtype.kind != "f" or array.ndim != 2 or array.shape[0] != len(ids):
        raise BadTensorError(
            f"push_rows: grads must be a float array of shape [len(ids), dim] = [{len(ids)}, "
            f"dim], got {array.dtype.str} {list(array.shape)}",
            code="bad_tensor",
            details={"field": "grads", "shape": list(array.shape)},
        )
    dim = core.table_dims.get(name)
    if dim is not None and array.shape[1] != dim:
        raise BadTensorError(
            f"push_rows: table {name!r} has dim {dim}, but grads have {array.shape[1]} columns",
            code="bad_tensor",
            details={"field": "grads", "shape": list(array.shape), "dim": dim},
        )
    with np.errstate(over="ignore"):
        array = array.astype(np.float32, copy=False)
    unique, base, index = segment_sums(ids, array)
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    _require_tables(core)
    worker_id = core.settings.worker_id
    parts = _parts(core, name, unique)
    wire_dtype = _half(core, parts, "push_rows")
    whole = len(parts) == 1  # one request: the arrays as they are
    if index is not None and (whole or wire_dtype is not None):
        base, index = base.take(index, axis=0), None  # the sums in the order of unique
    if wire_dtype is not None:
        try:
            base = halves.narrow_array(
                base, wire_dtype, f"push_rows: the gradients of table {name!r}"
            )
        except wire.WireError as exc:
            raise BadTensorError(
                exc.message, code="bad_tensor", details={"table": name, "field": "grads"}
            ) from None
    batch = [
        core.post(
            shard,
            "push_rows",
            {
                "name": name,
                "ids": unique if whole else unique[positions],
                "grads": base if whole else _part(base, index, positions),
                "worker_id": worker_id,
                "seq": core.next_seq(),
            },
            deadline,
            mutating=True,
            retry_safe=True,
            tensors=True,
        )
        for shard, positions in parts
        if len(positions)
    ]
    if not batch:
        return {"rows": 0, "created": 0, "counted": 0, "duplicate": 0}
    replies = core.collect(batch, (yield batch))
    rows = created = counted = duplicate = 0
    for request, reply in zip(batch, replies):
        msg = reply.msg
        status, n, made = msg.get("status"), msg.get("rows"), msg.get("created")
        only = msg.get("counted", 0)
        if (
            status not in ("applied", "duplicate")
            or type(n) is not int
            or type(made) is not int
            or type(only) is not int
        ):
            raise _bad_reply(core, request, "a status, 'rows', 'created' and 'counted'")
        rows += n
        created += made
        counted += only
        duplicate += status == "duplicate"
    return {"rows": rows, "created": created, "counted": counted, "duplicate": duplicate}


def _part(base: np.ndarray, index: np.ndarray | None, positions: np.ndarray) -> np.ndarray:
    """The summed gradients of ``unique[positions]`` (:func:`segment_sums`' form): one gather
    from the level-major sums, not one into the order of ids and another for the part."""
    return base.take(positions if index is None else index[positions], axis=0)


def _bad_reply(core: Core, request: ShardRequest, wanted: str) -> ProtocolError:
    url = core.shards[request.shard]
    return ProtocolError(f"shard {url} sent a {request.verb} reply without {wanted}", shard=url)
