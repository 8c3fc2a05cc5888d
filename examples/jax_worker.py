"""Downpour SGD in JAX: asynchronous worker processes train the digits network through
``client_sdk.jax`` (``pip install 'paramshard[jax,demo]'``).

    paramshard up --shards 2 --base-port 7100                 # in one terminal
    export PARAMSHARD_SHARDS=http://127.0.0.1:7100,http://127.0.0.1:7101
    python examples/jax_worker.py run --workers 3             # 3 workers, then the accuracy
    python examples/jax_worker.py reference --workers 3       # the same training, one process

**The model and the data** are those of the demo's numpy worker (``server/demo/
digits_worker.py``) and of ``examples/torch_worker.py``: scikit-learn's 8x8 digits, 64 pixels ->
32 tanh units -> 10 softmax scores, cross-entropy, the same initial weights
(``init_params(seed)``) and the same split. Here the parameters are a pytree,
``{"layer1": {"kernel", "bias"}, "layer2": {...}}``, and JAX computes the gradient
(``jax.jit(jax.value_and_grad(loss))``).

**A worker** (``worker --worker-index k --workers n``) binds the tree to the fleet under
``--prefix`` (variables ``digits-jax/layer1/kernel`` ...; :func:`client_sdk.jax.bind`), calls
``init`` (the first worker's values win; every worker passes the same), then for each of
``--steps`` steps: pulls the parameters as a tree of jax arrays (every ``--n-fetch`` steps),
computes the gradient of a batch of ``--batch-size`` examples of its own slice of the training
set (every n-th from the k-th), and pushes the gradient tree in the background. The shards
apply each gradient with Adagrad (``--lr``) as it arrives; no worker waits for another. At the
end it flushes (every push applied) and prints the held-out accuracy of the fleet's weights.

``run`` starts ``--workers`` worker processes, waits for them and prints ``held-out accuracy
<a> (fleet, n workers x s steps)``. ``reference`` trains the same network in one process with
JAX and the shard's Adagrad written in JAX, for as many steps as the workers took together,
on batches of the whole training set, and prints ``held-out accuracy <a> (one process, ...)``:
what the recipe reaches with no parameter server and no staleness.
``tests/e2e/test_jax_worker.py`` runs both and checks the fleet within 1 point of it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from client_sdk import PSClient, PSError, wire
from client_sdk.jax import bind
from client_sdk.optimizers import Adagrad
from server.demo.digits_worker import Dataset, init_params, load_data, worker_slice

#: Adagrad's epsilon on the shards (client_sdk.optimizers.Adagrad's default).
EPSILON = 1e-10


def initial_tree(seed: int) -> dict[str, dict[str, np.ndarray]]:
    """The numpy demo's initial weights (Glorot-uniform kernels, zero biases) as a pytree."""
    flat = init_params(seed)
    return {
        layer: {"kernel": flat[f"{layer}/kernel"], "bias": flat[f"{layer}/bias"]}
        for layer in ("layer1", "layer2")
    }


