"""Snapshot write and restore of a 1 GiB shard, next to a raw file holding the same bytes.

One shard with ``--data-dir`` (in a temporary directory) gets float32 variables summing to the
size (default 2^28 elements = 1 GiB, in up to 8 variables, SGD: no optimizer slots). Then:

``write``
    ``paramshard``: the shard's own time for one snapshot (capture, safetensors write, CRC-32 of
    every array, fsync, rename, fsync of the directory), as it reports it in
    ``/v1/cluster``'s ``last_snapshot``; ``checkpoint()``: ``ps.checkpoint()`` as a worker sees
    it (pause, snapshot, resume round trips on top); ``raw file`` (the reference): the same
    arrays written to a new file with ``write`` and fsynced (the previous one deleted).
``restore``
    ``paramshard``: the shard's own time to read and check the snapshot (every CRC-32) into
    fresh memory (``/v1/cluster``'s ``restored``); ``to /readyz``: from starting the shard
    process until ``/readyz`` answers 200 (Python and server start-up on top); ``raw file``
    (the reference): ``readinto`` fresh arrays from the raw file.

Before every restore the files are dropped from the page cache (``posix_fadvise``
``DONTNEED``, where the platform has it), so reads come from the disk like after a reboot.
Each repetition is seconds long, so there are few: ``--min-reps``, at most 3.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from . import processes
from .context import Context
from .timing import summarize

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "run"]

DESCRIPTION = (
    "snapshot write and restore of one shard holding float32 variables (default "
    "1 GiB) vs a raw file of the same bytes; page cache dropped before restores"
)
DEFAULT_SIZES = (1 << 28,)
SDK, CKPT, READY, RAW = "paramshard", "checkpoint()", "to /readyz", "raw file"
_PART = 128 << 20  # bytes per variable (and per init request)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _ready(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout}s")
        time.sleep(0.01)


def _uncache(paths: list[Path]) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _parts(n: int) -> list[int]:
    per = max(1, _PART // 4)
    return [min(per, n - start) for start in range(0, n, per)]


def _raw_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        os.fsync(f.fileno())


def _raw_read(path: Path, sizes: list[int]) -> list[np.ndarray]:
    out = []
    with open(path, "rb", buffering=0) as f:
        for size in sizes:
            a = np.empty(size, np.float32)
            view = memoryview(a).cast("B")
            pos = 0
            while pos < len(view):
                pos += f.readinto(view[pos:])
            out.append(a)
    return out


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient  # what is measured: imported when running
    from client_sdk.optimizers import SGD

    rows: list[dict] = []
    reps = max(1, min(3, ctx.min_reps))
    for n in ctx.sizes_for(DEFAULT_SIZES):
        sizes = _parts(n)
        nbytes = 4 * n
        samples: dict[tuple[str, str], list[float]] = {
            (op, sys): []
            for op, sys in (
                ("write", SDK),
                ("write", CKPT),
                ("write", RAW),
                ("restore", SDK),
                ("restore", READY),
                ("restore", RAW),
            )
        }
        with tempfile.TemporaryDirectory(prefix="paramshard-bench-snapshot-") as tmp:
            data = Path(tmp) / "data"
            args = (
                "--data-dir",
                str(data),
                "--snapshot-interval",
                "0",
                "--keep-snapshots",
                "1",
                "--log-level",
                "warning",
            )
            names = [f"bench/snapshot/{n}/part-{i}" for i in range(len(sizes))]
            with processes.shards(1, ctx.logdir, *args) as fleet:
                urls = fleet.urls
                with PSClient(urls, worker_id="bench-snapshot", timeout=600) as ps:
                    for name, size in zip(names, sizes):
                        ps.init({name: np.arange(size, dtype=np.float32)}, optimizer=SGD())
                    for i in range(ctx.warmup + reps):
                        t0 = time.perf_counter()
                        ps.checkpoint(timeout=570)
                        took = time.perf_counter() - t0
                        if i >= ctx.warmup:
                            samples["write", CKPT].append(took)
                            samples["write", SDK].append(
                                _get(urls[0] + "/v1/cluster")["last_snapshot"]["seconds"]
                            )
            arrays = [np.arange(size, dtype=np.float32) for size in sizes]
            raw = Path(tmp) / "raw-0.bin"
            for i in range(ctx.warmup + reps):
                new = Path(tmp) / f"raw-{i + 1}.bin"  # a new file each time, as snapshots are
                t0 = time.perf_counter()
                _raw_write(new, arrays)
                if i >= ctx.warmup:
                    samples["write", RAW].append(time.perf_counter() - t0)
                raw.unlink(missing_ok=True)
                raw = new
            del arrays
            for i in range(ctx.warmup + reps):
                _uncache([p for p in data.iterdir() if p.is_file()])
                t0 = time.perf_counter()
                with processes.shards(1, ctx.logdir, *args) as fleet:
                    _ready(fleet.urls[0])
                    to_ready = time.perf_counter() - t0
                    restored = _get(fleet.urls[0] + "/v1/cluster")["restored"]
                if restored is None or restored["variables"] != len(names):
                    raise RuntimeError(f"the shard did not restore the snapshot: {restored}")
                _uncache([raw])
                t0 = time.perf_counter()
                back = _raw_read(raw, sizes)
                raw_took = time.perf_counter() - t0
                del back
                if i >= ctx.warmup:
                    samples["restore", SDK].append(restored["seconds"])
                    samples["restore", READY].append(to_ready)
                    samples["restore", RAW].append(raw_took)
        for (op, system), seconds in samples.items():
            rows.append(
                {
                    "case": "snapshot",
                    "op": op,
                    "size": n,
                    "dtype": "float32",
                    "system": system,
                    "reference": system == RAW,
                    **summarize(seconds, nbytes),
                }
            )
    return rows
