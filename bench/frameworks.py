"""A framework worker's step next to the numpy worker's on the same model: pull the weights,
forward and backward on a fixed batch, push the gradients (and wait until they are applied).

The model is an MLP 784 -> 512 -> 512 -> 10 (ReLU, softmax cross-entropy; 669,706 float32
parameters, 2.7 MB, in 6 variables), on 1 shard with SGD. The systems:

* ``numpy worker`` (the reference): ``pull`` (read-only views of the reply), the gradients by
  hand in numpy, ``push_async(copy=False)`` and ``flush``;
* ``torch worker``: :func:`client_sdk.torch.bind`'s ``pull`` (received into the parameters'
  storage), torch autograd, its ``push`` (the ``.grad`` tensors lent, no copy) and ``flush``.
  Skipped, saying so, where torch is not installed;
* ``jax worker``: :func:`client_sdk.jax.bind`'s ``pull`` (a tree of jax arrays over the
  reply's own memory), a jitted ``jax.grad``, its ``push`` (the gradient arrays' own memory)
  and ``flush``. Skipped, saying so, where jax is not installed.

``ops/s`` is steps/s. Besides time, each row counts the bytes the SDK copies per step outside
the socket (``copied_bytes``, printed under the table), over a few steps after the timed ones:

* bytes written by ``np.copyto`` / ``np.concatenate`` while the SDK pulls and pushes (counted by
  wrapping the two; the SDK writes into a caller's buffer and puts parts together with them);
* numpy memory allocated at the peak of the push (``tracemalloc``: a copy of a gradient, a
  conversion, shows up here; a push sent from the gradients' own memory allocates nothing);
* numpy memory allocated at the peak of the pull beyond the reply's receive buffer (the bytes
  the socket delivers into: the parameters' bytes plus 64 KiB of headroom for the header).

torch's and jax's own allocations are not traced: for them the case checks that every torch
parameter kept its storage address through the step (a step that moved one fails the case),
and that the jax arrays a pull makes are the reply's memory (checked once, before the steps).
"""

from __future__ import annotations

import contextlib
import itertools
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .context import Context
from .timing import Stopwatch, summarize

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "JAX", "NUMPY", "TORCH", "render", "run"]

LAYERS = (784, 512, 512, 10)
BATCH = 64
NUMPY = "numpy worker"
TORCH = "torch worker"
JAX = "jax worker"
DESCRIPTION = (
    f"a worker's step (pull, forward/backward, push) on an MLP {'-'.join(map(str, LAYERS))}, "
    "1 shard; ops/s is steps/s; bytes copied per step below"
)
DEFAULT_SIZES = ()
#: Steps counted for copies (after the timed ones; tracemalloc slows allocation down).
COUNTED_STEPS = 3
#: Room for a reply's header in its receive buffer, beyond the values' bytes.
HEADER_ROOM = 64 * 1024


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient

    fleet = ctx.fleet(1)
    rng = np.random.default_rng(0)
    X = rng.random((BATCH, LAYERS[0]), dtype=np.float32)
    y = rng.integers(0, LAYERS[-1], BATCH)
    steps: dict[str, Callable[[], None]] = {}
    with contextlib.ExitStack() as stack:
        ps = stack.enter_context(PSClient(fleet.urls, worker_id="bench-frameworks-numpy"))
        steps[NUMPY] = _numpy_worker(ps, X, y)
        try:
            import torch  # noqa: F401
        except ImportError:
            print(
                "  frameworks: torch is not installed, so its row is skipped "
                "(pip install 'paramshard[torch]')",
                flush=True,
            )
        else:
            ps = stack.enter_context(PSClient(fleet.urls, worker_id="bench-frameworks-torch"))
            steps[TORCH] = _torch_worker(ps, X, y)
        try:
            import jax  # noqa: F401
        except ImportError:
            print(
                "  frameworks: jax is not installed, so its row is skipped "
                "(pip install 'paramshard[jax]')",
                flush=True,
            )
        else:
            ps = stack.enter_context(PSClient(fleet.urls, worker_id="bench-frameworks-jax"))
            steps[JAX] = _jax_worker(ps, X, y)
        return _measure(ctx, steps)


