"""One call over many shards: the SDK pulling and pushing :data:`COUNT` float32 variables of
4 KB spread evenly over 1, 4 and 16 shards, each call one request per shard, sent at once.

The fleets are the run's (:meth:`Context.fleet <bench.context.Context.fleet>`: each shard a
process of its own), one ``PSClient`` per fleet; ``--quick`` uses 1 and 2 shards. The
variables' names are chosen so that each of the fleet's ``k`` shards holds ``COUNT / k`` of
them. Each repetition pushes zeros to all of them in one ``ps.push``
(timed as *push*; returns once every shard applied its part), then pulls them all in one
``ps.pull`` (timed as *pull*; all the bytes come back), the fleets taking turns in a
rotating order. *Reference*: the 1-shard fleet, one request per call. The row *in turn*
is the biggest fleet again, with the same variables asked of one shard after another (one
call per shard, each waiting for the last): the sum of the shards' times that a call sent
to all of them at once does not pay.

The SDK writes every shard's request before it reads any reply, and reads them as they come,
on one thread; so a call's time is its own per-shard work (building, writing and reading
``k`` requests) plus the slowest shard's answer, not the sum of the shards' answers. On a
machine with fewer cores than shards the shards' work still shares the cores: the ratios
here are for 2 cores (bench/README.md, GOALS, says what they bound).

So each row also carries the CPU the call costs, read from /proc over all its repetitions:
``client_cpu_us`` (this process) and ``shards_cpu_us`` (the fleet's shard processes) per call,
and ``cpu_floor_us``, the least wall time that CPU allows on this machine: the client's part
alone (one thread), or everything spread over every core, whichever is longer. A call whose
mean time is near its floor waits for nothing but the cores; the ``cpu floor`` goal judges the
biggest fleet's call against it, which tells a machine too small for the fleet from an SDK that
waits on shards one by one.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .context import Context
from .cpu import CpuMeter
from .timing import Stopwatch, summarize
from .transfer import rotated

__all__ = [
    "COUNT",
    "DEFAULT_SIZES",
    "DESCRIPTION",
    "SHARDS",
    "cpu_floor",
    "label",
    "names_for",
    "run",
]

COUNT = 16
SHARDS = (1, 4, 16)
SHARDS_QUICK = (1, 2)
#: Repetitions: this many times ``--reps``.
REPS_FACTOR = 3
DEFAULT_SIZES = (1_000,)
DESCRIPTION = (
    f"one call over {COUNT} float32 variables spread over "
    f"{', '.join(map(str, SHARDS))} shards; in turn: one call per shard, one after another; "
    "reference: 1 shard"
)


def label(shards: int, in_turn: bool = False) -> str:
    """The system label of a fleet of ``shards`` (``in_turn``: called shard by shard)."""
    return f"{shards} shard{'s' if shards > 1 else ''}" + (", in turn" if in_turn else "")


def names_for(shards: int, n: int) -> list[list[str]]:
    """For a fleet of ``shards``: per shard, ``COUNT / shards`` variable names it owns."""
    from client_sdk.placement import shard_for

    each = COUNT // shards
    by_shard: list[list[str]] = [[] for _ in range(shards)]
    k = 0
    while any(len(names) < each for names in by_shard):
        name = f"bench/fanout/f32-{n}/{shards}/v{k}"
        owner = by_shard[shard_for(name, shards)]
        if len(owner) < each:
            owner.append(name)
        k += 1
    return by_shard


def cpu_floor(client_s: float, shards_s: float, cores: int) -> float:
    """The least wall time a call costing ``client_s`` CPU seconds on the SDK's thread and
    ``shards_s`` on the shards can take on ``cores`` cores: the client's thread cannot be
    split, and nothing runs faster than all the CPU spread over every core."""
    return max(client_s, (client_s + shards_s) / max(cores, 1))


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient

    fleets = SHARDS_QUICK if ctx.quick else SHARDS
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        clients: dict[int, Any] = {}
        pids: dict[int, list[int]] = {}
        for k in fleets:
            fleet = ctx.fleet(k)
            pids[k] = list(fleet.pids)
            clients[k] = stack.enter_context(PSClient(fleet.urls, worker_id=f"bench-fanout-{k}"))
        for n in ctx.sizes_for(DEFAULT_SIZES):
            rows += _one_size(ctx, n, clients, pids, fleets)
    rows.sort(key=lambda r: (r["op"] != "push", r["size"], r["shards"], r["in_turn"]))
    return rows


def _one_size(
    ctx: Context,
    n: int,
    clients: dict[int, Any],
    pids: dict[int, list[int]],
    fleets: tuple[int, ...],
) -> list[dict]:
    from client_sdk.optimizers import Add

    rows: list[dict] = []
    value = np.random.default_rng(n).random(n, dtype=np.float32)
    zeros = np.zeros(n, dtype=np.float32)
    placed = {k: names_for(k, n) for k in fleets}
    for k, ps in clients.items():
        ps.init({name: value for names in placed[k] for name in names}, optimizer=Add())
    systems = [(k, False) for k in fleets] + [(fleets[-1], True)]
    watches = {(op, s): Stopwatch() for op in ("push", "pull") for s in systems}
    # per (op, system): CPU of this process and of the fleet's shards over the timed calls;
    # read outside the stopwatch (a read of 16 /proc files takes a while)
    meters = {key: (CpuMeter([os.getpid()]), CpuMeter(pids[key[1][0]])) for key in watches}

    def timed(op: str, system: tuple[int, bool], call: Callable[[], Any]) -> Any:
        client, shards = meters[op, system]
        with client, shards, watches[op, system]:
            return call()

    def turn(system: tuple[int, bool]) -> None:
        k, in_turn = system
        ps = clients[k]
        groups = placed[k] if in_turn else [[m for ms in placed[k] for m in ms]]
        timed("push", system, lambda: [ps.push(dict.fromkeys(names, zeros)) for names in groups])
        pulled: dict[str, np.ndarray] = {}
        timed("pull", system, lambda: [pulled.update(ps.pull(names)) for names in groups])
        if len(pulled) != COUNT or any(v.shape != (n,) for v in pulled.values()):
            raise RuntimeError(f"pulled {len(pulled)} variables; expected {COUNT}")

    turns: list[Callable[[], None]] = [functools.partial(turn, s) for s in systems]
    nbytes = COUNT * n * 4
    # REPS_FACTOR x --reps (other transfers this small get ten times --reps): a turn of the
    # biggest fleet called in turn is many round trips
    for i in range(ctx.warmup + ctx.reps * REPS_FACTOR):
        if i == ctx.warmup:
            for w in watches.values():
                w.samples.clear()
            for client, shards in meters.values():
                client.seconds = shards.seconds = 0.0
        for t in rotated(turns, i):
            t()
    for k, ps in clients.items():
        names = [name for names in placed[k] for name in names]
        if not all(np.array_equal(v, value) for v in ps.pull(names).values()):
            raise RuntimeError("values changed by pushing zeros through Add")
    cores = os.cpu_count() or 1
    for (op, (k, in_turn)), w in watches.items():
        client, shards = meters[op, (k, in_turn)]
        cpu: dict[str, float] = {}
        if client.seconds is not None and shards.seconds is not None and w.samples:
            calls = len(w.samples)
            cpu = {
                "mean_s": sum(w.samples) / calls,
                "client_cpu_us": client.seconds / calls * 1e6,
                "shards_cpu_us": shards.seconds / calls * 1e6,
                "cpu_floor_us": cpu_floor(client.seconds, shards.seconds, cores) / calls * 1e6,
                "cores": cores,
            }
        rows.append(
            {
                "case": "fanout",
                "op": op,
                "size": n,
                "variables": COUNT,
                "label": f"{COUNT}x{n:,}",
                "shards": k,
                "in_turn": in_turn,
                "system": label(k, in_turn),
                "reference": k == 1,
                **summarize(w.samples, nbytes),
                **cpu,
            }
        )
    return rows
