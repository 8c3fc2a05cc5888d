"""A sync-mode worker process with deterministic gradients, and the one-process reference it
must match (tests/e2e/test_sync_training.py).

The model is least squares, ``w`` (8 weights) and ``b`` (a bias): worker ``i`` computes its
gradient for the step on version ``v`` of the parameters on a batch drawn from a generator
seeded by ``(i, v)``, so the gradient is a function of (worker, version, parameters) alone and
one process can compute what ``k`` workers push. Run as a worker::

    python -m tests.helpers.sync_worker --shards URL,URL --worker 0 --steps 20

It prints ``step <version>`` after each push (flushed, so a test can follow it) and ``done``
with its loop's counts at the end.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

NAMES = ("sync/w", "sync/b0")
FEATURES = 8
BATCH = 16
LR = 0.05
_TRUE_W = np.linspace(-1.0, 1.0, FEATURES)


def initial() -> dict[str, np.ndarray]:
    """The parameters every run starts from."""
    return {
        "sync/w": np.linspace(0.5, -0.5, FEATURES).astype(np.float32),
        "sync/b0": np.zeros(1, np.float32),
    }


def gradient(worker: int, version: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Worker ``worker``'s gradient of the mean squared error at ``params`` (version
    ``version``), in float32 as it is pushed."""
    rng = np.random.default_rng([worker, version])
    x = rng.normal(size=(BATCH, FEATURES))
    y = x @ _TRUE_W + 0.3 + rng.normal(scale=0.1, size=BATCH)
    w = params["sync/w"].astype(np.float64)
    b = float(params["sync/b0"][0])
    r = x @ w + b - y
    return {
        "sync/w": (x.T @ r / BATCH).astype(np.float32),
        "sync/b0": np.array([r.mean()], np.float32),
    }


def reference(workers: list[int], steps: int) -> dict[str, np.ndarray]:
    """What ``steps`` sync rounds of ``workers`` make of :func:`initial` under SGD(lr=LR): each
    round the float32 mean of every worker's gradient, applied once, in float32 as the shard
    does (the sum, divided by the count, times lr, subtracted)."""
    params = initial()
    for version in range(steps):
        grads = [gradient(i, version, params) for i in workers]
        new = {}
        for name in NAMES:
            total = grads[0][name].copy()
            for g in grads[1:]:
                np.add(total, g[name], out=total)
            mean = np.divide(total, np.float32(len(grads)))
            new[name] = params[name] - np.multiply(mean, np.float32(LR))
        params = new
    return params


def main(argv: list[str] | None = None) -> int:
    from client_sdk import PSClient
    from client_sdk.modes import Sync
    from client_sdk.optimizers import SGD
    from client_sdk.training import SyncLoop

    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args(argv)
    with PSClient(args.shards.split(","), worker_id=f"sync-worker-{args.worker}") as ps:
        ps.init(initial(), optimizer=SGD(lr=LR), sync=Sync(args.replicas, args.timeout))
        loop = SyncLoop(ps, list(NAMES))
        while True:
            params = loop.params()
            version = loop.versions[NAMES[0]]
            if version >= args.steps:
                break
            loop.step(gradient(args.worker, version, params))
            print(f"step {version}", flush=True)
        loop.finish()
        counts = {"applied": loop.applied, "accepted": loop.accepted, "dropped": loop.dropped}
        print("done " + json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
