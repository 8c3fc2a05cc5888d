"""Several worker processes at once: 4 of them push (and step) against 1 shard and against 2
shards, next to the same 4 against the raw-socket server; aggregate MB/s.

The model is two float32 variables of half the size each (for 10^6 elements: 2 x 2 MB),
named so that a 2-shard fleet places one on each shard; a 1-shard fleet holds both. All four
workers (:mod:`bench.loadgen`, one process each, one ``PSClient`` each) share the model, as
Downpour workers do. Two operations, each run for ``ctx.seconds`` by all four at once from a
common start time:

* **push**: every variable's gradient (4 MB in all) in one ``ps.push``, which sends one
  request per shard, concurrently, and returns once they are applied;
* **step**: that push, then a pull of the model (4 MB each way). A pull-only loop would
  measure the SDK's version cache, not the transfer: a pull of an unchanged variable moves
  no value.

Aggregate MB/s = all bytes the four moved / (end of the last operation - the common start).
Latency percentiles are over every operation of every worker. Targets and operations take
turns, ``ctx.rounds`` times over, and the figures add the rounds up. The CPU the servers and
the workers burnt from the common start until the last worker answered is read from
``/proc``, with the whole machine's, and reported as cores busy (CPU-seconds per wall
second): on a 2-core machine it says what held the aggregate back.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import processes
from .context import Context
from .cpu import CpuMeter, MachineMeter
from .timing import summarize
from .transfer import RAW

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "WORKERS", "run"]

WORKERS = 4
DESCRIPTION = (
    f"{WORKERS} worker processes at once, aggregate; a 2-variable model (one per shard "
    "with 2 shards); step = push then pull"
)
DEFAULT_SIZES = (1_000_000,)
_START_DELAY = 0.5  # s between sending a command and the common start: room for the warm-up op


def _names(n: int) -> list[str]:
    """Two variable names that a 2-shard fleet places on shards 0 and 1."""
    from client_sdk.placement import shard_for

    by_shard: dict[int, str] = {}
    k = 0
    while len(by_shard) < 2:
        name = f"bench/workers/f32-{n}/part{k}"
        by_shard.setdefault(shard_for(name, 2), name)
        k += 1
    return [by_shard[0], by_shard[1]]


class _Workers:
    """The worker processes; blocking; not thread-safe."""

    def __init__(self, logdir: Path, targets: dict[str, str], names: list[str], size: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.lines: list[processes.LineReader] = []
        try:
            for w in range(WORKERS):
                log = logdir / f"worker{w}.log"
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.loadgen",
                    "--names",
                    ",".join(names),
                    "--size",
                    str(size),
                    "--worker-id",
                    f"bench-worker-{w}",
                ]
                cmd += [f"--target={label}={spec}" for label, spec in targets.items()]
                proc = processes.spawn(cmd, log, pipes=True)
                self.procs.append(proc)
                self.lines.append(processes.LineReader(proc, log, f"worker {w}"))
            for lines in self.lines:
                lines.readline(120)  # {"ready": true}
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(
        self, target: str, op: str, seconds: float, meters: list[CpuMeter | MachineMeter]
    ) -> tuple[float, list[dict]]:
        """All workers do ``op`` against ``target`` for ``seconds`` from a common start;
        returns the start time and each worker's answer. ``meters`` run from the start until
        the last answer is in."""
        start = time.monotonic() + _START_DELAY
        line = json.dumps({"target": target, "op": op, "start": start, "seconds": seconds})
        for proc in self.procs:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
        time.sleep(max(0.0, start - time.monotonic()))
        with contextlib.ExitStack() as stack:
            for meter in meters:
                stack.enter_context(meter)
            answers = [json.loads(lines.readline(seconds + 300)) for lines in self.lines]
        return start, answers

    def close(self) -> None:
        for proc in self.procs:
            processes.stop(proc, grace=10.0)


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient
    from client_sdk.optimizers import Add

    raw = ctx.raw()
    fleets = {f"paramshard {k} shard{'s' if k > 1 else ''}": ctx.fleet(k) for k in (1, 2)}
    targets = {
        RAW: f"raw:{raw.host}:{raw.port}",
        **{label: "sdk:" + ",".join(f.urls) for label, f in fleets.items()},
    }
    server_pids = {RAW: [raw.pid], **{label: f.pids for label, f in fleets.items()}}
    rows: list[dict] = []
    for n in ctx.sizes_for(DEFAULT_SIZES):
        per_var = max(1, n // 2)
        names = _names(n)
        value = np.zeros(per_var, dtype=np.float32)
        for fleet in fleets.values():
            with PSClient(fleet.urls, worker_id="bench-workers-init") as ps:
                ps.init({name: value for name in names}, optimizer=Add())
        workers = _Workers(ctx.logdir, targets, names, per_var)
        try:
            acc = {
                (op, t): {
                    "samples": [],
                    "bytes": 0,
                    "wall": 0.0,
                    "server_cpu": 0.0,
                    "worker_cpu": 0.0,
                    "machine_cpu": 0.0,
                    "cpu_wall": 0.0,
                }
                for op in ("push", "step")
                for t in targets
            }
            for _ in range(ctx.rounds):
                for op in ("push", "step"):
                    for target in targets:
                        servers, clients = CpuMeter(server_pids[target]), CpuMeter(workers.pids)
                        machine = MachineMeter()
                        start, answers = workers.run(
                            target, op, ctx.seconds, [servers, clients, machine]
                        )
                        a = acc[op, target]
                        a["cpu_wall"] += time.monotonic() - start
                        a["wall"] += max(x["end"] for x in answers) - start
                        for x in answers:
                            a["samples"] += x["samples"]
                            a["bytes"] += x["bytes"]
                        a["server_cpu"] += servers.seconds or 0.0
                        a["worker_cpu"] += clients.seconds or 0.0
                        a["machine_cpu"] += machine.seconds or 0.0
        finally:
            workers.close()
        for (op, target), a in acc.items():
            if not a["samples"]:
                raise RuntimeError(f"workers: no {op} against {target} finished in time")
            bytes_per_op = 4 * per_var * 2 * (2 if op == "step" else 1)
            row = {
                "case": "workers",
                "op": op,
                "size": 2 * per_var,
                "workers": WORKERS,
                "system": target,
                "reference": target == RAW,
                **summarize(a["samples"], bytes_per_op),
            }
            row["mb_per_s"] = a["bytes"] / 1e6 / a["wall"]
            row["ops_per_s"] = len(a["samples"]) / a["wall"]
            row["wall_s"] = a["wall"]
            row["servers_cores_busy"] = a["server_cpu"] / a["cpu_wall"]
            row["workers_cores_busy"] = a["worker_cpu"] / a["cpu_wall"]
            row["machine_cores_busy"] = a["machine_cpu"] / a["cpu_wall"]
            rows.append(row)
    rows.sort(key=lambda r: (r["op"] != "push", r["size"], not r["reference"]))
    return rows


def busy_table(rows: list[dict]) -> str:
    """Cores busy in the servers and in the workers while each workers phase ran."""
    mine = [r for r in rows if r["case"] == "workers"]
    if not mine:
        return ""
    out = [
        "",
        f"workers: cores busy during each phase (CPU-s per wall second; this machine has "
        f"{os.cpu_count()}; 'machine' counts every process, other people's too), and CPU "
        f"ms per MB moved",
        f"{'op':<6}{'system':<24}{'servers':>9}{'workers':>9}{'machine':>9}"
        f"{'servers ms/MB':>15}{'workers ms/MB':>15}",
    ]
    for r in mine:
        s, w, mb = r["servers_cores_busy"], r["workers_cores_busy"], r["mb_per_s"]
        out.append(
            f"{r['op']:<6}{r['system']:<24}{s:>9.2f}{w:>9.2f}"
            f"{r['machine_cores_busy']:>9.2f}{1e3 * s / mb:>15.2f}{1e3 * w / mb:>15.2f}"
        )
    return "\n".join(out)
