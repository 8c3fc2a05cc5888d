"""Each optimizer's update on the shard (``server.optim.apply``) on one float32 variable, next to
the same formula written as a plain in-place numpy sequence, in one process, taking turns.

The ops (default size 2.5·10^7 elements, 100 MB per array):

``add``       ``Add``: value += grad
``sgd``       ``SGD(lr=0.01)``
``momentum``  ``SGD(lr=0.01, momentum=0.9, nesterov=True)``
``adam``      ``Adam()``
``adamw``     ``AdamW(amsgrad=True)``
``rmsprop``   ``RMSprop(centered=True, momentum=0.9)``
``adagrad``   ``Adagrad()``
``ftrl``      ``Ftrl(l1=0.01)``

*Reference*: the formula in the order torch's or TensorFlow's code writes it, as numpy ufuncs
with ``out=`` into temporaries allocated once, updating the same value and slots in place:
what a careful hand-written numpy update costs, with nothing to check or dispatch. The shard's
``apply`` allocates its temporaries per call, as on the shard; the case runs in a process of
its own which sets the shard's allocator policy (``server.store.heap.keep_big_buffers``), so they
come back from the heap as they do on a shard's event loop.

Goal: each ``apply`` within 1.25x the reference's median time at 2.5·10^7 elements.

``python -m bench.optimizers SIZE REPS WARMUP`` is that process: it prints one JSON object,
op -> system -> the timed seconds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from .context import Context
from .timing import reps_for, summarize

__all__ = ["APPLY", "DEFAULT_SIZES", "DESCRIPTION", "NUMPY", "OPS", "run"]

DESCRIPTION = (
    "each optimizer's update on one float32 variable (server.optim.apply) vs the same "
    "formula as plain in-place numpy"
)
DEFAULT_SIZES = (25_000_000,)
APPLY, NUMPY = "server.optim.apply", "plain numpy"
OPS = ("add", "sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", "ftrl")


def run(ctx: Context) -> list[dict]:
    rows: list[dict] = []
    for n in ctx.sizes_for(DEFAULT_SIZES):
        reps = reps_for(4 * n, ctx.reps, ctx.min_reps)
        child = subprocess.run(
            [sys.executable, "-m", "bench.optimizers", str(n), str(reps), str(ctx.warmup)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if child.returncode != 0:
            raise RuntimeError(f"bench.optimizers failed:\n{child.stderr[-3000:]}")
        samples = json.loads(child.stdout)
        for op in OPS:
            for system in (APPLY, NUMPY):
                rows.append(
                    {
                        "case": "optimizers",
                        "op": op,
                        "size": n,
                        "system": system,
                        "reference": system == NUMPY,
                        "dtype": "float32",
                        **summarize(samples[op][system], 4 * n),
                    }
                )
    return rows


# -- the child process ----------------------------------------------------------------------------

Update = Callable[[int], None]


def _setups(n: int) -> dict[str, Callable[[], tuple[Update, Update]]]:
    """Per op, a function that allocates its arrays and returns (apply, reference), each
    taking the update's number (1 for the first)."""
    from client_sdk.optimizers import SGD, Adagrad, Adam, AdamW, Add, Ftrl, RMSprop
    from server import optim

    rng = np.random.default_rng(0)
    value = rng.standard_normal(n, dtype=np.float32)
    grad = (rng.standard_normal(n, dtype=np.float32) * 1e-3).astype(np.float32)
    f32 = np.float32

    def shard(opt: object) -> tuple[Update, dict[str, np.ndarray]]:
        state = optim.init_state(opt, value)  # type: ignore[arg-type]

        def update(step: int) -> None:
            optim.apply(opt, value, grad, state, step=step)  # type: ignore[arg-type]

        return update, state

    def add() -> tuple[Update, Update]:
        def ref(step: int) -> None:
            np.add(value, grad, out=value)

        return shard(Add())[0], ref

    def sgd() -> tuple[Update, Update]:
        t = np.empty_like(value)

        def ref(step: int) -> None:
            np.multiply(grad, f32(0.01), out=t)
            np.subtract(value, t, out=value)

        return shard(SGD(lr=0.01))[0], ref

    def momentum() -> tuple[Update, Update]:
        buf, t = np.zeros_like(value), np.empty_like(value)

        def ref(step: int) -> None:
            np.multiply(buf, 0.9, out=buf)
            np.add(buf, grad, out=buf)
            np.multiply(buf, 0.9, out=t)
            np.add(t, grad, out=t)
            np.multiply(t, 0.01, out=t)
            np.subtract(value, t, out=value)

        return shard(SGD(lr=0.01, momentum=0.9, nesterov=True))[0], ref

    def adam(amsgrad: bool = False, decay: float = 0.0) -> Callable[[], tuple[Update, Update]]:
        def setup() -> tuple[Update, Update]:
            m, v, vmax, t = (np.zeros_like(value) for _ in range(4))
            lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8

            def ref(step: int) -> None:
                if decay:
                    np.multiply(value, 1 - lr * decay, out=value)
                np.multiply(m, b1, out=m)
                np.multiply(grad, 1 - b1, out=t)
                np.add(m, t, out=m)
                np.multiply(v, b2, out=v)
                np.multiply(grad, grad, out=t)
                np.multiply(t, 1 - b2, out=t)
                np.add(v, t, out=v)
                second = v
                if amsgrad:
                    np.maximum(vmax, v, out=vmax)
                    second = vmax
                np.sqrt(second, out=t)
                np.divide(t, math.sqrt(1 - b2**step), out=t)
                np.add(t, eps, out=t)
                np.divide(m, t, out=t)
                np.multiply(t, lr / (1 - b1**step), out=t)
                np.subtract(value, t, out=value)

            opt = AdamW(amsgrad=True, weight_decay=decay) if decay else Adam()
            return shard(opt)[0], ref

        return setup

    def rmsprop() -> tuple[Update, Update]:
        sq, avg, buf, t = (np.zeros_like(value) for _ in range(4))
        alpha, lr, mu, eps = 0.99, 1e-2, 0.9, 1e-8

        def ref(step: int) -> None:
            np.multiply(sq, alpha, out=sq)
            np.multiply(grad, grad, out=t)
            np.multiply(t, 1 - alpha, out=t)
            np.add(sq, t, out=sq)
            np.multiply(avg, alpha, out=avg)
            np.multiply(grad, 1 - alpha, out=t)
            np.add(avg, t, out=avg)
            np.multiply(avg, avg, out=t)
            np.subtract(sq, t, out=t)
            np.maximum(t, 0.0, out=t)
            np.sqrt(t, out=t)
            np.add(t, eps, out=t)
            np.divide(grad, t, out=t)
            np.multiply(buf, mu, out=buf)
            np.add(buf, t, out=buf)
            np.multiply(buf, lr, out=t)
            np.subtract(value, t, out=value)

        return shard(RMSprop(centered=True, momentum=0.9))[0], ref

    def adagrad() -> tuple[Update, Update]:
        acc, t = np.zeros_like(value), np.empty_like(value)

        def ref(step: int) -> None:
            np.multiply(grad, grad, out=t)
            np.add(acc, t, out=acc)
            np.sqrt(acc, out=t)
            np.add(t, 1e-10, out=t)
            np.divide(grad, t, out=t)
            np.multiply(t, 1e-2, out=t)
            np.subtract(value, t, out=value)

        return shard(Adagrad())[0], ref

    def ftrl() -> tuple[Update, Update]:
        acc, linear = np.full_like(value, 0.1), np.zeros_like(value)
        new, t = np.empty_like(value), np.empty_like(value)
        lr, l1 = 1e-3, 0.01

        def ref(step: int) -> None:
            np.multiply(grad, grad, out=new)
            np.add(acc, new, out=new)
            np.sqrt(new, out=t)
            np.sqrt(acc, out=acc)
            np.subtract(t, acc, out=acc)
            np.divide(acc, lr, out=acc)
            np.multiply(acc, value, out=acc)
            np.subtract(grad, acc, out=acc)
            np.add(linear, acc, out=linear)
            np.divide(t, lr, out=t)
            np.clip(linear, -l1, l1, out=value)
            np.subtract(value, linear, out=value)
            np.divide(value, t, out=value)
            np.copyto(acc, new)

        return shard(Ftrl(l1=l1))[0], ref

    return {
        "add": add,
        "sgd": sgd,
        "momentum": momentum,
        "adam": adam(),
        "adamw": adam(amsgrad=True, decay=1e-2),
        "rmsprop": rmsprop,
        "adagrad": adagrad,
        "ftrl": ftrl,
    }


def _child(n: int, reps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    from server.store.heap import keep_big_buffers

    keep_big_buffers()
    out: dict[str, dict[str, list[float]]] = {}
    for op, setup in _setups(n).items():
        mine, ref = setup()
        times: dict[str, list[float]] = {APPLY: [], NUMPY: []}
        for i in range(warmup + reps):
            # taking turns, each going first every other repetition
            order = [(APPLY, mine), (NUMPY, ref)][:: 1 if i % 2 else -1]
            for system, update in order:
                t0 = time.perf_counter()
                update(i + 1)
                if i >= warmup:
                    times[system].append(time.perf_counter() - t0)
        out[op] = times
        del mine, ref
    return out


if __name__ == "__main__":
    size, reps, warmup = (int(a) for a in sys.argv[1:4])
    print(json.dumps(_child(size, reps, warmup)))
