"""Writes through a replica group: a primary that answers once its backup has the write,
beside a shard without replicas, in the same run (server/replication).

Two set-ups on loopback: one shard alone (the reference), and a static group of two
replicas of one shard index (``--replica-group``: a primary forwarding every write to one
backup, which applies it before the primary answers). In each repetition, turn by turn (the
order rotating), the SDK does on each:

* ``push`` of a float32 gradient of ``size`` elements (the default: 10^6, 4 MB) with the
  ``Add`` optimizer: the transfer, the primary's apply, the forward to the backup and the
  backup's apply;
* ``increment`` of a counter: the smallest write, where the backup's round trip is most of it.

Rows: ``op`` ``push`` (MB/s counted in the gradient's bytes) and ``increment``; ``system``
``1 shard`` (the reference) or ``primary + 1 backup``. The goal (:mod:`bench.goals`): push with
one backup >= 0.6 x without. Each row also has the CPU milliseconds per operation of the worker
(this process), the shard (the primary) and the backup (``cpu_ms``; :mod:`bench.cpu`, read
outside the timed region), which :func:`notes` prints with the machine's load: on a shared
machine they move less with the load than the times do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from server import launcher

from . import processes
from .context import Context
from .cpu import CpuMeter
from .timing import Stopwatch, reps_for, summarize
from .transfer import rotated

__all__ = ["ALONE", "DEFAULT_SIZES", "DESCRIPTION", "REPLICATED", "notes", "run"]

ALONE, REPLICATED = "1 shard", "primary + 1 backup"
DESCRIPTION = (
    "writes to 1 shard vs to a primary that answers once its 1 backup applied the write "
    "(--replica-group); push+apply of float32 (Add) and increment, interleaved"
)
DEFAULT_SIZES = (1_000_000,)
INCREMENTS_PER_REP = 20


class _Group(launcher.Fleet):
    """Two replicas of shard 0/1 on ports picked first (their URLs must be known to both)."""

    def __init__(self, ports: list[int], logdir: Path) -> None:
        self.group = [f"http://127.0.0.1:{p}" for p in ports]
        super().__init__(
            len(ports),
            ports=ports,
            logdir=logdir,
            extra_args=("--log-level", "warning", "--replica-group", "|".join(self.group)),
        )

    def serve_args(self, i: int) -> list[str]:
        args = super().serve_args(i)
        args[args.index("--shard-index") + 1] = "0"
        args[args.index("--num-shards") + 1] = "1"
        return [*args, "--advertise-url", self.group[i]]


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def _group(ctx: Context) -> Iterator[processes.Fleet]:
    """A primary and its backup; a port taken between its pick and its use: picked again."""
    for attempt in range(4):
        d = ctx.logdir / f"replicas{attempt}"
        d.mkdir(exist_ok=True)
        group = _Group(_ports(2), d)
        try:
            group.start_all()
        except launcher.LaunchError:
            group.close()
            continue
        try:
            yield processes.Fleet(group.urls, group.pids)
        finally:
            group.close()
        return
    raise RuntimeError("the replica group did not start (ports taken 4 times)")


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient
    from client_sdk.optimizers import Add

    rows: list[dict] = []
    with _group(ctx) as group:
        urls = {ALONE: ctx.shard_urls(1)[0], REPLICATED: group.urls[0]}
        #: Per system, the pids of its shard and its backup (none for the shard alone).
        pids = {ALONE: ctx.fleet(1).pids[:1], REPLICATED: group.pids[:2]}
        clients = {
            system: PSClient([url], worker_id=f"bench-replication-{i}")
            for i, (system, url) in enumerate(urls.items())
        }
        try:
            for size in ctx.sizes_for(DEFAULT_SIZES):
                name = f"bench/replication/f32-{size}"
                grad = np.zeros(size, np.float32)
                for ps in clients.values():
                    ps.init({name: grad}, Add())
                reps = reps_for(grad.nbytes, ctx.reps, ctx.min_reps)
                pushes = {s: Stopwatch() for s in clients}
                increments = {s: Stopwatch() for s in clients}
                cpu = {(op, s): _Cpu(pids[s]) for op in ("push", "increment") for s in clients}
                for rep in range(ctx.warmup + reps):
                    for system in rotated(list(clients), rep):
                        ps = clients[system]
                        push_watch, increment_watch = pushes[system], increments[system]
                        push_cpu, increment_cpu = cpu["push", system], cpu["increment", system]
                        if rep < ctx.warmup:  # timed into watches thrown away
                            push_watch, increment_watch = Stopwatch(), Stopwatch()
                            push_cpu = increment_cpu = _Cpu(pids[system])
                        with push_cpu, push_watch:
                            ps.push({name: grad})
                        with increment_cpu:
                            for _ in range(INCREMENTS_PER_REP):
                                with increment_watch:
                                    ps.increment(name + "/counter", 1)
                # One group per op (the table prints the op once over its systems), the
                # reference first.
                for op, watches, per_rep in (
                    ("push", pushes, 1),
                    ("increment", increments, INCREMENTS_PER_REP),
                ):
                    for system in clients:
                        rows.append(
                            {
                                "case": "replication",
                                "op": op,
                                "size": size,
                                "system": system,
                                "reference": system == ALONE,
                                **summarize(
                                    watches[system].samples,
                                    grad.nbytes if op == "push" else None,
                                ),
                                "cpu_ms": cpu[op, system].per_op(reps * per_rep),
                            }
                        )
        finally:
            for ps in clients.values():
                ps.close()
    return rows


class _Cpu:
    """CPU seconds spent inside ``with`` blocks by this process (the worker), the shard and
    its backup (``pids``: the shard's, then the backup's if any)."""

    def __init__(self, pids: list[int]) -> None:
        self.worker = 0.0
        self.meters = [CpuMeter([pid]) for pid in pids]
        self._before = 0.0

    def __enter__(self) -> _Cpu:
        for meter in self.meters:
            meter.__enter__()
        self._before = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker += time.process_time() - self._before
        for meter in reversed(self.meters):
            meter.__exit__()

    def per_op(self, ops: int) -> dict[str, float | None]:
        """Milliseconds per operation: ``worker``, ``shard``, ``backup`` (``None`` where not
        measured: no backup, or no /proc)."""
        seconds = [m.seconds for m in self.meters] + [None] * (2 - len(self.meters))
        return {
            "worker": 1e3 * self.worker / ops,
            "shard": None if seconds[0] is None else 1e3 * seconds[0] / ops,
            "backup": None if seconds[1] is None else 1e3 * seconds[1] / ops,
        }


def notes(rows: list[dict]) -> str:
    """CPU per operation of each process, with the machine's load average when printed."""
    mine = [r for r in rows if r["case"] == "replication" and r.get("cpu_ms")]
    if not mine:
        return ""
    out = [
        "",
        "replication: CPU ms per operation (user + system, all threads; /proc), load average "
        + " ".join(f"{x:.1f}" for x in os.getloadavg()),
        f"{'op':<11}{'system':<22}{'worker':>8}{'shard':>8}{'backup':>8}",
    ]
    op = None
    for r in mine:
        cpu = r["cpu_ms"]
        cells = "".join(f"{'-' if v is None else format(v, '.2f'):>8}" for v in cpu.values())
        out.append(f"{r['op'] if r['op'] != op else '':<11}{r['system']:<22}{cells}")
        op = r["op"]
    return "\n".join(out)
