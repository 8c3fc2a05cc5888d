"""``paramshard reshard``: rewrite a fleet checkpoint of N shards as one of M shards, offline.

Snapshots are keyed by variable name, so resharding is placement recomputed: every variable of
every source snapshot goes, with its value, version, update count, optimizer spec and slots, to
``shard_for(name, M)``; every row of every embedding table, with its slots and counts, to
``row_shard(table, id, M)`` (:mod:`server.embedding.reshard`). The dedup tables of the
sources are merged, and every new shard gets the merged table (a retry can never be applied
twice; after a reshard the workers' fleet size changes anyway, so they start afresh).

Which snapshots are read: those of ``checkpoint`` if given; else, with ``latest``, the newest
valid snapshot of each source dir (right for a fleet stopped cleanly: its final snapshots are
one consistent state); else the newest fleet checkpoint every source dir holds. The sources
must be the data dirs of shards 0..N-1 of one N-shard fleet, in any order.

The output directory must be new or empty; shard ``j`` of the new fleet gets ``<to>/shard-<j>``
(pass it as that shard's ``--data-dir``), each holding one snapshot labelled with the checkpoint
id. Arrays are memory-mapped from the sources, not loaded, so memory use stays small. Blocks.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client_sdk.placement import shard_for

from . import persistence
from .embedding import reshard as table_moves
from .persistence.tables import read_table_arrays
from .progress import Progress
from .store import Capture, DedupTable

__all__ = ["ReshardError", "ReshardResult", "reshard", "shard_dir"]

logger = logging.getLogger("paramshard.reshard")


class ReshardError(Exception):
    """The sources or the destination cannot be resharded; the message says what to do."""


@dataclass
class ReshardResult:
    checkpoint: str
    source_shards: int
    snapshots: list[persistence.Snapshot]
    variables: int
    seconds: float
    tables: int = 0
    rows: int = 0


def _values_bytes(snap: persistence.Snapshot) -> int:
    size = snap.manifest.get("values_bytes")
    return size if isinstance(size, int) else 0


def shard_dir(root: Path, index: int) -> Path:
    """Where shard ``index``'s data dir is under a fleet directory (``up --data-dir``, reshard
    output): ``<root>/shard-<index>``."""
    return root / f"shard-{index}"


def _choose(
    sources: list[Path], checkpoint: str | None, latest: bool
) -> list[persistence.Snapshot]:
    for d in sources:
        if not d.is_dir():
            raise ReshardError(f"--from {d}: no such directory")
    if latest:
        chosen = []
        for d in sources:
            candidates = persistence.list_snapshots(d)
            snap = None
            for _, _, path in reversed(candidates):
                try:
                    snap = persistence.read_manifest(path)
                    break
                except persistence.SnapshotError as exc:
                    logger.warning("skipping %s: %s", path, exc)
            if snap is None:
                raise ReshardError(f"--from {d}: no valid snapshot")
            chosen.append(snap)
        return chosen
    if checkpoint is None:
        common = None
        for d in sources:
            ids = {c for _, c, _ in persistence.list_snapshots(d) if c is not None}
            common = ids if common is None else common & ids
        if not common:
            raise ReshardError(
                "the --from directories hold no fleet checkpoint in common: take one with "
                "ps.checkpoint() (or pass --checkpoint ID), or pass --latest to use each "
                "directory's newest snapshot (right after stopping the whole fleet cleanly)"
            )
        newest = {}
        for d in sources:
            for n, c, _ in persistence.list_snapshots(d):
                if c in common:
                    newest[c] = max(newest.get(c, 0), n)
        checkpoint = max(common, key=lambda c: (newest[c], c))
    chosen = []
    for d in sources:
        paths = [p for _, c, p in persistence.list_snapshots(d) if c == checkpoint]
        if not paths:
            raise ReshardError(f"--from {d}: no snapshot of checkpoint {checkpoint!r}")
        try:
            chosen.append(persistence.read_manifest(paths[-1]))
        except persistence.SnapshotError as exc:
            raise ReshardError(
                f"--from {d}: the snapshot of checkpoint {checkpoint!r} is damaged: {exc}"
            ) from None
    return chosen


def _check_fleet(sources: list[Path], snaps: list[persistence.Snapshot]) -> int:
    sizes = {s.manifest["num_shards"] for s in snaps}
    if len(sizes) != 1:
        raise ReshardError(
            f"the --from snapshots come from fleets of different sizes "
            f"{sorted(sizes)}: give the data dirs of one fleet"
        )
    n = sizes.pop()
    seen: dict[int, Path] = {}
    for d, s in zip(sources, snaps):
        i = s.manifest["shard_index"]
        if i in seen:
            raise ReshardError(
                f"{seen[i]} and {d} both hold shard {i}: give each shard's data dir once"
            )
        seen[i] = d
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        raise ReshardError(
            f"the fleet had {n} shards but shard(s) {missing} are missing from "
            "--from: give the data dir of every shard"
        )
    return n


def reshard(
    sources: list[Path],
    dest: Path,
    num_shards: int,
    *,
    checkpoint: str | None = None,
    latest: bool = False,
    progress: Progress | None = None,
) -> ReshardResult:
    """Rewrite the chosen snapshots of ``sources`` as a ``num_shards``-shard checkpoint under
    ``dest`` (see the module); ``progress`` shows the reading (every array checked) and the
    writing (shard by shard). Raises :class:`ReshardError`; ``OSError`` if the disk
    refuses."""
    progress = Progress(io.StringIO()) if progress is None else progress
    started = time.perf_counter()
    if num_shards < 1:
        raise ReshardError(f"--shards must be >= 1, got {num_shards}")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ReshardError(
            f"--to {dest} exists and is not an empty directory: choose a new one "
            "(resharding never overwrites snapshots)"
        )
    if checkpoint is not None and persistence.checkpoint_id_error(checkpoint):
        raise ReshardError(
            f"--checkpoint {checkpoint!r}: {persistence.checkpoint_id_error(checkpoint)}"
        )
    snaps = _choose(sources, checkpoint, latest)
    _check_fleet(sources, snaps)
    label = (
        checkpoint
        or (snaps[0].checkpoint if not latest else None)
        or time.strftime("reshard-%Y%m%dT%H%M%SZ", time.gmtime())
    )

    plans: list[dict[str, tuple[dict[str, Any], Any]]] = [{} for _ in range(num_shards)]
    layouts: list[dict[str, Any]] = [{} for _ in range(num_shards)]
    tables = []
    embedding = []
    progress.begin(f"reading {len(snaps)} snapshot(s)", sum(_values_bytes(snap) for snap in snaps))
    for snap in snaps:
        try:
            arrays = persistence.read_arrays(snap, mmap=True, progress=progress.add)
            persistence.to_variables(snap, arrays)  # checks optimizer specs and slots
            tables.append(DedupTable.load(snap.manifest["dedup"]))
            embedding.append(read_table_arrays(snap, mmap=True))
        except (persistence.SnapshotError, ValueError) as exc:
            raise ReshardError(f"{snap.manifest_path}: {exc}") from None
        for name, meta in snap.manifest["variables"].items():
            target = shard_for(name, num_shards)
            if name in plans[target]:
                raise ReshardError(f"variable {name!r} is in more than one source snapshot")
            kept = {k: v for k, v in meta.items() if k != "tensors"}
            plans[target][name] = (kept, arrays[name])
        for layout in persistence.to_layouts(snap):  # a partitioned variable's: by its name
            target = shard_for(layout.name, num_shards)
            if layout.name in layouts[target]:
                raise ReshardError(f"layout {layout.name!r} is in more than one source snapshot")
            layouts[target][layout.name] = layout.to_wire()
    try:
        rows = table_moves.plan(embedding, num_shards)
    except ValueError as exc:
        raise ReshardError(str(exc)) from None
    clash = sorted(set(rows) & {n for p in plans for n in p})
    if clash:
        raise ReshardError(f"{clash[0]!r} is both a variable and an embedding table")
    progress.end()
    dedup = DedupTable.merge(tables).export()
    taken_at = max(s.manifest["created_at"] for s in snaps)
    written = []
    sizes = [
        sum(a.nbytes for _, arrays in variables.values() for a in arrays.values())
        for variables in plans
    ]
    progress.begin(f"writing {num_shards} shard(s)", sum(sizes))
    for j, variables in enumerate(plans):
        shard_tables = table_moves.for_shard(rows, j)
        capture = Capture(
            shard_index=j,
            num_shards=num_shards,
            state_version=sum(meta["version"] for meta, _ in variables.values())
            + sum(meta["version"] for meta, _ in shard_tables.values()),
            mutations=0,
            variables=variables,
            dedup=dedup,
            taken_at=taken_at,
            layouts=layouts[j],
            tables=shard_tables,
        )
        written.append(
            persistence.write_snapshot(
                shard_dir(dest, j), 1, capture, incarnation="reshard", checkpoint=label
            )
        )
        progress.add(sizes[j])
    progress.end()
    return ReshardResult(
        label,
        len(snaps),
        written,
        sum(len(p) for p in plans),
        time.perf_counter() - started,
        len(rows),
        sum(len(s.owners) for slices in rows.values() for s in slices),
    )
