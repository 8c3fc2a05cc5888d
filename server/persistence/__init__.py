"""Snapshots of one shard on disk: written atomically, the newest K kept, the newest valid one
restored.

Where each concept lives:

* ``snapshot``: one snapshot's two files (safetensors values and a JSON manifest), written
  atomically and durably, read back with every check there is (:class:`SnapshotError`).
* ``datadir``: a data dir's snapshots: their file names, listing them, which ones are kept,
  cleaning up after an interrupted write.
* ``restore``: which snapshot a shard restores at start: the newest one that validates and is
  its own (:class:`SnapshotMismatch` otherwise).

When the shard snapshots (periodically, on request, on shutdown) and what it does when the disk
refuses is ``server/durability.py``; rewriting a checkpoint for another fleet size is
``server/reshard.py``. Nothing here imports the web stack, and every function blocks on file
I/O: run them off the event loop.
"""

from __future__ import annotations

from .datadir import (
    checkpoint_id_error,
    clean,
    is_temporary,
    list_snapshots,
    next_number,
    prune,
    remove,
)
from .restore import Restorable, SnapshotMismatch, find_restorable
from .snapshot import (
    FORMAT,
    FORMAT_VERSION,
    Snapshot,
    SnapshotError,
    read_arrays,
    read_manifest,
    tensor_key,
    to_layouts,
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
    "to_layouts",
    "to_variables",
    "write_snapshot",
]
