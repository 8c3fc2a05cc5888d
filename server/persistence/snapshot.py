"""One snapshot of a shard: its two files' format, written atomically, read back checked.

A snapshot is a values file and a manifest, named and kept in a data dir as
:mod:`server.persistence.datadir` says.

The **values file** is safetensors: each variable's value and optimizer slots, under keys made
from positions (:func:`tensor_key`), never from names, so any name round-trips; snapshots whose
keys are names (as older ones are) read the same way, through the manifest.

The **manifest** (JSON) says, per variable, its dtype, shape, version, update count, optimizer
spec (with its ``optimizer_version`` and whether it is ``frozen``: absent in older snapshots,
read as 0 and false), bookkeeping and the safetensors key and CRC-32 of its value and of each
optimizer slot; plus the dedup table, the shard's index, fleet size and incarnation, its state
version, and when it was written. It carries a CRC-32 of its own canonical JSON form
(``checksum``).

**Writing** (:func:`write_snapshot`): the values go to a temporary file (safetensors' writer
reads the arrays' own memory: no copy), which is fsynced and renamed; then the manifest the
same way; then the directory is fsynced. The manifest is renamed last, so a snapshot exists
exactly when its manifest does: a crash at any point leaves the earlier snapshots intact and at
worst a temporary file or an orphan values file (:func:`server.persistence.datadir.clean`).

**Reading** (:func:`read_manifest`, :func:`read_arrays`, :func:`to_variables`) checks everything
it can: the manifest's checksum and structure, the safetensors header against the manifest, the
file's length, every array's CRC-32, and the optimizer specs and slots; a failure is a
:class:`SnapshotError` saying what is wrong. Arrays are read with ``readinto`` into fresh memory
(one copy, without holding the GIL) or, for resharding, memory-mapped.

All functions block on file I/O; run them off the event loop. None shares state between calls.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from client_sdk import wire
from client_sdk.optimizers import from_wire
from client_sdk.partitions import Layout
from client_sdk.placement import validate_name

from .. import optim
from ..store import Capture, Variable
from ..store.modes import restored as restored_mode
from .datadir import fsync_dir, fsync_path, manifest_name, stem, temporary

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Snapshot",
    "SnapshotError",
    "read_arrays",
    "read_manifest",
    "tensor_key",
    "to_layouts",
    "to_variables",
    "write_snapshot",
]

FORMAT = "paramshard-snapshot"
FORMAT_VERSION = 1
#: numpy dtype kind+size -> safetensors dtype name.
_ST_DTYPES = {
    "f2": "F16",
    "f4": "F32",
    "f8": "F64",
    "i1": "I8",
    "i2": "I16",
    "i4": "I32",
    "i8": "I64",
    "u1": "U8",
    "u2": "U16",
    "u4": "U32",
    "u8": "U64",
}
_MAX_HEADER = 256 << 20
#: Reads go in blocks of this size; the CRC of one block is computed (in a helper thread) while
#: the next one is read.
_READ_BLOCK = 8 << 20


class SnapshotError(ValueError):
    """A snapshot that does not validate (torn, truncated, corrupt); the message says how."""


@dataclass(frozen=True)
class Snapshot:
    """A validated manifest and where its files are."""

    manifest_path: Path
    manifest: dict[str, Any]

    @property
    def number(self) -> int:
        return int(self.manifest["snapshot"])

    @property
    def checkpoint(self) -> str | None:
        return self.manifest.get("checkpoint")

    @property
    def values_path(self) -> Path:
        return self.manifest_path.parent / self.manifest["values_file"]

    @property
    def state_version(self) -> int:
        return int(self.manifest["state_version"])

    def info(self) -> dict[str, Any]:
        """What the shard reports about this snapshot (``/v1/cluster``, checkpoint replies) to
        anyone who asks: ``path`` is the manifest's name in the data dir, never where the data
        dir is (the shard's log says that)."""
        m = self.manifest
        return {
            "snapshot": m["snapshot"],
            "checkpoint": m.get("checkpoint"),
            "created_at": m["created_at"],
            "state_version": m["state_version"],
            "variables": len(m["variables"]),
            "bytes": m["values_bytes"],
            "path": self.manifest_path.name,
        }


# -- writing ----------------------------------------------------------------------------------


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(
        manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _crc(a: np.ndarray) -> int:
    if a.nbytes == 0:
        return 0
    return zlib.crc32(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


#: The arrays of a variable that are not optimizer slots: its value, and an open sync round's
#: sum (docs/PROTOCOL.md §5).
_NOT_SLOTS = ("value", "round")


def tensor_key(index: int, slot: str) -> str:
    """The safetensors key of slot ``slot`` (``"value"``, an optimizer slot, or ``"round"``) of the
    ``index``-th variable of a snapshot. Keys are made from positions, never from names, so
    that no variable name can collide with another key or with safetensors' own
    ``__metadata__``; the manifest maps each name to its keys."""
    return f"t{index}" if slot == "value" else f"t{index}.{slot}"


def write_snapshot(
    data_dir: Path,
    number: int,
    capture: Capture,
    *,
    incarnation: str,
    checkpoint: str | None = None,
) -> Snapshot:
    """Write ``capture`` as snapshot ``number`` of ``data_dir`` (created if missing),
    atomically and durably (see the module). Blocks; returns the written snapshot.

    Raises ``OSError`` if the disk refuses, with the ``errno`` of the failed call (also when the
    safetensors writer failed); the earlier snapshots are untouched either way.
    """
    from safetensors.numpy import save_file

    data_dir.mkdir(parents=True, exist_ok=True)
    base = stem(number, checkpoint)
    tensors: dict[str, np.ndarray] = {}
    entries: list[dict[str, Any]] = []  # the manifest's entry of each tensor, in order
    variables: dict[str, Any] = {}
    for j, (name, (meta, arrays)) in enumerate(capture.variables.items()):
        slots = {}
        for slot, array in arrays.items():
            key = tensor_key(j, slot)
            tensors[key] = array
            slots[slot] = {"key": key, "crc32": 0}  # filled in below
            entries.append(slots[slot])
        variables[name] = {**meta, "tensors": slots}
    tables = None
    if capture.tables:
        from .tables import add_tables  # it reads this module's helpers

        tables = add_tables(capture.tables, tensors, entries)
    values_name = base + ".safetensors"
    tmp_values = data_dir / temporary(values_name)
    renamed: Path | None = None  # the values file, once renamed: removed if the manifest fails
    tmp_manifest = data_dir / temporary(base + ".json")
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="paramshard-crc") as pool:
            crcs = pool.map(_crc, tensors.values())  # alongside the write: both read the arrays
            try:
                save_file(tensors, tmp_values, metadata={"paramshard_snapshot": str(number)})
            except OSError:
                raise
            except Exception as exc:  # safetensors' own error type, for I/O errors too
                raise _os_error(exc) from exc
            for entry, crc in zip(entries, crcs):
                entry["crc32"] = crc
        fsync_path(tmp_values)
        values_bytes = tmp_values.stat().st_size
        os.replace(tmp_values, data_dir / values_name)
        renamed = data_dir / values_name
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "snapshot": number,
            "checkpoint": checkpoint,
            "created_at": capture.taken_at,
            "written_at": time.time(),
            "shard_index": capture.shard_index,
            "num_shards": capture.num_shards,
            "incarnation": incarnation,
            "state_version": capture.state_version,
            "values_file": values_name,
            "values_bytes": values_bytes,
            "variables": variables,
            "dedup": capture.dedup,
        }
        if tables is not None:
            manifest["tables"] = tables
        if capture.layouts:  # partitioned variables' layouts (server.store.layouts)
            manifest["layouts"] = capture.layouts
        if capture.replication is not None:  # a replica's place in its log (server.replication)
            manifest["replication"] = capture.replication
        manifest["checksum"] = zlib.crc32(_canonical(manifest))
        with open(tmp_manifest, "w", encoding="ascii") as f:
            json.dump(manifest, f, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        manifest_path = data_dir / (base + ".json")
        os.replace(tmp_manifest, manifest_path)
        renamed = None  # the snapshot is whole now
        fsync_dir(data_dir)
    except BaseException:
        for path in (tmp_values, tmp_manifest, renamed):
            if path is None:
                continue
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return Snapshot(manifest_path, manifest)


def _os_error(exc: Exception) -> OSError:
    """The ``OSError`` an error of the safetensors writer stands for: its message ends with
    the errno of the failed call (``... (os error 28)``); EIO when it has none."""
    m = re.search(r"os error (\d+)", str(exc))
    code = int(m.group(1)) if m else errno.EIO
    return OSError(code, f"{os.strerror(code)} (the safetensors writer: {exc})")


# -- reading ----------------------------------------------------------------------------------


def _need(cond: bool, path: Path, message: str) -> None:
    if not cond:
        raise SnapshotError(f"{path.name}: {message}")


def _little_endian(kind: str) -> np.dtype:
    """The numpy dtype of a safetensors tensor (always little-endian) of ``kind`` (e.g. "f4")."""
    return np.dtype("<" + kind if kind[1] != "1" else "|" + kind)


def _need_extent(offsets: Any, nbytes: int, start: int, size: int, path: Path, what: str) -> None:
    """Refuse (:class:`SnapshotError`) a tensor's ``data_offsets`` that do not hold exactly
    ``nbytes`` inside a values file of ``size`` bytes whose data begins at ``start``."""
    _need(
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) for o in offsets)
        and offsets[1] - offsets[0] == nbytes
        and start + offsets[1] <= size,
        path,
        f"{what}: data out of the file's bounds (truncated?)",
    )