def _measure(ctx: Context, steps: dict[str, Callable[[], None]]) -> list[dict]:
    watches = {system: Stopwatch() for system in steps}
    order = list(steps)
    for i in range(ctx.warmup + ctx.reps):
        if i == ctx.warmup:
            for w in watches.values():
                w.samples.clear()
        for system in order[i % len(order) :] + order[: i % len(order)]:
            with watches[system]:
                steps[system]()
    nbytes = _param_bytes()
    rows = []
    for system, step in steps.items():
        copied = [_copied_in(step, nbytes) for _ in range(COUNTED_STEPS)]
        rows.append(
            {
                "case": "frameworks",
                "op": "step",
                "size": nbytes // 4,
                "label": "-".join(map(str, LAYERS)),
                "system": system,
                "reference": system == NUMPY,
                "param_bytes": nbytes,
                "copied_bytes": int(np.median(copied)),
                **summarize(watches[system].samples, nbytes),
            }
        )
    return rows


def _param_bytes() -> int:
    return sum(4 * (a * b + b) for a, b in itertools.pairwise(LAYERS))


def _numpy_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {}
    for i, (a, b) in enumerate(itertools.pairwise(LAYERS)):
        out[f"bench/frameworks/numpy/{i}/kernel"] = rng.standard_normal(
            (a, b), dtype=np.float32
        ) * np.float32(np.sqrt(2 / a))
        out[f"bench/frameworks/numpy/{i}/bias"] = np.zeros(b, np.float32)
    return out


