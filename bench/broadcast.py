"""Learner -> actors broadcast: one learner pushes a 1 MB model, 8 actor processes wait for it.

Each actor (``python -m bench.broadcast actor ...``, one process and one ``PSClient`` each)
holds the model and blocks in ``ps.pull([model], newer_than="cached")``; the learner (this
process) waits until the shard holds all 8 polls (``polls_waiting`` in ``/v1/cluster``), pushes
a gradient of ones (the model uses the ``Add`` optimizer, so element 0 of the value counts the
pushes) and notes when the push's reply arrived. Each actor notes when its pull returned with
the new value and says so on its stdout. A round's latency is the last actor's time minus the
push's reply: the time until every actor holds the new version. The clocks are the machine's
one monotonic clock (``time.monotonic``, the same in every process on Linux). The first
``--warmup`` rounds (at least one) are not counted.

A round's latency may be below zero: the shard answers the waiting polls as it applies the
push, and on a busy machine the actors can hold the new version before the learner's process
has read its push's reply. The row also gives ``from_push_p50_ms``, from the start of the push
(its 1 MB upload included) to the last actor holding it.

With ``--peers`` including ``ray`` the same pattern runs on Ray (:mod:`bench.peers.ray_broadcast`:
the model ``ray.put`` into the object store, its reference handed to the 8 waiting Ray actors,
each ``ray.get``-ting it), in a process of its own; without it that row is left out and the goal
says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request

import numpy as np

from . import processes
from .context import Context
from .timing import summarize

__all__ = ["ACTORS", "DEFAULT_SIZES", "DESCRIPTION", "RAY", "SDK", "run"]

ACTORS = 8
DESCRIPTION = (
    f"1 learner pushes, {ACTORS} actor processes wait in pull(newer_than=...); time from the "
    "push's reply until every actor holds the new version"
)
DEFAULT_SIZES = (250_000,)  # float32: 1 MB
SDK, RAY = "paramshard", "Ray put/get"
_WAIT = 30.0  # s: the most an actor or the learner waits for one round


def _polls_waiting(url: str) -> int:
    with urllib.request.urlopen(url + "/v1/cluster", timeout=5) as r:
        return int(json.loads(r.read())["polls_waiting"])


def _until_waiting(url: str, count: int) -> None:
    deadline = time.monotonic() + _WAIT
    while _polls_waiting(url) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"broadcast: {count} actors were not all waiting after {_WAIT} s")
        time.sleep(0.001)


def _sdk_rounds(ctx: Context, n: int, rounds: int) -> tuple[list[float], list[float]]:
    from client_sdk import PSClient
    from client_sdk.optimizers import Add

    url = ctx.fleet(1).urls[0]
    name = f"bench/broadcast/f32-{n}"
    actors, lines = [], []
    with PSClient([url], worker_id="bench-learner") as ps:
        ps.init({name: np.zeros(n, np.float32)}, optimizer=Add())
        ps.assign({name: np.zeros(n, np.float32)})  # a fresh start on a shared fleet
        try:
            for i in range(ACTORS):
                log = ctx.logdir / f"broadcast-actor{i}.log"
                cmd = [sys.executable, "-m", "bench.broadcast", "actor", url, name, str(i)]
                proc = processes.spawn(cmd, log, pipes=True)
                actors.append(proc)
                lines.append(processes.LineReader(proc, log, f"broadcast actor {i}"))
            for reader in lines:
                reader.readline(120)  # {"ready": true}
            grad = np.ones(n, np.float32)
            latencies, from_push = [], []
            for r in range(1, rounds + 1):
                _until_waiting(url, ACTORS)
                pushed = time.monotonic()
                ps.push({name: grad})
                replied = time.monotonic()
                held = [json.loads(reader.readline(_WAIT)) for reader in lines]
                assert all(h["round"] == r for h in held), held
                last = max(h["t"] for h in held)
                latencies.append(last - replied)
                from_push.append(last - pushed)
            return latencies, from_push
        finally:
            for proc in actors:
                processes.stop(proc, grace=5.0)


def _ray_rounds(ctx: Context, n: int, rounds: int) -> tuple[list[float], list[float]]:
    log = ctx.logdir / "ray-broadcast.log"
    cmd = [
        sys.executable,
        "-m",
        "bench.peers.ray_broadcast",
        "--size",
        str(n),
        "--actors",
        str(ACTORS),
        "--rounds",
        str(rounds),
        "--logdir",
        str(ctx.logdir),
    ]
    proc = processes.spawn(cmd, log, pipes=True)
    try:
        got = json.loads(processes.LineReader(proc, log, "ray broadcast").readline(600))
        return got["latencies"], got["from_push"]
    finally:
        processes.stop(proc, grace=15.0)


def run(ctx: Context) -> list[dict]:
    rows = []
    warmup = max(ctx.warmup, 1)  # Ray's first round starts its workers' machinery: 0.5 s
    rounds = warmup + max(ctx.reps, 5)
    for n in ctx.sizes_for(DEFAULT_SIZES):
        systems = {SDK: _sdk_rounds}
        if "ray" in ctx.peer_names:
            systems[RAY] = _ray_rounds
        for system, measure in systems.items():
            latencies, from_push = measure(ctx, n, rounds)
            rows.append(
                {
                    "case": "broadcast",
                    "op": "broadcast",
                    "size": n,
                    "actors": ACTORS,
                    "system": system,
                    "reference": system == RAY,
                    **summarize(latencies[warmup:]),
                    "from_push_p50_ms": float(np.median(from_push[warmup:])) * 1e3,
                }
            )
    return rows


# -- an actor process ---------------------------------------------------------------------------


def actor(url: str, name: str, index: int) -> None:
    """Hold ``name``; each time a newer version arrives, print the round (element 0 of the
    value) and when it arrived, until stdin closes."""
    from client_sdk import PSClient

    threading.Thread(target=_exit_at_eof, daemon=True).start()

    with PSClient([url], worker_id=f"bench-actor-{index}") as ps:
        ps.pull([name])
        print(json.dumps({"ready": True}), flush=True)
        while True:
            got = ps.pull([name], newer_than="cached", timeout=_WAIT)
            now = time.monotonic()
            if got:
                print(json.dumps({"round": int(got[name][0]), "t": now}), flush=True)


def _exit_at_eof() -> None:
    sys.stdin.read()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.broadcast", description=__doc__.split("\n")[0]
    )
    p.add_argument("role", choices=["actor"])
    p.add_argument("url")
    p.add_argument("name")
    p.add_argument("index", type=int)
    args = p.parse_args(argv)
    actor(args.url, args.name, args.index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
