"""The broadcast pattern of :mod:`bench.broadcast` on Ray: ``python -m bench.peers.ray_broadcast``.

What a Ray user writes for "one learner, many actors that wait for the newest weights": the
learner ``ray.put``\\ s the model into the object store and publishes the reference on a
*board*, an asyncio Ray actor; each of the ``--actors`` Ray actors (one process each) waits in
``board.newer_than.remote(version)`` (an ``asyncio.Event`` inside the board: no polling) and then
``ray.get``\\ s the model, which on one node maps it from the object store's shared memory
without a copy. A round's latency is the last actor's ``time.monotonic()`` on holding the new
model minus the learner's on getting ``publish``'s reply.

One Ray node on 127.0.0.1 (no dashboard, logs under ``--logdir``). Prints one line of JSON: the
rounds' ``latencies`` and their times ``from_push`` (from before the ``ray.put``), in seconds.
Runs in its own process so that Ray never shares one with the SDK; needs the ``peers`` extra
(``make bench-peers``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]

_OBJECT_STORE_BYTES = 500_000_000
_WAIT = 30.0


class _Board:
    """The newest model's reference and its version; ``newer_than`` waits for a newer one."""

    def __init__(self) -> None:
        self.version = 0
        self.refs: list[Any] = []
        self.changed = asyncio.Event()
        self.waiting = 0

    async def publish(self, refs: list[Any]) -> int:
        self.version += 1
        self.refs = refs  # in a list: Ray hands over the reference, not the array
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()
        return self.version

    async def newer_than(self, version: int) -> tuple[int, list[Any]]:
        while self.version <= version:
            self.waiting += 1
            try:
                await self.changed.wait()
            finally:
                self.waiting -= 1
        return self.version, self.refs

    async def waiting_count(self) -> int:
        return self.waiting


class _Actor:
    """Waits for each newer model, takes it from the object store, notes when it held it."""

    def __init__(self, board: Any) -> None:
        self.board = board

    def run(self, rounds: int) -> list[tuple[int, float]]:
        import ray

        version, held = 0, []
        for _ in range(rounds):
            version, refs = ray.get(self.board.newer_than.remote(version))
            model = ray.get(refs[0])
            held.append((int(model[0]), time.monotonic()))
        return held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.ray_broadcast")
    p.add_argument("--size", type=int, required=True, help="float32 elements of the model")
    p.add_argument("--actors", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--logdir", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=_OBJECT_STORE_BYTES,
        _temp_dir=str(args.logdir.resolve() / "ray-broadcast"),
        log_to_driver=False,
        logging_level="warning",
    )
    try:
        # num_cpus=0: the actors wait, they do not compute; all of them fit on a 2-core node.
        board = ray.remote(num_cpus=0)(_Board).remote()
        actors = [ray.remote(num_cpus=0)(_Actor).remote(board) for _ in range(args.actors)]
        results = [a.run.remote(args.rounds) for a in actors]
        pushed: list[float] = []
        replied: list[float] = []
        for r in range(1, args.rounds + 1):
            deadline = time.monotonic() + _WAIT
            while ray.get(board.waiting_count.remote()) < args.actors:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{args.actors} Ray actors were not all waiting")
                time.sleep(0.001)
            model = np.full(args.size, r, np.float32)
            pushed.append(time.monotonic())
            ref = ray.put(model)
            ray.get(board.publish.remote([ref]))
            replied.append(time.monotonic())
        held = ray.get(results)
        latencies, from_push = [], []
        for r, (start, t) in enumerate(zip(pushed, replied), start=1):
            times = [when for actor in held for (version, when) in actor if version == r]
            if len(times) != args.actors:
                raise RuntimeError(f"round {r}: {len(times)} of {args.actors} actors held it")
            latencies.append(max(times) - t)
            from_push.append(max(times) - start)
    finally:
        ray.shutdown()
    print(json.dumps({"latencies": latencies, "from_push": from_push}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
