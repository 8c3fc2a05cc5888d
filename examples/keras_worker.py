"""A Keras 3 model trained through a fleet, on the JAX backend: asynchronous workers, each a
``keras.Sequential`` whose weights are a pytree bound with ``client_sdk.jax``
(``pip install 'paramshard[jax,demo]' keras``).

    paramshard up --shards 2 --base-port 7100                 # in one terminal
    export PARAMSHARD_SHARDS=http://127.0.0.1:7100,http://127.0.0.1:7101
    python examples/keras_worker.py run --workers 2           # 2 workers, then the accuracy

The network and the data are those of ``examples/jax_worker.py`` (scikit-learn's digits, 64 ->
32 tanh -> 10, the same initial weights and Adagrad on the shards), written as Keras layers
named ``hidden`` and ``scores``. A Keras model on the JAX backend is a function of its weights
(``model.stateless_call(trainable, non_trainable, x)``), so a worker keeps the weights as a dict
``{"hidden/kernel": ..., "hidden/bias": ..., "scores/kernel": ..., "scores/bias": ...}`` (each
layer's name, then its weight's), binds it under ``--prefix`` (variables
``digits-keras/hidden/kernel`` ...), and each step pulls it, takes ``jax.value_and_grad`` of the
loss through ``stateless_call`` and pushes the gradient dict. Nothing here calls ``fit``: the
fleet's shards are the optimizer.

``run`` starts ``--workers`` worker processes and prints ``held-out accuracy <a> (fleet, n
workers x s steps)`` from the fleet's weights (read with numpy: it imports neither Keras nor
JAX). ``tests/e2e/test_jax_worker.py`` runs it with one worker and checks that it learns.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from client_sdk import PSClient, PSError, wire
from client_sdk.optimizers import Adagrad
from server.demo import digits_worker as digits

#: The weights' names under the prefix, in the model's order: each layer's name, then its own.
WEIGHTS = ("hidden/kernel", "hidden/bias", "scores/kernel", "scores/bias")
#: The numpy demo's names for the same weights (its initial values and its accuracy).
DEMO_NAMES = dict(zip(WEIGHTS, digits.PARAM_NAMES))


def keras_on_jax() -> Any:
    """The ``keras`` module on the JAX backend (imported here: ``run`` does without it)."""
    os.environ["KERAS_BACKEND"] = "jax"  # read when keras is first imported
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit(f"keras was imported with the {keras.backend.backend()} backend")
    return keras


def build(seed: int) -> Any:
    """The Keras model, with the numpy demo's initial weights for ``seed``."""
    keras = keras_on_jax()

    model = keras.Sequential(
        [
            keras.Input(shape=(digits.N_INPUT,)),
            keras.layers.Dense(digits.N_HIDDEN, activation="tanh", name="hidden"),
            keras.layers.Dense(digits.N_CLASSES, name="scores"),
        ],
        name="digits",
    )
    initial = digits.init_params(seed)
    model.set_weights([initial[DEMO_NAMES[w]] for w in WEIGHTS])
    return model


def weights(model: Any) -> dict[str, Any]:
    """The model's trainable weights as a dict by layer and weight name (``WEIGHTS``)."""
    return {
        f"{layer.name}/{v.name}": v.value
        for layer in model.layers
        for v in layer.trainable_variables
    }


def train_worker(ps: PSClient, args: argparse.Namespace) -> None:
    keras = keras_on_jax()
    import jax

    from client_sdk.jax import bind

    model = build(args.seed)
    start = weights(model)
    assert tuple(start) == WEIGHTS, list(start)

    def loss(params: dict[str, Any], X: Any, y: Any) -> Any:
        logits, _ = model.stateless_call([params[w] for w in WEIGHTS], [], X)
        per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        return keras.ops.mean(per_example)

    loss_and_grads = jax.jit(jax.value_and_grad(loss))
    bound = bind(ps, start, prefix=args.prefix, optimizer=Adagrad(lr=args.lr))
    bound.init()
    bound.wait_ready(timeout=60)
    data = digits.load_data(args.seed)
    mine = digits.worker_slice(len(data.y_train), args.worker_index, args.workers)
    rng = np.random.default_rng([args.seed, args.worker_index])
    tag = f"[keras w{args.worker_index}]"
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        params = bound.pull()
        batch = rng.choice(mine, size=args.batch_size, replace=len(mine) < args.batch_size)
        value, grads = loss_and_grads(params, data.X_train[batch], data.y_train[batch])
        bound.push(grads)
        if step % args.log_every == 0 or step == args.steps:
            print(f"{tag} step {step}/{args.steps} loss {float(value):.3f}", flush=True)
    bound.flush()
    print(f"{tag} done: {args.steps} steps in {time.perf_counter() - started:.1f} s", flush=True)


def fleet_accuracy(ps: PSClient, prefix: str, seed: int) -> float:
    """The held-out accuracy of the fleet's weights, computed with numpy."""
    pulled = ps.pull([f"{prefix}/{w}" for w in WEIGHTS])
    params = {DEMO_NAMES[w]: pulled[f"{prefix}/{w}"] for w in WEIGHTS}
    data = digits.load_data(seed)
    return digits.accuracy(params, data.X_test, data.y_test)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("run", "worker"))
    p.add_argument("--workers", type=int, default=2, help="worker processes (run)")
    p.add_argument("--worker-index", type=int, default=0, help="this worker's index (worker)")
    p.add_argument("--steps", type=int, default=400, help="gradient steps per worker")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad's learning rate")
    p.add_argument("--seed", type=int, default=0, help="the split, the weights, the batches")
    p.add_argument("--prefix", default="digits-keras", help="the variables' names start so")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument(
        "--shards",
        default=os.environ.get(wire.ENV_SHARDS),
        help="comma-separated shard URLs in shard-index order (default: $PARAMSHARD_SHARDS)",
    )
    args = p.parse_args(argv)
    for name in ("workers", "steps", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.worker_index < args.workers:
        p.error(f"--worker-index must be in 0..{args.workers - 1}, got {args.worker_index}")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not args.shards:
        p.error(f"give the shards: --shards URL,URL or {wire.ENV_SHARDS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shards = args.shards.split(",")
    try:
        if args.command == "worker":
            with PSClient(shards, worker_id=f"keras-w{args.worker_index}") as ps:
                train_worker(ps, args)
            return 0
        common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "command"]
        me = [sys.executable, os.path.abspath(__file__), "worker"]
        procs = [
            subprocess.Popen([*me, *common, f"--worker-index={k}"]) for k in range(args.workers)
        ]
        failed = [k for k, proc in enumerate(procs) if proc.wait() != 0]
        if failed:
            print(f"workers {failed} failed", file=sys.stderr)
            return 1
        with PSClient(shards, worker_id="keras-run") as ps:
            acc = fleet_accuracy(ps, args.prefix, args.seed)
        workers = f"{args.workers} worker{'s' if args.workers != 1 else ''}"
        print(f"held-out accuracy {acc:.4f} (fleet, {workers} x {args.steps} steps)")
    except PSError as exc:  # every SDK failure; its message says what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
