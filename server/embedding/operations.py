"""The writes of embedding tables as operations, each checked whole and built before anything
changes (the pattern of :mod:`server.store.operations`):

* :class:`CreateTable` makes a table that does not exist yet (create-if-absent: a retry finds
  it made, so it carries no ``seq``);
* :class:`PushRows` applies a push's gradients to its rows, once per ``(worker_id, seq)``.

A builder refuses (:class:`~server.errors.ShardError`, nothing changed) or returns the
operation, which then holds everything its application needs: the table's name and spec, or
the distinct ids with their summed float32 gradients, the ``worker_id`` and the ``seq``.
:func:`check_ids` is the check of a request's ids both verbs share with ``pull_rows``. Pure
functions of their arguments; they change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from client_sdk.embedding import TableSpec, segment_sum, spec_from_wire
from client_sdk.optimizers import SpecError
from client_sdk.placement import row_shard, rows_on

from .. import optim
from ..errors import ShardError
from ..store.checks import all_finite
from .table import EmbeddingTable

__all__ = ["CreateTable", "PushRows", "check_ids", "create_table", "push_rows"]

_INT64_MAX = np.iinfo(np.int64).max


@dataclass(eq=False, slots=True)
class CreateTable:
    """Create table ``name`` with ``spec`` (it does not exist on this shard)."""

    name: str
    spec: TableSpec


@dataclass(eq=False, slots=True)
class PushRows:
    """Add ``grads[i]`` (float32, summed over the request's repeats of the id) to row
    ``ids[i]`` (distinct) of ``table`` with its optimizer, once per ``(worker_id, seq)``."""

    table: str
    worker_id: str
    seq: int
    ids: np.ndarray
    grads: np.ndarray


def create_table(name: str, wire_spec: Any, existing: EmbeddingTable | None) -> CreateTable | None:
    """A create of table ``name`` with the spec map ``wire_spec``: 400 naming the field for a
    bad spec; 409 naming the first field that differs for a table that exists with another
    spec; ``None`` for one that exists with this spec (nothing to do)."""
    try:
        spec = spec_from_wire(wire_spec)
        optim.check_settings(spec.optimizer, np.dtype(spec.dtype))
    except SpecError as exc:
        raise ShardError(
            "bad_request",
            f"create_table {name!r}: bad spec: {exc}",
            {"table": name, "field": exc.field},
        ) from None
    except (ValueError, TypeError) as exc:
        raise ShardError(
            "bad_request",
            f"create_table {name!r}: bad spec: {exc}",
            {"table": name, "field": "spec"},
        ) from None
    if existing is None:
        return CreateTable(name, spec)
    have = existing.spec
    if have == spec:
        return None
    for field in ("dim", "dtype", "initializer", "optimizer", "seed", "admission"):
        if getattr(have, field) != getattr(spec, field):
            break
    mine, theirs = have.to_wire()[field], spec.to_wire()[field]
    raise ShardError(
        "conflict",
        f"embedding table {name!r} already exists with {field} {mine!r}, not {theirs!r}: "
        "a table's spec (its optimizer too) is fixed when it is made; use another name, or "
        "create it with the existing spec",
        {"table": name, "field": field, "existing": mine, "requested": theirs},
    )


def check_ids(name: str, ids: Any, max_ids: int, shard_index: int, num_shards: int) -> np.ndarray:
    """A request's ``ids`` checked: a 1-d tensor of integers (any int dtype, taken as int64;
    422 otherwise), at most ``max_ids`` (413), each one this shard's (421 with the owners)."""
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        kind = ids.dtype.str if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ShardError(
            "bad_tensor",
            f"table {name!r}: ids must be a tensor of integers (int64), got {kind}: send "
            "the ids as an int64 tensor",
            {"table": name, "field": "ids"},
        )
    if ids.ndim != 1:
        raise ShardError(
            "bad_tensor",
            f"table {name!r}: ids must be 1-d, got shape {list(ids.shape)}",
            {"table": name, "field": "ids", "shape": list(ids.shape)},
        )
    if len(ids) > max_ids:
        raise ShardError(
            "too_large",
            f"table {name!r}: {len(ids)} ids in one request, above this shard's {max_ids} "
            "(--max-table-ids): split the batch",
            {"table": name, "limit": max_ids},
        )
    if ids.dtype == np.uint64 and len(ids) and int(ids.max()) > _INT64_MAX:
        raise ShardError(
            "bad_tensor",
            f"table {name!r}: ids must fit int64, got {int(ids.max())}",
            {"table": name, "field": "ids"},
        )
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    if num_shards > 1 and len(ids) and not rows_on(name, ids, num_shards, shard_index):
        owners = row_shard(name, ids, num_shards)
        wrong = np.flatnonzero(owners != shard_index)
        if len(wrong):
            first = int(wrong[0])
            raise ShardError(
                "not_owner",
                f"this is shard {shard_index} of {num_shards}; row {int(ids[first])} of table "
                f"{name!r} belongs to shard {int(owners[first])}"
                + (f" ({len(wrong) - 1} more rows are not ours)" if len(wrong) > 1 else "")
                + ": send each row to its shard (client_sdk.placement.row_shard), and check "
                "that your shard list is in fleet order",
                {
                    "table": name,
                    "shard_index": shard_index,
                    "num_shards": num_shards,
                    "rows": {str(int(ids[i])): int(owners[i]) for i in wrong[:10]},
                },
            )
    return ids


def push_rows(
    table: EmbeddingTable,
    worker_id: str,
    seq: int,
    ids: np.ndarray,
    grads: Any,
) -> PushRows:
    """A push of ``grads`` (float [len(ids), dim], bfloat16 included, finite; 422 otherwise)
    to rows ``ids`` (checked by :func:`check_ids`) of ``table``: widened to float32, repeated
    ids' gradients summed."""
    name, dim = table.name, table.dim
    if not isinstance(grads, np.ndarray) or (
        grads.dtype.kind != "f" and grads.dtype.name != "bfloat16"
    ):
        kind = grads.dtype.str if isinstance(grads, np.ndarray) else type(grads).__name__
        raise ShardError(
            "bad_tensor",
            f"table {name!r}: grads must be a float tensor, got {kind}",
            {"table": name, "field": "grads"},
        )
    if grads.shape != (len(ids), dim):
        raise ShardError(
            "bad_tensor",
            f"table {name!r}: grads have shape {list(grads.shape)}, but {len(ids)} ids of a "
            f"table of dim {dim} need [{len(ids)}, {dim}]",
            {
                "table": name,
                "field": "grads",
                "shape": list(grads.shape),
                "expected": [len(ids), dim],
            },
        )
    with np.errstate(all="ignore"):
        grads32 = grads.astype(np.float32, copy=False)
        finite = all_finite(grads32)
    if not finite:
        bad = np.flatnonzero(~np.isfinite(grads32).all(axis=1))
        raise ShardError(
            "bad_tensor",
            f"table {name!r}: grads hold NaN or infinite entries (or values beyond float32) in "
            f"{len(bad)} row(s), the first for id {int(ids[bad[0]]) if len(bad) else '?'}; "
            "nothing was applied",
            {"table": name, "field": "grads", "rows": [int(i) for i in bad[:10]]},
        )
    unique, summed = segment_sum(ids, grads32)
    return PushRows(name, worker_id, seq, unique, summed)
