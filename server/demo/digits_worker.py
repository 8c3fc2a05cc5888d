"""A Downpour SGD worker: train a small neural network on scikit-learn's digits through paramshard.

Start a fleet, then as many copies of this worker as you like, each with its own index:

    paramshard up --shards 2 --base-port 7100 --data-dir fleet   # in one terminal
    export PARAMSHARD_SHARDS=http://127.0.0.1:7100,http://127.0.0.1:7101
    python -m server.demo.digits_worker --worker-index 0 --num-workers 2 &
    python -m server.demo.digits_worker --worker-index 1 --num-workers 2

(``python examples/digits_worker.py`` in a source checkout runs this same module.)

(``paramshard demo`` does all of that for you and compares the result with one-process training.)

What a worker does, in Downpour SGD (Dean et al., 2012):

1. every worker calls ``init`` with the same seeded initial values: the first call creates the
   variables, the others are no-ops, so no "chief" is needed; ``wait_ready`` then blocks until
   they exist;
2. each step it refreshes its copy of the weights (``pull``, every ``--n-fetch`` steps), computes
   a gradient on a mini-batch of *its own* slice of the training data, hands the gradient to the
   SDK (``push_async`` returns at once, the push travels while the next gradient is computed),
   and counts the step (``increment("global_step")``);
3. the shards apply every gradient as it arrives, with Adagrad, so workers never wait for
   each other; at the end ``flush`` waits until every push was applied.

(``client_sdk.training.DownpourLoop`` packs the same bookkeeping into a helper, with gradient
accumulation over ``n_push`` steps; this module writes it out so every call is in sight.)

The model and the data are plain numpy and importable (``load_data``, ``init_params``,
``loss_and_grads``, ``accuracy``), so ``paramshard demo`` and the tests reuse them. It is part
of the installed package (so that ``paramshard demo`` runs from a wheel) but it is worker code:
it imports the SDK, never the rest of ``server``.

Every setting is a flag with an environment variable behind it (``--steps`` /
``DIGITS_STEPS``); the shard list is ``PARAMSHARD_SHARDS`` (or ``--shards``).

Identical replicas (``docker compose up --scale worker=3``, where no container knows its number)
run with ``--worker-index auto``: each takes the next value of the fleet's ``digits/workers``
counter, so every worker gets a distinct index (its batches, and its slice of the data modulo
``--num-workers``) without being told one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx2
import numpy as np

from client_sdk import PSClient, PSError, wire
from client_sdk.optimizers import Adagrad

#: The network: 64 pixels -> 32 hidden units (tanh) -> 10 class scores (softmax).
N_INPUT, N_HIDDEN, N_CLASSES = 64, 32, 10
#: Variable names on the fleet; placement spreads them over the shards.
PARAM_NAMES = ("layer1/kernel", "layer1/bias", "layer2/kernel", "layer2/bias")
#: The counter every worker bumps once per step.
STEP_COUNTER = "global_step"
#: The counter that hands out indices to workers started with ``--worker-index auto``.
WORKER_COUNTER = "digits/workers"
#: Defaults shared by the workers, ``paramshard demo`` and its one-process reference run.
DEFAULT_LR = 0.05
DEFAULT_BATCH_SIZE = 32
DEFAULT_SEED = 0
TEST_FRACTION = 0.25


@dataclass(frozen=True)
class Dataset:
    """The digits images as float32 in [0, 1] (n, 64) and their labels (n,), split in two."""

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray


def load_data(seed: int = DEFAULT_SEED) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), split train/test by ``seed``.

    Every worker calling this with the same seed gets the same split, so no test image is ever
    trained on.
    """
    from sklearn.datasets import load_digits  # imported here: only data loading needs sklearn

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return Dataset(X[train], y[train], X[test], y[test])


def worker_slice(n: int, worker_index: int, num_workers: int) -> np.ndarray:
    """The indices of the training examples worker ``worker_index`` of ``num_workers`` owns."""
    return np.arange(worker_index, n, num_workers)