def loss(params: Any, X: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of the batch."""
    hidden = jnp.tanh(X @ params["layer1"]["kernel"] + params["layer1"]["bias"])
    logits = hidden @ params["layer2"]["kernel"] + params["layer2"]["bias"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


#: The loss of a batch and its gradient, a tree of the parameters' structure.
loss_and_grads = jax.jit(jax.value_and_grad(loss))


def accuracy(params: Any, data: Dataset) -> float:
    hidden = jnp.tanh(data.X_test @ params["layer1"]["kernel"] + params["layer1"]["bias"])
    logits = hidden @ params["layer2"]["kernel"] + params["layer2"]["bias"]
    return float(jnp.mean(jnp.argmax(logits, axis=1) == data.y_test))


def train_worker(ps: PSClient, data: Dataset, args: argparse.Namespace) -> float:
    """This worker's share of the training; returns the held-out accuracy of the fleet's
    weights once every push it made was applied."""
    model = bind(ps, initial_tree(args.seed), prefix=args.prefix, optimizer=Adagrad(lr=args.lr))
    model.init()
    model.wait_ready(timeout=60)
    mine = worker_slice(len(data.y_train), args.worker_index, args.workers)
    rng = np.random.default_rng([args.seed, args.worker_index])
    tag = f"[jax w{args.worker_index}]"
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        if (step - 1) % args.n_fetch == 0:
            params = model.pull()
        batch = rng.choice(mine, size=args.batch_size, replace=len(mine) < args.batch_size)
        value, grads = loss_and_grads(params, data.X_train[batch], data.y_train[batch])
        model.push(grads)  # in the background: the next step's gradient is computed meanwhile
        if step % args.log_every == 0 or step == args.steps:
            print(f"{tag} step {step}/{args.steps} loss {float(value):.3f}", flush=True)
    model.flush()
    acc = accuracy(model.pull(), data)
    print(
        f"{tag} done: {args.steps} steps in {time.perf_counter() - started:.1f} s, held-out "
        f"accuracy of the fleet's weights {acc:.4f}",
        flush=True,
    )
    return acc


def train_reference(data: Dataset, *, steps: int, batch_size: int, lr: float, seed: int) -> Any:
    """``steps`` Adagrad steps on batches of the whole training set in this process, from the
    workers' initial weights, with the shards' Adagrad (``acc += g*g; w -= lr * g /
    (sqrt(acc) + eps)``) in JAX. Returns the final parameters."""

    @jax.jit
    def step(params: Any, acc: Any, X: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(loss)(params, X, y)
        acc = jax.tree_util.tree_map(lambda a, g: a + g * g, acc, grads)
        params = jax.tree_util.tree_map(
            lambda w, g, a: w - lr * g / (jnp.sqrt(a) + EPSILON), params, grads, acc
        )
        return params, acc

    params = jax.tree_util.tree_map(jnp.asarray, initial_tree(seed))
    acc = jax.tree_util.tree_map(jnp.zeros_like, params)
    rng = np.random.default_rng([seed, 1 << 20])
    n = len(data.y_train)
    for _ in range(steps):
        batch = rng.choice(n, size=batch_size, replace=n < batch_size)
        params, acc = step(params, acc, data.X_train[batch], data.y_train[batch])
    return params


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("run", "worker", "reference"))
    p.add_argument("--workers", type=int, default=3, help="worker processes (run)")
    p.add_argument("--worker-index", type=int, default=0, help="this worker's index (worker)")
    p.add_argument("--steps", type=int, default=400, help="gradient steps per worker")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--n-fetch", type=int, default=1, help="pull fresh weights every n steps")
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad's learning rate")
    p.add_argument("--seed", type=int, default=0, help="the split, the weights, the batches")
    p.add_argument("--prefix", default="digits-jax", help="the variables' names start so")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument(
        "--shards",
        default=os.environ.get(wire.ENV_SHARDS),
        help="comma-separated shard URLs in shard-index order (default: $PARAMSHARD_SHARDS)",
    )
    args = p.parse_args(argv)
    for name in ("workers", "steps", "batch_size", "n_fetch", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.worker_index < args.workers:
        p.error(f"--worker-index must be in 0..{args.workers - 1}, got {args.worker_index}")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.command != "reference" and not args.shards:
        p.error(f"give the shards: --shards URL,URL or {wire.ENV_SHARDS}")
    return args


def run(args: argparse.Namespace) -> int:
    """Start the workers as processes, wait for them, then report the fleet's accuracy."""
    common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "command"]
    me = [sys.executable, os.path.abspath(__file__), "worker"]
    procs = [subprocess.Popen([*me, *common, f"--worker-index={k}"]) for k in range(args.workers)]
    failed = [k for k, proc in enumerate(procs) if proc.wait() != 0]
    if failed:
        print(f"workers {failed} failed", file=sys.stderr)
        return 1
    data = load_data(args.seed)
    with PSClient(args.shards.split(","), worker_id="jax-run") as ps:
        acc = accuracy(bind(ps, initial_tree(args.seed), prefix=args.prefix).pull(), data)
    print(f"held-out accuracy {acc:.4f} (fleet, {args.workers} workers x {args.steps} steps)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "reference":
        data = load_data(args.seed)
        steps = args.workers * args.steps
        params = train_reference(
            data, steps=steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed
        )
        print(f"held-out accuracy {accuracy(params, data):.4f} (one process, {steps} steps)")
        return 0
    try:
        if args.command == "run":
            return run(args)
        with PSClient(args.shards.split(","), worker_id=f"jax-w{args.worker_index}") as ps:
            train_worker(ps, load_data(args.seed), args)
    except PSError as exc:  # every SDK failure; its message says what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
