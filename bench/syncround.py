"""A sync round against an async step: 4 worker processes train one model on 1 shard, in
sync mode (``Sync(replicas=4)``, :class:`client_sdk.training.SyncLoop`) and asynchronously
(Downpour: pull, then push), and the time a round takes is set beside the time a step takes.

The model is :data:`COUNT` float32 variables of ``size`` elements each (the default: 10 x
10^5, 4 MB), with SGD; the gradients are zeros, so the values never change and what is timed is
the system: every worker pulls the model and pushes a gradient for all of it each step. In
sync mode a step is :meth:`SyncLoop.params <client_sdk.training.SyncLoop.params>` (wait until
the last round closed, pull) and :meth:`~client_sdk.training.SyncLoop.step` (push into the
round); the four gradients of a round are summed on arrival and their mean applied once when the
fourth arrives. Async, a step is a pull and a push, each gradient applied on arrival.

Both run with four worker processes (:func:`worker_main`, one ``PSClient`` each): a few
untimed steps first, then :data:`STEPS` timed ones from a common start. A step's time is the
wall time of a worker's timed steps divided by their count, the median over the workers (the
rounds keep the four together, so their walls agree); the reference is the async step.
``ops/s`` in the table is steps (rounds) per second per worker.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import processes
from .context import Context
from .timing import summarize

__all__ = ["ASYNC", "COUNT", "DEFAULT_SIZES", "DESCRIPTION", "SYNC", "WORKERS", "run"]

WORKERS = 4
COUNT = 10
#: Timed steps per worker and mode (untimed ones first: :data:`WARMUP`).
STEPS = 40
WARMUP = 5
DESCRIPTION = (
    f"{WORKERS} worker processes, {COUNT} float32 variables on 1 shard: a sync round "
    f"(replicas={WORKERS}) against an async step (pull + push); ops/s is steps/s per worker"
)
DEFAULT_SIZES = (100_000,)
_START_DELAY = 0.3  # s between telling the workers when to start and the start
SYNC = f"sync round, {WORKERS} workers"
ASYNC = f"async step, {WORKERS} workers"


def _names(mode: str, size: int) -> list[str]:
    return [f"bench/syncround/{mode}/f32-{size}/v{i:02d}" for i in range(COUNT)]


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient
    from client_sdk.modes import Sync
    from client_sdk.optimizers import SGD

    fleet = ctx.fleet(1)
    steps = max(10, STEPS * ctx.reps // 30)
    rows: list[dict] = []
    for size in ctx.sizes_for(DEFAULT_SIZES):
        value = np.zeros(size, dtype=np.float32)
        measured: dict[str, list[dict]] = {}
        for mode, system in (("async", ASYNC), ("sync", SYNC)):
            names = _names(mode, size)
            with PSClient(fleet.urls, worker_id=f"bench-syncround-init-{mode}") as ps:
                ps.init(
                    {name: value for name in names},
                    optimizer=SGD(lr=0.01),
                    sync=Sync(replicas=WORKERS, timeout=60.0) if mode == "sync" else None,
                )
            measured[system] = _run_workers(ctx.logdir, fleet.urls, mode, names, size, steps)
        for system, answers in measured.items():
            per_step = [a["wall"] / a["steps"] for a in answers]
            samples = [s for a in answers for s in a["samples"]]
            row = {
                "case": "syncround",
                "op": "step",
                "size": size,
                "variables": COUNT,
                "workers": WORKERS,
                "label": f"{COUNT}x{size:,}",
                "system": system,
                "reference": system == ASYNC,
                **summarize(samples, 2 * COUNT * size * 4),
            }
            # the step's time: wall per step, the median over the workers
            row["median_s"] = float(np.median(per_step))
            row["p50_ms"] = row["median_s"] * 1e3
            row["ops_per_s"] = 1.0 / row["median_s"]
            row["mb_per_s"] = row["bytes"] / 1e6 / row["median_s"]
            rows.append(row)
    rows.sort(key=lambda r: (r["size"], not r["reference"]))
    return rows


def _run_workers(
    logdir: Path, urls: list[str], mode: str, names: list[str], size: int, steps: int
) -> list[dict]:
    """Run the four workers in ``mode`` until each did its steps; their answers."""
    procs = []
    try:
        for w in range(WORKERS):
            log = logdir / f"syncround-{mode}-{w}.log"
            cmd = [
                sys.executable,
                "-m",
                "bench.syncround",
                "--shards",
                ",".join(urls),
                "--names",
                ",".join(names),
                "--size",
                str(size),
                "--mode",
                mode,
                "--steps",
                str(steps),
                "--worker-id",
                f"bench-syncround-{mode}-{w}",
            ]
            proc = processes.spawn(cmd, log, pipes=True)
            procs.append((proc, processes.LineReader(proc, log, f"{mode} worker {w}")))
        for _, lines in procs:
            lines.readline(600)  # {"ready": true}: warmed up
        start = time.monotonic() + _START_DELAY
        for proc, _ in procs:
            proc.stdin.write(f"{start}\n".encode())
            proc.stdin.flush()
        return [json.loads(lines.readline(600)) for _, lines in procs]
    finally:
        for proc, _ in procs:
            processes.stop(proc, grace=10.0)


def worker_main(argv: list[str] | None = None) -> int:
    """One worker: :data:`WARMUP` untimed steps, then ``{"ready": true}``; then it reads the
    common start time (``time.monotonic()``, one clock for every process on the machine) from
    stdin, waits for it, does ``--steps`` timed steps, prints ``{"samples": [seconds per step],
    "wall": seconds, "steps": n}`` and exits."""
    from client_sdk import PSClient
    from client_sdk.training import SyncLoop

    p = argparse.ArgumentParser(prog="python -m bench.syncround")
    p.add_argument("--shards", required=True)
    p.add_argument("--names", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--mode", choices=("sync", "async"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--worker-id", required=True)
    args = p.parse_args(argv)
    names = args.names.split(",")
    grads = {name: np.zeros(args.size, dtype=np.float32) for name in names}
    with PSClient(args.shards.split(","), worker_id=args.worker_id) as ps:
        if args.mode == "sync":
            loop = SyncLoop(ps, names)

            def step() -> None:
                loop.params()
                loop.step(grads)

        else:

            def step() -> None:
                ps.pull(names)
                ps.push(grads)

        for _ in range(WARMUP):
            step()
        print(json.dumps({"ready": True}), flush=True)
        start_at = float(sys.stdin.readline())  # time.monotonic(): the same in every process
        time.sleep(max(0.0, start_at - time.monotonic()))
        samples = []
        start = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t0)
        wall = time.perf_counter() - start
    print(json.dumps({"samples": samples, "wall": wall, "steps": args.steps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
