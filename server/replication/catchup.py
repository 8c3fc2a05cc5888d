"""Catch-up: a backup that needs writes its primary's log no longer holds (one that starts
late, restarts, or fell too far behind) gets the primary's whole state instead, then the log
from there.

The primary captures its state at one instant (the capture snapshots use:
:meth:`ParameterStore.capture <server.store.verbs.ParameterStore.capture>`, with the writes in
flight let finish first), at the lsn its log has then (``L``), writes it as a snapshot into a
temporary directory (the snapshots' own format and checks, docs/PROTOCOL.md §5), and sends the
two files in one ``POST /v1/replicate`` message (``"install"``). It goes on taking writes
meanwhile; its log keeps those after ``L`` (unless it lets them go first: then it installs
again). The backup reads the files back through the restore a shard runs at start, replaces its
whole state with them (between two batches: no replay runs meanwhile), and takes ``L`` as the
lsn applied up to; the log's entries after ``L`` follow as usual, and the backup rejoins the
in-sync set once it has them all.

Both sides hold the snapshot's files in memory while it travels (about the state's bytes, once
on each side), and on disk in a temporary directory while it is written and read.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .. import persistence
from ..errors import ShardError
from ..persistence.datadir import manifest_name

__all__ = ["capture_files", "install_files"]

#: The snapshot number the files of a catch-up carry (they never meet a data dir's).
NUMBER = 1


async def capture_files(store: Any, gate: Any, log: Any, incarnation: str) -> dict[str, Any]:
    """The primary's state now as snapshot files: ``{"lsn", "epoch", "manifest_name",
    "manifest", "values"}`` (the newest write it holds and that write's epoch; the files'
    bytes, ``values`` a uint8 array)."""
    async with gate.quiesce():
        capture = store.capture()
        epoch, lsn = log.position
    return await asyncio.to_thread(_write_and_read, capture, lsn, epoch, incarnation)


def _write_and_read(capture: Any, lsn: int, epoch: int, incarnation: str) -> dict[str, Any]:
    where = Path(tempfile.mkdtemp(prefix="paramshard-catchup-"))
    try:
        snap = persistence.write_snapshot(where, NUMBER, capture, incarnation=incarnation)
        values = np.fromfile(snap.values_path, dtype=np.uint8)
        return {
            "lsn": lsn,
            "epoch": epoch,
            "changes": capture.mutations,
            "manifest_name": snap.manifest_path.name,
            "manifest": snap.manifest_path.read_bytes(),
            "values": values,
        }
    finally:
        shutil.rmtree(where, ignore_errors=True)


def install_files(
    install: dict[str, Any], values: np.ndarray, shard_index: int, num_shards: int, max_rows: int
) -> persistence.Restorable:
    """Read a catch-up's files back as a shard's restore does (every check of a snapshot);
    400 ``bad_request`` if they do not make one."""
    name, manifest = install.get("manifest_name"), install.get("manifest")
    if (
        not isinstance(name, str)
        or manifest_name(name) is None
        or not isinstance(manifest, (bytes, bytearray))
    ):
        raise ShardError("bad_request", "replicate: 'install' needs a snapshot's manifest")
    where = Path(tempfile.mkdtemp(prefix="paramshard-install-"))
    try:
        (where / name).write_bytes(manifest)
        values_name = name[: -len(".json")] + ".safetensors"
        values.tofile(where / values_name)
        try:
            found = persistence.find_restorable(where, shard_index, num_shards, None, max_rows)
        except (persistence.SnapshotMismatch, persistence.SnapshotError, OSError) as exc:
            raise ShardError("bad_request", f"replicate: the snapshot sent: {exc}") from None
        if found is None:
            raise ShardError("bad_request", "replicate: the snapshot sent holds nothing")
        return found
    finally:
        shutil.rmtree(where, ignore_errors=True)