def _numpy_grads(params: list[np.ndarray], X: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Cross-entropy gradients of the ReLU MLP whose kernels and biases alternate in
    ``params``, by hand."""
    acts = [X]
    for i in range(0, len(params), 2):
        z = acts[-1] @ params[i] + params[i + 1]
        acts.append(np.maximum(z, 0) if i + 2 < len(params) else z)
    logits = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    d = np.exp(logits)
    d /= d.sum(axis=1, keepdims=True)
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    grads: list[np.ndarray] = [np.empty(0)] * len(params)
    for i in range(len(params) - 2, -1, -2):
        grads[i], grads[i + 1] = acts[i // 2].T @ d, d.sum(axis=0)
        if i:
            d = (d @ params[i].T) * (acts[i // 2] > 0)
    return grads


def _numpy_worker(ps: Any, X: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    from client_sdk.optimizers import SGD

    init = _numpy_params()
    names = list(init)
    ps.init(init, optimizer=SGD(lr=1e-4))

    def step() -> None:
        pulled = ps.pull(names)
        grads = _numpy_grads([pulled[n] for n in names], X, y)
        ps.push_async(dict(zip(names, grads)), copy=False)
        ps.flush()

    return step


def _torch_worker(ps: Any, X: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    import torch

    from client_sdk.optimizers import SGD
    from client_sdk.torch import bind

    torch.manual_seed(1)
    torch.set_num_threads(1)  # leave the other core to the shard
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(LAYERS):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    bound = bind(ps, model, prefix="bench/frameworks/torch/", optimizer=SGD(lr=1e-4))
    bound.init()
    tx, ty = torch.from_numpy(X), torch.from_numpy(y)
    addresses = [p.data_ptr() for p in model.parameters()]

    def step() -> None:
        bound.pull()
        torch.nn.functional.cross_entropy(model(tx), ty).backward()
        bound.push()
        bound.flush()
        if [p.data_ptr() for p in model.parameters()] != addresses:
            raise RuntimeError("a parameter's storage moved during a step")

    return step


def _jax_worker(ps: Any, X: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    import jax
    import jax.numpy as jnp

    from client_sdk.jax import bind
    from client_sdk.optimizers import SGD

    init = _numpy_params()  # the numpy worker's initial values, as a tree {"0": {"kernel": ...}}
    layers = range(len(LAYERS) - 1)
    tree = {
        str(i): {
            "kernel": init[f"bench/frameworks/numpy/{i}/kernel"],
            "bias": init[f"bench/frameworks/numpy/{i}/bias"],
        }
        for i in layers
    }
    bound = bind(ps, tree, prefix="bench/frameworks/jax", optimizer=SGD(lr=1e-4))
    bound.init()

    def loss(params: Any, X: Any, y: Any) -> Any:
        h = X
        for i in layers:
            h = h @ params[str(i)]["kernel"] + params[str(i)]["bias"]
            if i != layers[-1]:
                h = jax.nn.relu(h)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], axis=1))

    grad = jax.jit(jax.grad(loss))
    tx, ty = jnp.asarray(X), jnp.asarray(y)

    def step() -> None:
        bound.push(grad(bound.pull(), tx, ty))
        bound.flush()

    # The pulled leaves (in the order of bound.names) are jax arrays of the reply's own
    # memory: the arrays the SDK returns, which a pull of nothing new returns again.
    leaves = jax.tree_util.tree_leaves(bound.pull())
    held = ps.pull(list(bound.names))
    if [a.unsafe_buffer_pointer() for a in leaves] != [held[n].ctypes.data for n in bound.names]:
        raise RuntimeError("a pulled jax array does not alias the reply's memory")
    return step


def _copied_in(step: Callable[[], None], param_bytes: int) -> int:
    """The bytes the SDK copied in one run of ``step`` (see the module's docstring)."""
    import client_sdk

    counted = [0]
    with _counting(counted), _traced():
        peaks: dict[str, int] = {}
        original = client_sdk.PSClient.pull, client_sdk.PSClient.push_async

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                try:
                    return fn(*args, **kwargs)
                finally:
                    peak = tracemalloc.get_traced_memory()[1] - before
                    peaks[name] = peaks.get(name, 0) + max(0, peak)

            return wrapper

        client_sdk.PSClient.pull = timed("pull", original[0])  # type: ignore[method-assign]
        client_sdk.PSClient.push_async = timed("push", original[1])  # type: ignore[method-assign]
        try:
            step()
        finally:
            client_sdk.PSClient.pull, client_sdk.PSClient.push_async = original  # type: ignore[method-assign]
    beyond_buffer = max(0, peaks.get("pull", 0) - param_bytes - HEADER_ROOM)
    return counted[0] + peaks.get("push", 0) + beyond_buffer


@contextlib.contextmanager
def _counting(counted: list[int]) -> Iterator[None]:
    """Count the bytes ``np.copyto`` and ``np.concatenate`` write while it is open."""
    copyto, concatenate = np.copyto, np.concatenate

    def counting_copyto(dst: Any, src: Any, *args: Any, **kwargs: Any) -> None:
        counted[0] += np.asarray(dst).nbytes
        copyto(dst, src, *args, **kwargs)

    def counting_concatenate(arrays: Any, *args: Any, **kwargs: Any) -> Any:
        out = concatenate(arrays, *args, **kwargs)
        counted[0] += out.nbytes
        return out

    np.copyto, np.concatenate = counting_copyto, counting_concatenate  # type: ignore[assignment]
    try:
        yield
    finally:
        np.copyto, np.concatenate = copyto, concatenate  # type: ignore[assignment]


@contextlib.contextmanager
def _traced() -> Iterator[None]:
    started = tracemalloc.is_tracing()
    if not started:
        tracemalloc.start()
    try:
        yield
    finally:
        if not started:
            tracemalloc.stop()


def render(rows: list[dict]) -> str:
    """The bytes copied per step outside the socket, beside the parameters' bytes."""
    mine = [r for r in rows if r["case"] == "frameworks"]
    if not mine:
        return ""
    lines = ["", "frameworks: bytes the SDK copied per step outside the socket"]
    for r in mine:
        lines.append(
            f"  {r['system']:<16}{r['copied_bytes']:>12,} bytes "
            f"({r['copied_bytes'] / r['param_bytes']:.2f}x the parameters' "
            f"{r['param_bytes']:,})"
        )
    return "\n".join(lines)
