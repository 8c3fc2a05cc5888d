"""PyTorch workers training through paramshard: scikit-learn's digits, a small MLP, torch autograd.

    paramshard up --shards 2 --base-port 7100                       # in one terminal
    export PARAMSHARD_SHARDS=http://127.0.0.1:7100,http://127.0.0.1:7101
    python examples/torch_worker.py run --workers 3                 # 3 worker processes

``run`` starts ``--workers`` copies of this script as ``worker`` processes, waits for them, then
measures the held-out accuracy of the fleet's weights next to the same training in one process
with torch alone (``reference``: the workers' mini-batches taken in turn, each one a step of
``torch.optim.Adagrad``, the shard's Adagrad: what the fleet computes, without staleness), and
prints both::

    held-out accuracy: fleet 0.9711, one process 0.9733 (450 images, 3 workers x 400 steps)

A worker binds its ``torch.nn.Module`` to the fleet (:func:`client_sdk.torch.bind`) and loops:
``pull()`` writes the fleet's weights into the module's parameters in place, a forward and
backward pass on a mini-batch of its own slice of the data computes ``.grad``, and ``push()``
hands the gradients to the SDK, which sends them in the background while the next step runs.
The shards apply them with Adagrad as they arrive (Downpour SGD): once every worker is ready to
step (a variable ``<prefix>ready/<k>`` per worker: each waits for all of them), no worker waits
for another.

The network is the demo's (``server/demo/digits_worker.py``: 64 pixels -> 32 tanh -> 10, its
Glorot-uniform initial weights), so the numpy worker, this one and the JAX one start alike.
Needs ``pip install 'paramshard[torch,demo]'`` (torch, scikit-learn).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

from client_sdk import PSClient
from client_sdk.optimizers import Adagrad
from client_sdk.torch import bind
from server.demo import digits_worker as digits

LR = 0.05
BATCH = 64
STEPS = 400


def make_model(seed: int) -> torch.nn.Module:
    """The demo's MLP in torch, with the demo's initial weights (its kernels are in x out;
    a ``Linear``'s weight is out x in)."""
    init = digits.init_params(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(digits.N_INPUT, digits.N_HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(digits.N_HIDDEN, digits.N_CLASSES),
    )
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(init["layer1/kernel"].T))
        model[0].bias.copy_(torch.from_numpy(init["layer1/bias"]))
        model[2].weight.copy_(torch.from_numpy(init["layer2/kernel"].T))
        model[2].bias.copy_(torch.from_numpy(init["layer2/bias"]))
    return model


def accuracy(model: torch.nn.Module, data: digits.Dataset) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(data.X_test)).argmax(dim=1).numpy()
    return float((predicted == data.y_test).mean())


def worker(ps: PSClient, prefix: str, index: int, workers: int, steps: int, seed: int) -> None:
    """``steps`` Downpour steps on this worker's slice of the training images."""
    data = digits.load_data(seed)
    model = make_model(seed)
    fleet = bind(ps, model, prefix=prefix, optimizer=Adagrad(lr=LR))
    fleet.init()  # the first worker's values win; every worker then holds them
    # Start together: each worker creates a mark of its own, then waits for every worker's.
    # Otherwise a worker that imported torch sooner runs many steps alone, and the fleet trains
    # on one worker's slice after another instead of on all of them in turn.
    ps.init({f"{prefix}ready/{index}": np.zeros((), np.int64)})
    ps.wait_ready([f"{prefix}ready/{k}" for k in range(workers)], timeout=300)
    X, y = torch.from_numpy(data.X_train), torch.from_numpy(data.y_train)
    mine = batches(data, index, workers, seed)
    for step in range(1, steps + 1):
        fleet.pull()
        batch = next(mine)
        loss = torch.nn.functional.cross_entropy(model(X[batch]), y[batch])
        loss.backward()
        fleet.push()
        if step % 100 == 0 or step == steps:
            print(f"[w{index}] step {step}/{steps} loss {loss.item():.3f}", flush=True)
    fleet.flush()


def batches(data: digits.Dataset, index: int, workers: int, seed: int) -> Iterator[torch.Tensor]:
    """Worker ``index``'s mini-batches: drawn from its own slice of the training images."""
    mine = digits.worker_slice(len(data.y_train), index, workers)
    rng = np.random.default_rng([seed, index])
    while True:
        yield torch.from_numpy(rng.choice(mine, size=BATCH))


def reference(data: digits.Dataset, workers: int, steps: int, seed: int) -> torch.nn.Module:
    """The same training in one process: the workers' batches, taken in turn (``steps`` of each
    worker's), each one an Adagrad step on one model as soon as it is drawn, so no gradient is
    stale."""
    model = make_model(seed)
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    X, y = torch.from_numpy(data.X_train), torch.from_numpy(data.y_train)
    streams = [batches(data, k, workers, seed) for k in range(workers)]
    for _ in range(steps):
        for stream in streams:
            batch = next(stream)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(X[batch]), y[batch]).backward()
            opt.step()
    return model


def run(args: argparse.Namespace) -> int:
    """Start the workers, wait for them, and compare the fleet's accuracy with the reference."""
    me = [sys.executable, os.path.abspath(__file__)]
    common = [
        f"--workers={args.workers}",
        f"--steps={args.steps}",
        f"--seed={args.seed}",
        f"--prefix={args.prefix}",
    ]
    if args.shards:
        common.append(f"--shards={args.shards}")
    started = time.perf_counter()
    procs = [
        subprocess.Popen([*me, "worker", *common, f"--worker-index={k}"])
        for k in range(args.workers)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"a worker failed (exit statuses {codes})", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    data = digits.load_data(args.seed)
    model = make_model(args.seed)
    with PSClient(args.shards, worker_id="torch-digits-eval") as ps:
        bind(ps, model, prefix=args.prefix).pull()
    one = reference(data, args.workers, args.steps, args.seed)
    print(
        f"held-out accuracy: fleet {accuracy(model, data):.4f}, one process "
        f"{accuracy(one, data):.4f} ({len(data.y_test)} images, {args.workers} workers x "
        f"{args.steps} steps in {elapsed:.1f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["run", "worker"])
    parser.add_argument("--shards", default=None, help="shard URLs (default: PARAMSHARD_SHARDS)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--worker-index", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS, help="gradient steps per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix", default="torch-digits/", help="the variables' names' start")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.steps < 1:
        parser.error("--workers and --steps must be >= 1")
    torch.set_num_threads(1)  # several workers share the cores
    if args.role == "run":
        return run(args)
    with PSClient(args.shards, worker_id=f"torch-digits-{args.worker_index}") as ps:
        worker(ps, args.prefix, args.worker_index, args.workers, args.steps, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
