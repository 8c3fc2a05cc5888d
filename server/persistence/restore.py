"""Restoring a shard at start: the newest snapshot of its data dir that validates and is its own.

:func:`find_restorable` walks the data dir's snapshots newest first (or only a fleet
checkpoint's, for ``--restore``), reads each in full (:mod:`server.persistence.snapshot`: every
check it makes), logs a warning for each one that does not validate and returns the first that
does, with its variables and dedup table ready for ``ParameterStore.restore`` (and its
embedding tables for ``EmbeddingTables.restore``). It refuses
(:class:`SnapshotMismatch`) rather than start a shard on another shard's state, or empty when
its snapshots exist but none validates. ``server/durability.py`` runs it in a worker thread
while the shard already answers ``/healthz``.

Blocks on file I/O; run it off the event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from client_sdk.partitions import Layout

from ..embedding import DEFAULT_MAX_ROWS, EmbeddingTable
from ..progress import Progress
from ..store import DedupTable, Variable
from .datadir import list_snapshots
from .snapshot import (
    Snapshot,
    SnapshotError,
    read_arrays,
    read_manifest,
    to_layouts,
    to_variables,
)
from .tables import read_tables

__all__ = ["Restorable", "SnapshotMismatch", "find_restorable"]

logger = logging.getLogger("paramshard.server")


class SnapshotMismatch(Exception):
    """Valid snapshots of another shard or fleet size: starting on them would misplace
    variables. The message says what to do."""


@dataclass
class Restorable:
    """A snapshot read in full: what the store restores."""

    snapshot: Snapshot
    variables: list[Variable]
    dedup: DedupTable
    skipped: list[str]
    seconds: float
    tables: list[EmbeddingTable]
    layouts: list[Layout] = field(default_factory=list)


def find_restorable(
    data_dir: Path,
    shard_index: int,
    num_shards: int,
    checkpoint: str | None = None,
    max_table_rows: int = DEFAULT_MAX_ROWS,
    progress: Progress | None = None,
) -> Restorable | None:
    """The newest snapshot in ``data_dir`` that validates, read in full; ``None`` if there is
    no snapshot at all. Each one skipped is logged as a warning (and listed in ``skipped``).
    ``progress`` shows each snapshot's reading (on a terminal).

    With ``checkpoint``, only that fleet checkpoint's snapshot is considered. Raises
    :class:`SnapshotMismatch` when the snapshots are another shard's or fleet size's, or when
    snapshots exist but none validates (starting empty would silently drop the state).
    """
    started = time.perf_counter()
    candidates = [
        (n, c, p) for n, c, p in list_snapshots(data_dir) if checkpoint is None or c == checkpoint
    ]
    if not candidates:
        if checkpoint is not None:
            raise SnapshotMismatch(
                f"{data_dir} has no snapshot of checkpoint {checkpoint!r}: check the id "
                "(ps.checkpoint() returned it), or start without --restore to use the newest "
                "snapshot"
            )
        return None
    skipped = []
    for _, _, manifest_path in reversed(candidates):
        try:
            snap = read_manifest(manifest_path)
            m = snap.manifest
            if (m["shard_index"], m["num_shards"]) != (shard_index, num_shards):
                raise SnapshotMismatch(
                    f"{manifest_path} holds shard {m['shard_index']} of a {m['num_shards']}-"
                    f"shard fleet, but this is shard {shard_index} of {num_shards}: start it "
                    f"with --shard-index {m['shard_index']} --num-shards {m['num_shards']}, "
                    "give it another --data-dir, or reshard the checkpoint (paramshard reshard)"
                )
            if progress is None:
                arrays = read_arrays(snap)
            else:
                size = m.get("values_bytes")
                progress.begin(
                    f"restoring {manifest_path.stem}", size if isinstance(size, int) else 0
                )
                try:
                    arrays = read_arrays(snap, progress=progress.add)
                finally:
                    progress.end()
            variables = to_variables(snap, arrays)
            tables = read_tables(snap, max_table_rows)
            try:
                dedup = DedupTable.load(m["dedup"])
            except ValueError as exc:
                raise SnapshotError(f"{manifest_path.name}: {exc}") from None
        except SnapshotError as exc:
            logger.warning("skipping snapshot %s: %s", manifest_path, exc)
            skipped.append(f"{manifest_path.name}: {exc}")
            continue
        return Restorable(
            snap,
            variables,
            dedup,
            skipped,
            time.perf_counter() - started,
            tables,
            to_layouts(snap),
        )
    raise SnapshotMismatch(
        f"none of the {len(candidates)} snapshot(s) in {data_dir} validates ({'; '.join(skipped)})"
        ": move the damaged files away to start from an older copy, or move them all away to "
        "start empty"
    )
