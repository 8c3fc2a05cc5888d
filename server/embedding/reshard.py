"""Embedding tables in ``paramshard reshard``: every row of every table (and every id still
counted for admission) re-placed with :func:`client_sdk.placement.row_shard` over the new
fleet size, with its value, slots, step, touch and last-update counts.

:func:`plan` takes each source snapshot's tables (memory-mapped, as
:func:`server.persistence.tables.read_table_arrays` reads them) and works out where each row
goes; :func:`for_shard` then builds one new shard's tables, ready for its snapshot
(:class:`~server.store.Capture`'s ``tables``), so only one new shard's rows are in memory at a
time.

Every new shard gets every table, with the rows it owns (maybe none): a fleet's tables exist on
all its shards. A table's spec must be the same in every source. Each source shard counted the
table's updates on its own; a new shard's table version is the largest of them, and each row's
last update (and each pending id's last count) is moved by the same amount as its source's
version, so the age a ``ttl`` reads is kept. The ``admitted`` count of a new shard is the rows
it holds; ``evicted`` and ``forgotten`` start at 0. Pure numpy; blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from client_sdk.embedding import TableSpec
from client_sdk.placement import row_shard

__all__ = ["Slice", "for_shard", "plan"]

#: Arrays indexed by row besides the slots (``slot.<name>``).
_ROW_ARRAYS = ("ids", "rows", "steps", "touches", "last_update")
_PENDING = ("pending.ids", "pending.counts", "pending.last_seen")


@dataclass
class Slice:
    """One source shard's part of a table, and the new shard of each of its rows."""

    spec: TableSpec
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    owners: np.ndarray
    pending_owners: np.ndarray


def plan(
    sources: list[dict[str, tuple[TableSpec, dict[str, Any], dict[str, np.ndarray]]]],
    num_shards: int,
) -> dict[str, list[Slice]]:
    """``table name -> its slices`` over the source snapshots' tables, each row given its new
    shard. ValueError naming the table if the sources disagree on its spec or hold arrays that
    do not fit together."""
    out: dict[str, list[Slice]] = {}
    for tables in sources:
        for name, (spec, meta, arrays) in tables.items():
            slices = out.setdefault(name, [])
            if slices and slices[0].spec != spec:
                raise ValueError(
                    f"table {name!r} has another spec in another source snapshot "
                    f"({slices[0].spec.to_wire()} vs {spec.to_wire()}): these are not one fleet"
                )
            _check(name, spec, arrays, slices[0].arrays if slices else None)
            ids = np.asarray(arrays["ids"], dtype=np.int64)
            pending = np.asarray(arrays.get("pending.ids", np.zeros(0, np.int64)), np.int64)
            slices.append(
                Slice(
                    spec,
                    meta,
                    arrays,
                    row_shard(name, ids, num_shards),
                    row_shard(name, pending, num_shards),
                )
            )
    return out


def _check(
    name: str, spec: TableSpec, arrays: dict[str, np.ndarray], like: dict[str, np.ndarray] | None
) -> None:
    n = len(arrays.get("ids", ()))
    keys = set(arrays)
    if like is not None and keys != set(like):
        raise ValueError(f"table {name!r}: the source snapshots hold different arrays of it")
    for key in (*_ROW_ARRAYS, *(k for k in keys if k.startswith("slot."))):
        want = (n, spec.dim) if key == "rows" or key.startswith("slot.") else (n,)
        if key not in arrays or tuple(arrays[key].shape) != want:
            raise ValueError(f"table {name!r}: array {key!r} missing or not {want}")
    m = len(arrays.get("pending.ids", ()))
    for key in _PENDING:
        if key in arrays and tuple(arrays[key].shape) != (m,):
            raise ValueError(f"table {name!r}: array {key!r} is not ({m},)")


def for_shard(
    plans: dict[str, list[Slice]], shard: int
) -> dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """New shard ``shard``'s tables: ``name -> (manifest entry, arrays)``."""
    out = {}
    for name, slices in plans.items():
        version = max(int(s.meta["version"]) for s in slices)
        keys = [k for k in slices[0].arrays if k not in _PENDING]
        arrays: dict[str, np.ndarray] = {}
        for key in keys:
            parts = [np.asarray(s.arrays[key])[s.owners == shard] for s in slices]
            if key == "last_update":
                parts = [p + (version - int(s.meta["version"])) for p, s in zip(parts, slices)]
            arrays[key] = np.concatenate(parts)
        if any("pending.ids" in s.arrays for s in slices):
            for key in _PENDING:
                parts = []
                for s in slices:
                    if key not in s.arrays:
                        continue
                    part = np.asarray(s.arrays[key])[s.pending_owners == shard]
                    if key == "pending.last_seen":
                        part = np.where(part >= 0, part + (version - int(s.meta["version"])), part)
                    parts.append(part)
                arrays[key] = np.concatenate(parts)
        newest = max(slices, key=lambda s: int(s.meta["version"]))
        n = len(arrays["ids"])
        meta = {
            "spec": slices[0].spec.to_wire(),
            "version": version,
            "rows": n,
            "created_at": min(float(s.meta.get("created_at", 0.0)) for s in slices),
            "last_writer": newest.meta.get("last_writer"),
            "admitted": n,
            "evicted": 0,
            "forgotten": 0,
        }
        out[name] = (meta, arrays)
    return out
