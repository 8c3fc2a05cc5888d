"""Snapshots of one shard on disk."""

from __future__ import annotations

from .snapshot import (
    FORMAT,
    FORMAT_VERSION,
    Restorable,
    Snapshot,
    SnapshotError,
    SnapshotMismatch,
    checkpoint_id_error,
    clean,
    find_restorable,
    is_temporary,
    list_snapshots,
    next_number,
    prune,
    read_arrays,
    read_manifest,
    remove,
    tensor_key,
    to_variables,
    write_snapshot,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Restorable",
    "Snapshot",
    "SnapshotError",
    "SnapshotMismatch",
    "checkpoint_id_error",
    "clean",
    "find_restorable",
    "is_temporary",
    "list_snapshots",
    "next_number",
    "prune",
    "read_arrays",
    "read_manifest",
    "remove",
    "tensor_key",
    "to_variables",
    "write_snapshot",
]