def init_params(seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """Initial weights (Glorot-uniform kernels, zero biases); the same for every worker."""
    rng = np.random.default_rng(seed)

    def glorot(fan_in: int, fan_out: int) -> np.ndarray:
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)

    return {
        "layer1/kernel": glorot(N_INPUT, N_HIDDEN),
        "layer1/bias": np.zeros(N_HIDDEN, np.float32),
        "layer2/kernel": glorot(N_HIDDEN, N_CLASSES),
        "layer2/bias": np.zeros(N_CLASSES, np.float32),
    }


def _forward(params: dict[str, np.ndarray], X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hidden = np.tanh(X @ params["layer1/kernel"] + params["layer1/bias"])
    logits = hidden @ params["layer2/kernel"] + params["layer2/bias"]
    return hidden, logits


def predict(params: dict[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    """The predicted class of every row of ``X``."""
    return _forward(params, X)[1].argmax(axis=1)


def accuracy(params: dict[str, np.ndarray], X: np.ndarray, y: np.ndarray) -> float:
    """The fraction of rows of ``X`` whose predicted class is ``y``."""
    return float((predict(params, X) == y).mean())


def loss_and_grads(
    params: dict[str, np.ndarray], X: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy of the batch and its gradient for every parameter (float32)."""
    hidden, logits = _forward(params, X)
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(probs[np.arange(n), y] + 1e-12).mean())

    d_logits = probs
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    d_hidden = (d_logits @ params["layer2/kernel"].T) * (1.0 - hidden * hidden)
    grads = {
        "layer2/kernel": hidden.T @ d_logits,
        "layer2/bias": d_logits.sum(axis=0),
        "layer1/kernel": X.T @ d_hidden,
        "layer1/bias": d_hidden.sum(axis=0),
    }
    return loss, {k: v.astype(np.float32, copy=False) for k, v in grads.items()}


def train(
    ps: PSClient,
    data: Dataset,
    *,
    worker_index: int,
    num_workers: int,
    steps: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    n_fetch: int = 1,
    lr: float = DEFAULT_LR,
    seed: int = DEFAULT_SEED,
    log_every: int = 100,
    tag: str = "",
) -> dict[str, np.ndarray]:
    """Run ``steps`` Downpour SGD steps through ``ps`` on this worker's slice of ``data``.

    The slice is ``worker_index % num_workers``; the batches are drawn from a generator seeded by
    ``seed`` and ``worker_index``, so workers with distinct indices draw distinct batches.

    Blocks until every gradient this worker pushed has been applied; returns the weights pulled
    from the fleet at the end. Progress goes to stdout as ``[w1] step 100/400 loss 0.312 ...``.
    """
    # 1. Create the variables (the first worker's call wins) and wait until all of them exist.
    ps.init(init_params(seed), optimizer=Adagrad(lr=lr))
    ps.wait_ready(list(PARAM_NAMES), timeout=60)

    mine = worker_slice(len(data.y_train), worker_index % num_workers, num_workers)
    rng = np.random.default_rng([seed, worker_index])  # each worker draws its own batches
    tag = tag or f"[w{worker_index}]"
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        # 2. Refresh the weights every n_fetch steps; in between, keep using the copy we have.
        if (step - 1) % n_fetch == 0:
            params = ps.pull(list(PARAM_NAMES))  # read-only arrays: fine, we never modify them
        batch = rng.choice(mine, size=batch_size, replace=len(mine) < batch_size)
        loss, grads = loss_and_grads(params, data.X_train[batch], data.y_train[batch])
        # 3. Send the gradient and move on: the shards apply it with Adagrad while we compute.
        ps.push_async(grads)
        global_step = ps.increment(STEP_COUNTER)
        losses.append(loss)
        if step % log_every == 0 or step == steps:
            print(
                f"{tag} step {step}/{steps} loss {np.mean(losses):.3f} "
                f"global_step {int(global_step)}",
                flush=True,
            )
            losses.clear()
    # 4. Wait until every push has been applied (raises if one failed), then look at the result.
    ps.flush()
    final = ps.pull(list(PARAM_NAMES))
    print(
        f"{tag} done: {steps} steps in {time.perf_counter() - started:.1f} s, held-out "
        f"accuracy of the fleet's weights {accuracy(final, data.X_test, data.y_test):.3f}",
        flush=True,
    )
    return final


def wait_for_shards(shards: list[str], timeout: float, tag: str = "") -> str | None:
    """Block until every shard's ``/readyz`` answers 200 (started, snapshot restored, not
    draining) — for a shard given as a replica group (``URL|URL``), one replica's; ``None``
    then, or why not after ``timeout`` seconds.

    For engines that start a worker without waiting for the shards' health checks (Podman's
    compose does not honour ``condition: service_healthy``). Polls twice a second and says
    which shards it waits for, then again every 5 s.
    """
    headers = {}
    if os.environ.get(wire.ENV_TOKEN):
        headers["Authorization"] = f"Bearer {os.environ[wire.ENV_TOKEN]}"
    deadline = time.monotonic() + timeout
    said = float("-inf")
    waiting: dict[str, str] = {}
    with httpx2.Client(timeout=2.0, trust_env=False, headers=headers) as client:
        while True:
            waiting = {}
            for shard in shards:
                why: dict[str, str] = {}
                for url in (u.strip() for u in shard.split("|")):
                    try:
                        status = client.get(url.rstrip("/") + "/readyz").status_code
                    except httpx2.HTTPError as exc:
                        why[url] = type(exc).__name__
                        continue
                    if status == 200:
                        break
                    why[url] = f"/readyz answers {status}"
                else:
                    waiting.update(why)
            if not waiting or time.monotonic() >= deadline:
                break
            if time.monotonic() - said >= 5:
                said = time.monotonic()
                print(f"{tag} waiting for {_waiting(waiting)}", flush=True)
            time.sleep(0.5)
    return None if not waiting else f"not ready after {timeout:g} s: {_waiting(waiting)}"


def _waiting(waiting: dict[str, str]) -> str:
    return ", ".join(f"{url} ({why})" for url, why in waiting.items())


def claim_worker_index(ps: PSClient) -> int:
    """A worker index no other worker of this fleet got (0, 1, 2, ...), from a fleet counter.

    Blocks for one ``increment``. Indices keep counting up across runs against the same fleet,
    which only changes which batches a worker draws.
    """
    return int(ps.increment(WORKER_COUNTER)) - 1


def _worker_index(text: str) -> int | None:
    """``"auto"`` -> ``None`` (claim one from the fleet), else the integer."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A Downpour SGD worker training a small network on scikit-learn's digits "
        "through a paramshard fleet. Each flag defaults to the DIGITS_<FLAG> "
        "environment variable (e.g. DIGITS_STEPS)."
    )

    def env(flag: str, cast: Callable[[str], object], default: object) -> object:
        key = "DIGITS_" + flag.upper()
        if key not in os.environ:
            return default
        try:
            return cast(os.environ[key])
        except (ValueError, argparse.ArgumentTypeError):
            kind = {int: "an integer", float: "a number"}.get(cast, "an integer or 'auto'")
            p.error(
                f"{key} must be {kind} (it sets --{flag.replace('_', '-')}), "
                f"got {os.environ[key]!r}"
            )

    p.add_argument(
        "--shards",
        default=os.environ.get(wire.ENV_SHARDS),
        help="comma-separated shard URLs in shard-index order (default: $PARAMSHARD_SHARDS)",
    )
    p.add_argument(
        "--worker-index",
        type=_worker_index,
        metavar="I|auto",
        default=env("worker_index", _worker_index, 0),
        help="this worker's index, 0..num-workers-1; picks its slice of the data. "
        "'auto' takes the next value of a fleet counter (for identical replicas)",
    )
    p.add_argument("--num-workers", type=int, default=env("num_workers", int, 1))
    p.add_argument(
        "--worker-id",
        default=os.environ.get(wire.ENV_WORKER_ID),
        help="the id the shards see (default: $PARAMSHARD_WORKER_ID or w<index>)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=env("steps", int, 500),
        help="gradient steps this worker computes",
    )
    p.add_argument("--batch-size", type=int, default=env("batch_size", int, DEFAULT_BATCH_SIZE))
    p.add_argument(
        "--n-fetch",
        type=int,
        default=env("n_fetch", int, 1),
        help="pull fresh weights every n steps",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=env("lr", float, DEFAULT_LR),
        help="Adagrad learning rate (used by whichever worker creates the variables)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=env("seed", int, DEFAULT_SEED),
        help="seeds the data split and the initial weights: the same on every worker",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=env("log_every", int, 100),
        help="print a progress line every n steps",
    )
    p.add_argument(
        "--wait-for-shards",
        type=float,
        metavar="SECONDS",
        default=env("wait_for_shards", float, 0.0),
        help="first wait up to this long until every shard answers /readyz (0: do not wait; "
        "the SDK still retries a shard that does not answer, for its retry deadline)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        default=env("timeout", float, 30.0),
        help="PSClient's timeout: how long one exchange with a shard may take (a few seconds "
        "lets a call stuck on a primary cut off from the network follow the new one)",
    )
    p.add_argument(
        "--retry-deadline",
        type=float,
        metavar="SECONDS",
        default=env("retry_deadline", float, 30.0),
        help="PSClient's retry_deadline: how long one call may keep retrying",
    )
    args = p.parse_args(argv)
    for name in ("timeout", "retry_deadline"):
        if not 0 < getattr(args, name) < float("inf"):
            p.error(
                f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(args, name)}"
            )
    if args.num_workers < 1:
        p.error(f"--num-workers must be >= 1, got {args.num_workers}")
    if args.worker_index is not None and not 0 <= args.worker_index < args.num_workers:
        p.error(f"--worker-index must be in 0..{args.num_workers - 1}, got {args.worker_index}")
    for name in ("steps", "batch_size", "n_fetch", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.wait_for_shards < float("inf"):
        p.error(f"--wait-for-shards must be a finite number >= 0, got {args.wait_for_shards}")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tag = "[w?]" if args.worker_index is None else f"[w{args.worker_index}]"
    data = load_data(args.seed)
    if args.num_workers > len(data.y_train):
        print(
            f"{tag} error: --num-workers {args.num_workers} leaves no training data for some "
            f"workers; use at most {len(data.y_train)}",
            file=sys.stderr,
        )
        return 2
    shards = args.shards.split(",") if args.shards else None  # None: the SDK says what to set
    # An auto-indexed worker keeps the SDK's default id (<hostname>-<pid>) unless given one.
    worker_id = args.worker_id or (None if args.worker_index is None else f"w{args.worker_index}")
    if shards and args.wait_for_shards > 0:
        why = wait_for_shards(shards, args.wait_for_shards, tag)
        if why:
            print(f"{tag} error: the shards are {why}", file=sys.stderr)
            return 1
    try:
        with PSClient(
            shards, worker_id=worker_id, timeout=args.timeout, retry_deadline=args.retry_deadline
        ) as ps:
            index = args.worker_index
            if index is None:
                index = claim_worker_index(ps)
                tag = f"[w{index}]"
                print(f"{tag} claimed worker index {index} ({WORKER_COUNTER})", flush=True)
            train(
                ps,
                data,
                worker_index=index,
                num_workers=args.num_workers,
                steps=args.steps,
                batch_size=args.batch_size,
                n_fetch=args.n_fetch,
                lr=args.lr,
                seed=args.seed,
                log_every=args.log_every,
                tag=tag,
            )
    except PSError as exc:  # every SDK failure; its message says what to do
        print(f"{tag} error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{tag} interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