def _is_int(value: Any, lo: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def read_manifest(path: Path) -> Snapshot:
    """Read and check a manifest (not yet its values file). Raises :class:`SnapshotError`."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"{path.name}: cannot read it ({exc})") from None
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"{path.name}: not valid JSON (torn or corrupt: {exc})") from None
    _need(isinstance(manifest, dict), path, "not a JSON object")
    _need(manifest.get("format") == FORMAT, path, f"not a {FORMAT} manifest")
    _need(
        manifest.get("format_version") == FORMAT_VERSION,
        path,
        f"format version {manifest.get('format_version')!r}; this paramshard reads "
        f"{FORMAT_VERSION}",
    )
    checksum = manifest.pop("checksum", None)
    try:
        actual = zlib.crc32(_canonical(manifest))
    except ValueError:
        actual = None
    _need(checksum == actual, path, "checksum mismatch (corrupt)")
    manifest["checksum"] = checksum
    named = manifest_name(path.name)
    _need(
        named is not None
        and _is_int(manifest.get("snapshot"), 1)
        and named == (manifest["snapshot"], manifest.get("checkpoint")),
        path,
        "file name and contents disagree",
    )
    for key in ("shard_index", "num_shards", "state_version", "values_bytes"):
        _need(_is_int(manifest.get(key)), path, f"bad {key!r}")
    _need(0 <= manifest["shard_index"] < manifest["num_shards"], path, "bad shard index")
    _need(isinstance(manifest.get("created_at"), (int, float)), path, "bad 'created_at'")
    _need(manifest.get("values_file") == path.stem + ".safetensors", path, "bad 'values_file'")
    _need(isinstance(manifest.get("variables"), dict), path, "bad 'variables'")
    _need(isinstance(manifest.get("dedup"), dict), path, "bad 'dedup'")
    for name, meta in manifest["variables"].items():
        _check_variable(path, name, meta)
    _need(isinstance(manifest.get("layouts", {}), dict), path, "bad 'layouts'")
    to_layouts(Snapshot(path, manifest))
    return Snapshot(path, manifest)


def to_layouts(snap: Snapshot) -> list[Layout]:
    """The partitioned variables' layouts a snapshot holds (none before the first was made).
    Raises :class:`SnapshotError`."""
    out = []
    for name, entry in snap.manifest.get("layouts", {}).items():
        try:
            out.append(Layout.from_wire(name, entry))
        except ValueError as exc:
            raise SnapshotError(f"{snap.manifest_path.name}: layout of {name!r}: {exc}") from None
        _need(
            name not in snap.manifest["variables"],
            snap.manifest_path,
            f"{name!r} is both a variable and a partitioned variable's layout",
        )
    return out


def _check_variable(path: Path, name: str, meta: Any) -> None:
    try:
        validate_name(name)
    except ValueError as exc:
        raise SnapshotError(f"{path.name}: {exc}") from None
    where = f"variable {name!r}"
    _need(isinstance(meta, dict), path, f"{where}: not an object")
    _need(meta.get("kind") in ("tensor", "counter"), path, f"{where}: bad kind")
    try:
        dtype = wire.parse_dtype(meta.get("dtype"))
    except wire.WireError as exc:
        raise SnapshotError(f"{path.name}: {where}: {exc.message}") from None
    _need(dtype.isnative, path, f"{where}: dtype {dtype.str} is not this machine's byte order")
    shape = meta.get("shape")
    _need(
        isinstance(shape, list) and len(shape) <= wire.MAX_NDIM and all(_is_int(d) for d in shape),
        path,
        f"{where}: bad shape",
    )
    _need(
        _is_int(meta.get("version"))
        and _is_int(meta.get("updates"))
        and _is_int(meta.get("steps", 0)),
        path,
        f"{where}: bad version, update count or step count",
    )
    # Absent in a snapshot of a shard without set_optimizer: 0 and false.
    _need(
        _is_int(meta.get("optimizer_version", 0)) and type(meta.get("frozen", False)) is bool,
        path,
        f"{where}: bad optimizer_version or frozen",
    )
    tensors = meta.get("tensors")
    _need(
        isinstance(tensors, dict)
        and "value" in tensors
        and all(
            isinstance(t, dict) and isinstance(t.get("key"), str) and _is_int(t.get("crc32"))
            for t in tensors.values()
        ),
        path,
        f"{where}: bad 'tensors'",
    )


def _values_header(snap: Snapshot, f: Any) -> tuple[dict[str, Any], int, int]:
    path = snap.values_path
    size = os.fstat(f.fileno()).st_size
    _need(
        size == snap.manifest["values_bytes"],
        path,
        f"{size} bytes, the manifest says {snap.manifest['values_bytes']} (truncated or torn)",
    )
    head = f.read(8)
    _need(len(head) == 8, path, "shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    _need(0 < n <= min(size - 8, _MAX_HEADER), path, "bad safetensors header length")
    raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_Pairs)
    except (ValueError, UnicodeDecodeError):
        raise SnapshotError(f"{path.name}: corrupt safetensors header") from None
    _need(isinstance(header, _Pairs), path, "corrupt safetensors header")
    tensors: dict[str, Any] = {}
    meta: Any = {}
    for key, entry in header.pairs:
        if key == "__metadata__" and not (isinstance(entry, dict) and "data_offsets" in entry):
            meta = entry
            continue
        _need(key not in tensors, path, f"corrupt safetensors header (two tensors {key!r})")
        tensors[key] = entry
    _need(
        isinstance(meta, dict) and meta.get("paramshard_snapshot") == str(snap.number),
        path,
        "belongs to another snapshot",
    )
    return tensors, 8 + n, size


class _Pairs(dict):
    """A JSON object that also keeps its ``(key, value)`` pairs in order, repeated keys
    included: format-1 snapshots stored a value under its variable's name, so a variable named
    ``__metadata__`` wrote that key twice (the metadata, then its tensor), and both are
    needed to read the file."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def _planned(
    snap: Snapshot, header: Mapping[str, Any], start: int, size: int
) -> Iterator[tuple[str, str, np.dtype, tuple[int, ...], int, int]]:
    """(variable, slot, dtype, shape, file offset, crc) of every array, checked against the
    safetensors header's tensors (key -> entry)."""
    path = snap.values_path
    for name, meta in snap.manifest["variables"].items():
        dtype = np.dtype(meta["dtype"])
        for slot, t in meta["tensors"].items():
            entry = header.get(t["key"])
            _need(isinstance(entry, dict), path, f"no tensor {t['key']!r}")
            shape = entry.get("shape")
            offsets = entry.get("data_offsets")
            _need(
                entry.get("dtype") == _ST_DTYPES[dtype.kind + str(dtype.itemsize)]
                or slot != "value",
                path,
                f"{t['key']!r}: dtype differs from the manifest",
            )
            _need(
                isinstance(shape, list)
                and all(_is_int(d) for d in shape)
                and (slot != "value" or shape == meta["shape"]),
                path,
                f"{t['key']!r}: shape differs from the manifest",
            )
            st_dtype = {v: k for k, v in _ST_DTYPES.items()}.get(entry.get("dtype"))
            _need(st_dtype is not None, path, f"{t['key']!r}: unknown dtype")
            slot_dtype = _little_endian(st_dtype)
            nbytes = math.prod(shape) * slot_dtype.itemsize
            _need_extent(offsets, nbytes, start, size, path, repr(t["key"]))
            yield name, slot, slot_dtype, tuple(shape), start + offsets[0], t["crc32"]


