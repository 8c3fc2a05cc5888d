"""A step's cost against what a shard holds: a push and a pull of the same 100 variables of
4 KB on shards that hold 10^2, 10^4 and 10^6 variables.

Three shards run side by side, each a fleet of its own (one process, one ``PSClient``). Each
holds the same :data:`HOT` float32 variables of ``size`` elements (default 10^3, 4 KB; the
``Add`` optimizer) and as many more one-element float32 variables (4 bytes each, the default
optimizer) as it takes to hold its count in all: what is measured is what the *number* of
variables costs (the name table, the dedup table, the collector walking live objects, caches),
not the bytes, which the transfer case covers. Each repetition pushes zeros to the 100 (timed
as *push*, returns once applied) and then pulls them (timed as *pull*; the push made every
cached version stale, so all 400 KB come back), the shards taking turns in a rotating order
as in :mod:`bench.transfer`. *Reference*: the shard holding only the 100.

The fill is a batched init through the SDK (it sends at most ``max_request_names`` variables
per request, 2,048 by default), timed and reported with each shard's resident memory after
it (:func:`notes`). ``--quick`` holds 10^2 and 10^3.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
from typing import Any

import numpy as np

from . import processes
from .context import Context
from .timing import Stopwatch, reps_for, summarize
from .transfer import rotated

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "HELD", "HOT", "label", "notes", "run"]

HOT = 100
#: Variables the shards hold in all (the 100 included); and with ``--quick``.
HELD = (10**2, 10**4, 10**6)
HELD_QUICK = (10**2, 10**3)
DEFAULT_SIZES = (1_000,)
DESCRIPTION = (
    f"push and pull of {HOT} float32 variables on shards holding {HELD[0]:,}, {HELD[1]:,} "
    f"and {HELD[2]:,} variables; reference: the shard holding {HOT}"
)
#: Filler variables one ``init`` call gets (the SDK splits it into requests).
_FILL_CALL = 16_384


def label(held: int) -> str:
    """The system label of the shard holding ``held`` variables."""
    return f"shard of {held:,} vars"


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _fill(urls: list[str], held: int) -> float:
    """Init ``held - HOT`` one-element variables; returns the seconds it took. Two clients
    take the chunks in turn, each in a thread of its own, so that one builds its requests
    while the shard applies the other's."""
    from client_sdk import PSClient

    one = np.zeros(1, dtype=np.float32)
    chunks = [
        range(start, min(held - HOT, start + _FILL_CALL))
        for start in range(0, held - HOT, _FILL_CALL)
    ]

    def fill(k: int) -> None:
        with PSClient(urls, worker_id=f"bench-shardsize-fill-{k}") as ps:
            for chunk in chunks[k::2]:
                ps.init({f"bench/shardsize/fill/{i:07d}": one for i in chunk})

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(fill, k) for k in range(2)]:
            done.result()
    return time.perf_counter() - t0


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient

    counts = HELD_QUICK if ctx.quick else HELD
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        clients, pids, fills = {}, {}, {}
        for held in counts:
            d = ctx.logdir / f"shardsize-{held}"
            d.mkdir(exist_ok=True)
            fleet = stack.enter_context(processes.shards(1, d, "--log-level", "warning"))
            ps = stack.enter_context(PSClient(fleet.urls, worker_id=f"bench-shardsize-{held}"))
            fills[held] = _fill(fleet.urls, held)
            clients[held], pids[held] = ps, fleet.pids[0]
        for n in ctx.sizes_for(DEFAULT_SIZES):
            rows += _one_size(ctx, n, clients, counts, fills, pids)
    rows.sort(key=lambda r: (r["op"] != "push", r["size"], r["held"]))
    return rows


def _one_size(
    ctx: Context,
    n: int,
    clients: dict[int, Any],
    counts: tuple[int, ...],
    fills: dict[int, float],
    pids: dict[int, int],
) -> list[dict]:
    import httpx2

    from client_sdk.optimizers import Add

    names = [f"bench/shardsize/f32-{n}/v{i:03d}" for i in range(HOT)]
    value = np.random.default_rng(n).random(n, dtype=np.float32)
    grads = {name: np.zeros(n, dtype=np.float32) for name in names}
    for ps in clients.values():
        ps.init({name: value for name in names}, optimizer=Add())
    watches = {(op, h): Stopwatch() for op in ("push", "pull") for h in counts}

    def turn(held: int) -> None:
        ps = clients[held]
        with watches["push", held]:
            ps.push(grads)
        with watches["pull", held]:
            pulled = ps.pull(names)
        if len(pulled) != HOT or any(v.shape != (n,) for v in pulled.values()):
            raise RuntimeError(f"pulled {len(pulled)} variables; expected {HOT} of ({n},)")

    turns = [functools.partial(turn, h) for h in counts]
    nbytes = HOT * n * 4
    for i in range(ctx.warmup + reps_for(nbytes, ctx.reps, ctx.min_reps)):
        if i == ctx.warmup:
            for w in watches.values():
                w.samples.clear()
        for t in rotated(turns, i):
            t()
    for held, ps in clients.items():
        if not all(np.array_equal(v, value) for v in ps.pull(names).values()):
            raise RuntimeError("values changed by pushing zeros through Add")
        counted = httpx2.get(f"{ps.shards[0]}/v1/cluster", timeout=60).json()["variables"]
        if counted != held:
            raise RuntimeError(f"the shard holds {counted} variables, not {held}")
    return [
        {
            "case": "shardsize",
            "op": op,
            "size": n,
            "variables": HOT,
            "label": f"{HOT}x{n:,}",
            "system": label(held),
            "reference": held == counts[0],
            "held": held,
            "fill_s": fills[held],
            "rss_mb": _rss_mb(pids[held]),
            **summarize(w.samples, nbytes),
        }
        for (op, held), w in watches.items()
    ]


def notes(rows: list[dict]) -> str:
    """How long each shard's fill took, and its resident memory after it."""
    mine = {r["held"]: r for r in rows if r["case"] == "shardsize"}
    if not mine:
        return ""
    out = [
        "",
        "shardsize: the fill (a batched init through the SDK) and each shard's resident memory",
        f"{'variables':>12}{'fill s':>9}{'variables/s':>13}{'RSS MB':>9}",
    ]
    for held, r in sorted(mine.items()):
        filled = held - HOT
        rate = f"{filled / r['fill_s']:>13,.0f}" if filled and r["fill_s"] > 0 else f"{'-':>13}"
        rss = "-" if r["rss_mb"] is None else f"{r['rss_mb']:.0f}"
        out.append(f"{held:>12,}{r['fill_s']:>9.1f}{rate}{rss:>9}")
    return "\n".join(out)
