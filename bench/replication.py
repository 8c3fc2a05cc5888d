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
one backup >= 0.6 x without.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from server import launcher

from . import processes
from .context import Context
from .timing import Stopwatch, reps_for, summarize
from .transfer import rotated

__all__ = ["ALONE", "DEFAULT_SIZES", "DESCRIPTION", "REPLICATED", "run"]

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
                for rep in range(ctx.warmup + reps):
                    for system in rotated(list(clients), rep):
                        ps = clients[system]
                        push_watch, increment_watch = pushes[system], increments[system]
                        if rep < ctx.warmup:  # timed into watches thrown away
                            push_watch, increment_watch = Stopwatch(), Stopwatch()
                        with push_watch:
                            ps.push({name: grad})
                        for _ in range(INCREMENTS_PER_REP):
                            with increment_watch:
                                ps.increment(name + "/counter", 1)
                for system in clients:
                    common = {"size": size, "system": system, "reference": system == ALONE}
                    rows.append(
                        {
                            "case": "replication",
                            "op": "push",
                            **common,
                            **summarize(pushes[system].samples, grad.nbytes),
                        }
                    )
                    rows.append(
                        {
                            "case": "replication",
                            "op": "increment",
                            **common,
                            **summarize(increments[system].samples),
                        }
                    )
        finally:
            for ps in clients.values():
                ps.close()
    return rows
