"""Embedding tables in a shard's snapshot: their arrays in the values file beside the variables',
their specs and bookkeeping in the manifest's ``tables`` (docs/PROTOCOL.md §5).

A table's slice on a shard is saved as the arrays of
:meth:`EmbeddingTable.arrays <server.embedding.table.EmbeddingTable.arrays>`: ``ids`` [n]
int64, ``rows`` [n, dim] float32, one ``slot.<name>`` [n, dim] per optimizer slot, ``steps``,
``touches`` and ``last_update`` [n] int64, each under the key ``e<j>.<array>`` (``j``: the
table's position in the manifest: names never make keys) with its CRC-32. The manifest's entry
holds the spec, ``version``, ``rows``, ``created_at``, ``last_writer`` and ``tensors`` (array ->
``key``, ``crc32``).

:func:`add_tables` puts a capture's tables into a snapshot being written; :func:`read_tables`
reads them back, every array checked against its CRC-32 and the spec
(:class:`~server.persistence.snapshot.SnapshotError` otherwise). Both block on file I/O (the
writer's caller writes the file).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from client_sdk.embedding import TableSpec, spec_from_wire
from client_sdk.placement import validate_name

from ..embedding import EmbeddingTable
from .snapshot import (
    _ST_DTYPES,
    Snapshot,
    SnapshotError,
    _crc,
    _is_int,
    _little_endian,
    _need,
    _need_extent,
    _read_checked,
    _values_header,
)

__all__ = ["add_tables", "read_table_arrays", "read_tables"]

_ST_TO_NUMPY = {v: k for k, v in _ST_DTYPES.items()}


def add_tables(
    tables: Mapping[str, tuple[dict[str, Any], dict[str, np.ndarray]]],
    tensors: dict[str, np.ndarray],
    entries: list[dict[str, Any]],
) -> dict[str, Any]:
    """The manifest's ``tables`` for ``tables`` (name -> (meta, arrays)); each array goes into
    ``tensors`` under its key, and its manifest entry (``crc32`` to fill in) into ``entries``
    in the same order."""
    out: dict[str, Any] = {}
    for j, (name, (meta, arrays)) in enumerate(tables.items()):
        keyed = {}
        for array_name, array in arrays.items():
            key = f"e{j}.{array_name}"
            tensors[key] = array
            keyed[array_name] = {"key": key, "crc32": 0}
            entries.append(keyed[array_name])
        out[name] = {**meta, "tensors": keyed}
    return out


def read_tables(snap: Snapshot, max_rows: int) -> list[EmbeddingTable]:
    """The tables of a snapshot (none for one without ``tables``), each array checked; a table
    holding more rows than ``max_rows`` keeps them (its limit is then its row count). Raises
    :class:`SnapshotError`."""
    out = []
    for name, (spec, meta, arrays) in read_table_arrays(snap).items():
        n = meta["rows"]
        try:
            table = EmbeddingTable.restored(name, spec, max(max_rows, n), meta, arrays)
        except (ValueError, KeyError) as exc:
            raise SnapshotError(f"{snap.manifest_path.name}: {exc}") from None
        _need(len(table) == n, snap.manifest_path, f"table {name!r}: {len(table)} rows, not {n}")
        out.append(table)
    return out


def read_table_arrays(
    snap: Snapshot, *, mmap: bool = False
) -> dict[str, tuple[TableSpec, dict[str, Any], dict[str, np.ndarray]]]:
    """Each table of a snapshot as (spec, manifest entry, arrays by name), every array checked
    against its CRC-32. ``mmap=True`` maps the arrays read-only instead of reading them (for
    resharding: the kernel pages them in as they are used). Raises :class:`SnapshotError`."""
    manifest_tables = snap.manifest.get("tables")
    if manifest_tables is None:
        return {}
    path = snap.values_path
    _need(isinstance(manifest_tables, dict), snap.manifest_path, "bad 'tables'")
    out = {}
    try:
        with (
            open(path, "rb", buffering=0) as f,
            ThreadPoolExecutor(1, thread_name_prefix="paramshard-crc") as pool,
        ):
            header, start, size = _values_header(snap, f)
            for name, meta in manifest_tables.items():
                where = f"table {name!r}"
                try:
                    validate_name(name)
                    spec = spec_from_wire(meta.get("spec") if isinstance(meta, dict) else None)
                except ValueError as exc:
                    raise SnapshotError(f"{snap.manifest_path.name}: {where}: {exc}") from None
                tensors = meta.get("tensors")
                _need(
                    isinstance(tensors, dict)
                    and _is_int(meta.get("version"))
                    and _is_int(meta.get("rows")),
                    snap.manifest_path,
                    f"{where}: bad 'tensors', 'version' or 'rows'",
                )
                arrays = {}
                for array_name, t in tensors.items():
                    _need(
                        isinstance(t, dict)
                        and isinstance(t.get("key"), str)
                        and _is_int(t.get("crc32")),
                        snap.manifest_path,
                        f"{where}: bad tensor entry {array_name!r}",
                    )
                    arrays[array_name] = _read_one(
                        snap, f, pool, header, start, size, t, where, mmap
                    )
                out[name] = (spec, meta, arrays)
    except OSError as exc:
        raise SnapshotError(f"{path.name}: cannot read it ({exc})") from None
    return out


def _read_one(
    snap: Snapshot,
    f: Any,
    pool: ThreadPoolExecutor,
    header: Mapping[str, Any],
    start: int,
    size: int,
    t: Mapping[str, Any],
    where: str,
    mmap: bool = False,
) -> np.ndarray:
    path = snap.values_path
    key = t["key"]
    entry = header.get(key)
    _need(isinstance(entry, dict), path, f"{where}: no tensor {key!r}")
    kind = _ST_TO_NUMPY.get(entry.get("dtype"))
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    _need(
        kind is not None and isinstance(shape, list) and all(_is_int(d) for d in shape),
        path,
        f"{where}: {key!r}: bad dtype or shape",
    )
    assert kind is not None
    dtype = _little_endian(kind)
    nbytes = math.prod(shape) * dtype.itemsize
    _need_extent(offsets, nbytes, start, size, path, f"{where}: {key!r}")
    if mmap and nbytes:
        array = np.memmap(
            path, dtype=dtype, mode="r", offset=start + offsets[0], shape=tuple(shape)
        )
        crc = _crc(array)
    else:
        array = np.empty(shape, dtype=dtype)
        crc = _read_checked(f, start + offsets[0], array, path, pool) if nbytes else 0
    _need(crc == t["crc32"], path, f"{where}: {key!r}: CRC mismatch (corrupt)")
    return array
