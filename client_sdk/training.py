"""A Downpour SGD loop helper: pull every ``n_fetch`` steps, push every ``n_push`` steps.

    loop = DownpourLoop(ps, ["layer1/kernel", "layer1/bias"], n_fetch=2, n_push=2)
    for _ in range(steps):
        params = loop.params()                      # pulls when due, else the cached copy
        loss, grads = loss_and_grads(params, X, y)  # your code, on your mini-batch
        loop.step(grads)                            # accumulates; push_async when due
    loop.finish()                                   # pushes what is left, then flush()

This is the bookkeeping of Downpour SGD (Dean et al., 2012) and nothing more: between pushes the
gradients are summed (or averaged, ``average=True``) in local float buffers; a push goes out
with :meth:`PSClient.push_async <client_sdk.PSClient.push_async>`, so the next gradient is
computed while it travels. ``server/demo/digits_worker.py`` (the demo's worker) writes the
same loop out by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._exceptions import ConfigError
from .client import PSClient

__all__ = ["DownpourLoop"]


class DownpourLoop:
    """One worker's Downpour schedule over ``names`` on ``ps``.

    ``n_fetch``: pull fresh values every n steps (the first :meth:`params` always pulls).
    ``n_push``: push every n steps the gradients accumulated since the last push.
    ``average``: push the mean of the accumulated gradients instead of their sum.
    ``counter``: a counter to :meth:`~client_sdk.PSClient.increment` once per step (e.g.
    ``"global_step"``), or ``None``.

    Blocking: :meth:`params` blocks while it pulls; :meth:`step` blocks only when it increments
    the counter or when the client already has ``max_inflight`` pushes in flight;
    :meth:`finish` blocks until every push was applied. Not thread-safe: one loop per
    training thread (the client itself may be shared). Errors are the client's
    :class:`~client_sdk.PSError` subclasses.
    """

    def __init__(
        self,
        ps: PSClient,
        names: Sequence[str],
        *,
        n_fetch: int = 1,
        n_push: int = 1,
        average: bool = False,
        counter: str | None = None,
    ) -> None:
        if isinstance(names, str) or not names:
            raise ConfigError(f"names must be a non-empty list of variable names, got {names!r}")
        for label, n in (("n_fetch", n_fetch), ("n_push", n_push)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{label} must be an int >= 1, got {n!r}")
        self.ps = ps
        self.names = list(names)
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.average = average
        self.counter = counter
        #: steps taken so far (calls to :meth:`step`)
        self.steps = 0
        #: the counter's value after the last step (``None`` without a counter)
        self.global_step: int | float | None = None
        self._params: dict[str, np.ndarray] | None = None
        self._fetched_at = 0
        self._acc: dict[str, np.ndarray] = {}
        self._accumulated = 0

    def params(self) -> dict[str, np.ndarray]:
        """The values to compute this step's gradient on: pulled if ``n_fetch`` steps have
        passed since the last pull (or on the first call), else the copy from then.
        The arrays are read-only."""
        if self._params is None or self.steps - self._fetched_at >= self.n_fetch:
            self._params = self.ps.pull(self.names)
            self._fetched_at = self.steps
        return self._params

    def step(self, grads: Mapping[str, Any]) -> int | float | None:
        """Record one step's gradients (name -> array-like; a subset of ``names`` is fine).

        Accumulates them, and every ``n_push`` steps hands the accumulated gradients to
        ``push_async``. Returns the counter's new value, or ``None`` without a counter.
        """
        unknown = set(grads) - set(self.names)
        if unknown:
            raise ConfigError(
                f"gradients for {sorted(unknown)}, which this loop does not "
                f"train; its names are {self.names}"
            )
        arrays = {name: np.asarray(grad) for name, grad in grads.items()}
        for name, g in arrays.items():  # check everything before changing anything
            if name in self._acc and self._acc[name].shape != g.shape:
                raise ConfigError(
                    f"gradient {name!r} has shape {list(g.shape)}, earlier "
                    f"ones {list(self._acc[name].shape)}"
                )
        for name, g in arrays.items():
            if name in self._acc:
                self._acc[name] += g
            else:  # a copy: the caller may reuse its buffers
                self._acc[name] = np.array(g, dtype=g.dtype if g.dtype.kind == "f" else np.float64)
        self._accumulated += 1
        self.steps += 1
        if self._accumulated >= self.n_push:
            self._push()
        if self.counter is not None:
            self.global_step = self.ps.increment(self.counter)
        return self.global_step

    def finish(self) -> None:
        """Push what is still accumulated, then wait until every push was applied
        (``flush``); raises :class:`~client_sdk.PushError` if one failed."""
        if self._accumulated:
            self._push()
        self.ps.flush()

    def _push(self) -> None:
        acc, n = self._acc, self._accumulated
        self._acc, self._accumulated = {}, 0
        if self.average and n > 1:
            for g in acc.values():
                g /= n
        if acc:
            self.ps.push_async(acc)
