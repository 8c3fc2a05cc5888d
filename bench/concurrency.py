"""Many workers on one shard: 1, 4, 16 and 64 of them at once, each doing 4 KB steps (a push
of a gradient, then a pull of the variable), and what an idle connection costs the shard.

The workers are an asyncio load generator in the bench's own process: one
``AsyncPSClient`` per worker (its own ``worker_id``, its own connection), all on one event
loop, uvloop when installed (the loop a shard runs on; the generator shares the two cores with
the shard, and asyncio's own loop would cost it ~10% more CPU per step), all pushing to and
pulling the same float32 variable of ``size`` elements (default 10^3, 4 KB; the ``Add``
optimizer), as Downpour workers share a model. The shard is the run's
1-shard fleet (a process of its own). Each phase runs ``ctx.seconds`` with N workers from a
common start (each first does one untimed step: connections open); the phases take turns,
``ctx.rounds`` times over, and the figures add the rounds up.

What the figures mean on a small machine: one worker is a round trip at a time (the shard and
the generator take turns on the cores); from a few workers on, the shard's event loop and the
generator's keep the cores busy, and the aggregate is what the shard serves per CPU-second
with the generator's share of the machine taken out. The case does not measure how many
workers one shard can serve on a big machine; it shows whether the shard's rate and its
fairness hold as connections and requests in flight grow from 1 to 64 (a cost per connection
or per waiting request, a queue served unfairly, would show here as a falling aggregate or a
long tail). The cores each side kept busy are in the rows (``servers_cores_busy``,
``workers_cores_busy``).

* **step** rows: aggregate steps/s over all workers, and percentiles of every step's time;
  ``errors`` counts the steps that raised (the step is not retried by the harness).
  *Reference*: 1 worker.
* **idle connections** (:func:`notes`): the shard's resident memory with
  :data:`IDLE_CONNECTIONS` keep-alive connections open, each after one request, minus
  without, per connection.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import numpy as np

from .context import Context
from .cpu import CpuMeter
from .timing import summarize

__all__ = [
    "DEFAULT_SIZES",
    "DESCRIPTION",
    "IDLE_CONNECTIONS",
    "WORKERS",
    "label",
    "notes",
    "run",
]

WORKERS = (1, 4, 16, 64)
WORKERS_QUICK = (1, 4)
#: Keep-alive connections held open to weigh one (``--quick``: fewer).
IDLE_CONNECTIONS = 512
IDLE_CONNECTIONS_QUICK = 32
DEFAULT_SIZES = (1_000,)
DESCRIPTION = (
    f"{', '.join(map(str, WORKERS))} workers at once on one shard, each pushing then pulling "
    "one shared float32 variable; ops/s is all workers' steps/s; reference: 1 worker"
)


def label(workers: int) -> str:
    """The system label of the phase with ``workers`` workers."""
    return f"{workers} worker{'s' if workers > 1 else ''}"


async def _phase(
    clients: list[Any], name: str, grad: np.ndarray, seconds: float
) -> tuple[list[float], int, float, float]:
    """Every client steps from a common start for ``seconds``; returns the steps' times, the
    errors, the wall time (start to the last step's end) and the process's CPU seconds."""
    from client_sdk import PSError

    await asyncio.gather(*(ps.push({name: grad}) for ps in clients))  # connections open
    await asyncio.gather(*(ps.pull([name]) for ps in clients))
    samples: list[float] = []
    errors = 0
    start = time.perf_counter()
    stop = start + seconds
    cpu0 = time.process_time()

    async def worker(ps: Any) -> None:
        nonlocal errors
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                await ps.push({name: grad})
                pulled = await ps.pull([name])
            except PSError:
                errors += 1
                continue
            if pulled[name].shape != grad.shape:
                raise RuntimeError(f"pulled {pulled[name].shape}, expected {grad.shape}")
            samples.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker(ps) for ps in clients))
    return samples, errors, time.perf_counter() - start, time.process_time() - cpu0


def _run(main: Any) -> str:
    """Run the coroutine ``main`` on uvloop when it is installed, else on asyncio's loop;
    returns the loop's name."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return "asyncio"
    uvloop.run(main)
    return "uvloop"


def _rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _idle_cost(url: str, pid: int, count: int) -> dict[str, Any]:
    """The shard's resident memory before and with ``count`` idle keep-alive connections,
    each opened and used for one request (``GET /healthz``)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    before = _rss_kb(pid)
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.create_connection((host, int(port)), timeout=10)
            socks.append(s)
            s.sendall(request)
            if not s.recv(65536).startswith(b"HTTP/1.1 200"):
                raise RuntimeError("idle connections: /healthz did not answer 200")
        after = _rss_kb(pid)
    finally:
        for s in socks:
            s.close()
    per = None if before is None or after is None else (after - before) / count
    return {"connections": count, "rss_before_kb": before, "rss_after_kb": after, "kb_each": per}


def run(ctx: Context) -> list[dict]:
    counts = WORKERS_QUICK if ctx.quick else WORKERS
    rows: list[dict] = []
    fleet = ctx.fleet(1)
    (url,), (pid,) = fleet.urls, fleet.pids
    idle = _idle_cost(url, pid, IDLE_CONNECTIONS_QUICK if ctx.quick else IDLE_CONNECTIONS)
    for n in ctx.sizes_for(DEFAULT_SIZES):
        rows += _one_size(ctx, n, url, pid, counts, idle)
    return rows


def _one_size(
    ctx: Context, n: int, url: str, pid: int, counts: tuple[int, ...], idle: dict[str, Any]
) -> list[dict]:
    from client_sdk import AsyncPSClient, PSClient
    from client_sdk.optimizers import Add

    rows: list[dict] = []
    name = f"bench/concurrency/f32-{n}"
    with PSClient([url], worker_id="bench-concurrency-init") as ps:
        ps.init({name: np.zeros(n, dtype=np.float32)}, optimizer=Add())
    grad = np.zeros(n, dtype=np.float32)
    acc = {k: {"samples": [], "errors": 0, "wall": 0.0, "cpu": 0.0, "shard": 0.0} for k in counts}

    async def measure() -> None:
        clients = [
            AsyncPSClient([url], worker_id=f"bench-concurrency-{w}") for w in range(max(counts))
        ]
        try:
            for _ in range(ctx.rounds):
                for k in counts:
                    meter = CpuMeter([pid])
                    with meter:
                        samples, errors, wall, cpu = await _phase(
                            clients[:k], name, grad, ctx.seconds
                        )
                    a = acc[k]
                    a["samples"] += samples
                    a["errors"] += errors
                    a["wall"] += wall
                    a["cpu"] += cpu
                    a["shard"] += meter.seconds or 0.0
        finally:
            for ps in clients:
                await ps.close()

    loop_name = _run(measure())
    for k, a in acc.items():
        if not a["samples"]:
            raise RuntimeError(f"concurrency: no step of {k} workers finished")
        row = {
            "case": "concurrency",
            "op": "step",
            "size": n,
            "workers": k,
            "system": label(k),
            "reference": k == counts[0],
            **summarize(a["samples"], 2 * 4 * n),
            "errors": a["errors"],
            "wall_s": a["wall"],
            "servers_cores_busy": a["shard"] / a["wall"],
            "workers_cores_busy": a["cpu"] / a["wall"],
            "idle": idle,
            "loop": loop_name,
        }
        row["ops_per_s"] = len(a["samples"]) / a["wall"]
        row["mb_per_s"] = len(a["samples"]) * 2 * 4 * n / 1e6 / a["wall"]
        rows.append(row)
    return rows


def notes(rows: list[dict]) -> str:
    """Cores busy per phase, errors, and the memory of an idle connection."""
    mine = [r for r in rows if r["case"] == "concurrency"]
    if not mine:
        return ""
    out = [
        "",
        "concurrency: cores busy during each phase (CPU-s per wall second), steps that raised",
        f"{'workers':>8}{'steps/s':>10}{'shard':>8}{'workers':>9}{'errors':>8}{'p99/p50':>9}",
    ]
    for r in mine:
        out.append(
            f"{r['workers']:>8}{r['ops_per_s']:>10,.0f}{r['servers_cores_busy']:>8.2f}"
            f"{r['workers_cores_busy']:>9.2f}{r['errors']:>8}{r['p99_ms'] / r['p50_ms']:>9.1f}"
        )
    idle = mine[0]["idle"]
    if idle["kb_each"] is not None:
        out.append(
            f"idle connections: {idle['connections']} open, each after one request: shard RSS "
            f"{idle['rss_before_kb'] / 1024:.1f} -> {idle['rss_after_kb'] / 1024:.1f} MB, "
            f"{idle['kb_each']:.1f} KB per connection"
        )
    return "\n".join(out)