def read_arrays(
    snap: Snapshot, *, mmap: bool = False, progress: Callable[[int], Any] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """Every variable's arrays (``{"value": ..., slot: ...}``), each checked against its
    CRC-32. ``mmap=False`` reads them into fresh writable memory; ``mmap=True`` maps them
    read-only (for resharding: the kernel pages them in as they are used). ``progress`` is
    called with each array's size once it is read and checked. Blocks. Raises
    :class:`SnapshotError`."""
    path = snap.values_path
    out: dict[str, dict[str, np.ndarray]] = {}
    try:
        with (
            open(path, "rb", buffering=0) as f,
            ThreadPoolExecutor(1, thread_name_prefix="paramshard-crc") as pool,
        ):
            header, start, size = _values_header(snap, f)
            for name, slot, dtype, shape, offset, crc in _planned(snap, header, start, size):
                nbytes = math.prod(shape) * dtype.itemsize
                if mmap and nbytes:
                    array = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
                    actual = _crc(array)
                else:
                    array = np.empty(shape, dtype=dtype)
                    actual = _read_checked(f, offset, array, path, pool)
                _need(actual == crc, path, f"{name!r} ({slot}): CRC mismatch (corrupt)")
                out.setdefault(name, {})[slot] = array
                if progress is not None:
                    progress(nbytes)
    except OSError as exc:
        raise SnapshotError(f"{path.name}: cannot read it ({exc})") from None
    return out


def _read_checked(
    f: Any, offset: int, array: np.ndarray, path: Path, pool: ThreadPoolExecutor
) -> int:
    """Read ``array``'s bytes from ``offset``; return their CRC-32, computed block by block in
    ``pool`` while the next block is read."""
    view = memoryview(array.reshape(-1).view(np.uint8))
    f.seek(offset)
    pos, crc, pending = 0, 0, None
    while pos < len(view):
        n = f.readinto(view[pos : pos + _READ_BLOCK])
        _need(bool(n), path, "ends early (truncated)")
        if pending is not None:
            crc = pending.result()
        pending = pool.submit(zlib.crc32, view[pos : pos + n], crc)
        pos += n
    return pending.result() if pending is not None else 0


def to_variables(snap: Snapshot, arrays: Mapping[str, Mapping[str, np.ndarray]]) -> list[Variable]:
    """The store's variables from a snapshot's manifest and arrays (optimizer specs and slots
    checked). Raises :class:`SnapshotError`."""
    path = snap.manifest_path
    out = []
    for name, meta in snap.manifest["variables"].items():
        try:
            opt = from_wire(meta["optimizer"])
        except (ValueError, TypeError, KeyError) as exc:
            raise SnapshotError(f"{path.name}: {name!r}: bad optimizer ({exc})") from None
        value = arrays[name]["value"]
        state = {k: a for k, a in arrays[name].items() if k not in _NOT_SLOTS}
        expected = optim.init_state(opt, np.zeros((1,), value.dtype))
        _need(
            set(state) == set(expected),
            path,
            f"{name!r}: optimizer slots {sorted(state)}, expected {sorted(expected)}",
        )
        for slot, a in state.items():
            want = value.shape if expected[slot].shape == (1,) else expected[slot].shape
            _need(
                a.shape == want and a.dtype == expected[slot].dtype,
                path,
                f"{name!r}: slot {slot!r} has shape {a.shape} dtype {a.dtype}",
            )
        created = meta.get("created_at")
        last = meta.get("last_update")
        writer = meta.get("last_writer")
        var = Variable(
            name=name,
            value=value,
            optimizer=opt,
            state=dict(state),
            kind=meta["kind"],
            version=meta["version"],
            updates=meta["updates"],
            # a snapshot written before the step count was kept: its optimizers (SGD
            # without momentum, Adagrad without lr_decay, Add) do not read it
            steps=meta.get("steps", 0),
            created_at=float(created) if isinstance(created, (int, float)) else time.time(),
            last_update=float(last) if isinstance(last, (int, float)) else None,
            last_writer=writer if isinstance(writer, str) else None,
            optimizer_version=meta.get("optimizer_version", 0),
            frozen=meta.get("frozen", False),
        )
        try:
            restored_mode(var, meta, arrays[name])
        except (ValueError, KeyError) as exc:
            raise SnapshotError(f"{path.name}: {name!r}: {exc}") from None
        out.append(var)
    return out
