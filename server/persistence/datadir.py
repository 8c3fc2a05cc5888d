"""A shard's data dir: the names of its snapshot files, which snapshots it keeps, and cleaning
up after an interrupted write.

A data dir belongs to one shard and holds numbered snapshots, each two files (their format is
:mod:`server.persistence.snapshot`)::

    snapshot-00000012.safetensors            values and optimizer slots (safetensors format)
    snapshot-00000012.json                   the manifest
    snapshot-00000013-<checkpoint>.json      (and .safetensors) part of fleet checkpoint <id>

A snapshot exists exactly when its manifest does (it is renamed into place last), so listing
reads names only (:func:`list_snapshots`). A write in progress, or one a crash interrupted,
leaves temporary files (``.tmp-snapshot-*``, or the safetensors writer's own: :func:`is_temporary`)
and at worst an orphan values file, which :func:`clean` removes at the next start.

**Keeping** (:func:`prune`): the newest K plain snapshots (periodic, shutdown, requested); a
fleet checkpoint's snapshot is a user's and stays until deleted (:func:`remove`), unless the
shard is told to keep only the newest N.

All functions block on file I/O; run them off the event loop. None shares state between calls.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "checkpoint_id_error",
    "clean",
    "fsync_dir",
    "fsync_path",
    "is_temporary",
    "list_snapshots",
    "manifest_name",
    "next_number",
    "prune",
    "remove",
    "stem",
    "temporary",
]

_NAME_RE = re.compile(r"snapshot-(\d{8,})(?:-([A-Za-z0-9_-]{1,64}))?\.json")
_CHECKPOINT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TMP_PREFIX = ".tmp-"
#: The temporary files of safetensors' writer (Rust's ``tempfile``: ``.tmp`` + 6 characters).
_FOREIGN_TMP_RE = re.compile(r"\.tmp[A-Za-z0-9]{6}")


# -- names ------------------------------------------------------------------------------------


def checkpoint_id_error(checkpoint: Any) -> str | None:
    """Why ``checkpoint`` is not a usable checkpoint id, or ``None`` if it is."""
    if not isinstance(checkpoint, str) or not _CHECKPOINT_RE.fullmatch(checkpoint):
        return "a checkpoint id is 1-64 characters from A-Z a-z 0-9 _ -"
    return None


def stem(number: int, checkpoint: str | None) -> str:
    """The name of snapshot ``number``'s files without their suffix."""
    return f"snapshot-{number:08d}" + (f"-{checkpoint}" if checkpoint else "")


def manifest_name(name: str) -> tuple[int, str | None] | None:
    """``(number, checkpoint)`` of the manifest file called ``name``; None if it is not one."""
    m = _NAME_RE.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def temporary(name: str) -> str:
    """The name a file called ``name`` has while it is being written."""
    return _TMP_PREFIX + name


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file a snapshot write makes in its data dir: ours
    (``.tmp-snapshot-*``) or the safetensors writer's own (``.tmp`` and 6 letters or digits,
    which it renames onto ours when it is done)."""
    return name.startswith(_TMP_PREFIX + "snapshot-") or _FOREIGN_TMP_RE.fullmatch(name) is not None


# -- listing ----------------------------------------------------------------------------------


def list_snapshots(data_dir: Path) -> list[tuple[int, str | None, Path]]:
    """``(number, checkpoint, manifest path)`` of every manifest in ``data_dir``, oldest first
    (by name only: nothing is read)."""
    out = []
    try:
        entries = list(os.scandir(data_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _NAME_RE.fullmatch(entry.name)
        if m:
            out.append((int(m.group(1)), m.group(2), Path(entry.path)))
    return sorted(out)


def next_number(data_dir: Path) -> int:
    """One more than the highest snapshot number in ``data_dir`` (manifests or values)."""
    highest = 0
    for entry in _entries(data_dir):
        m = re.match(r"(?:\.tmp-)?snapshot-(\d{8,})", entry)
        if m:
            highest = max(highest, int(m.group(1)))
    return highest + 1


def _entries(data_dir: Path) -> list[str]:
    try:
        return os.listdir(data_dir)
    except FileNotFoundError:
        return []


# -- keeping and cleaning ---------------------------------------------------------------------


def clean(data_dir: Path) -> list[str]:
    """Remove leftovers of interrupted writes: temporary files (:func:`is_temporary`), and
    values files whose manifest never appeared. Call it only while no snapshot is being
    written to ``data_dir``. Returns the names removed."""
    names = set(_entries(data_dir))
    stems = {n[: -len(".json")] for n in names if _NAME_RE.fullmatch(n)}
    removed = []
    for name in sorted(names):
        orphan = (
            name.endswith(".safetensors")
            and name.startswith("snapshot-")
            and name[: -len(".safetensors")] not in stems
        )
        if is_temporary(name) or orphan:
            try:
                os.unlink(data_dir / name)
                removed.append(name)
            except FileNotFoundError:
                pass
    if removed:
        fsync_dir(data_dir)
    return removed


def prune(data_dir: Path, keep: int, keep_checkpoints: int = 0) -> list[str]:
    """Keep the newest ``keep`` plain snapshots (periodic, shutdown, requested) and delete the
    older ones; fleet checkpoints are kept apart: every one with ``keep_checkpoints=0``, else
    the newest ``keep_checkpoints``. Returns the names removed."""
    snapshots = list_snapshots(data_dir)
    plain = [p for _, c, p in snapshots if c is None]
    ckpts = [p for _, c, p in snapshots if c is not None]
    doomed = plain[:-keep] if keep > 0 else plain
    if keep_checkpoints > 0:
        doomed += ckpts[:-keep_checkpoints]
    return remove(data_dir, doomed)


def remove(data_dir: Path, manifests: list[Path]) -> list[str]:
    """Delete these snapshots of ``data_dir`` (each manifest first, then its values, so none
    is ever left half there). Returns the names removed."""
    removed = []
    for manifest in manifests:
        for path in (manifest, manifest.with_suffix(".safetensors")):
            try:
                os.unlink(path)
                removed.append(path.name)
            except FileNotFoundError:
                pass
    if removed:
        fsync_dir(data_dir)
    return removed


# -- durably ----------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush directory ``path``'s entries (renames, removals) to the disk, where the file
    system can."""
    try:
        fsync_path(path)
    except OSError:  # some filesystems cannot fsync a directory; the renames still happened
        pass
