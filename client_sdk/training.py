"""The training loops a worker runs: Downpour (async) and sync rounds, each pull/compute/push.

    loop = DownpourLoop(ps, ["layer1/kernel", "layer1/bias"], n_fetch=2, n_push=2)
    for _ in range(steps):
        params = loop.params()                      # pulls when due, else the cached copy
        loss, grads = loss_and_grads(params, X, y)  # your code, on your mini-batch
        loop.step(grads)                            # accumulates; push_async when due
    loop.finish()                                   # pushes what is left, then flush()

:class:`DownpourLoop` is the bookkeeping of Downpour SGD (Dean et al., 2012) and nothing more:
between pushes the gradients are summed (or averaged, ``average=True``) in local float buffers;
a push goes out with :meth:`PSClient.push_async <client_sdk.PSClient.push_async>`, so the next
gradient is computed while it travels. ``server/demo/digits_worker.py`` (the demo's worker)
writes the same loop out by hand.

:class:`SyncLoop` is a worker's side of sync training, for variables made with
``init(..., sync=Sync(replicas=k))`` (:mod:`client_sdk.modes`): each step computes on the
parameters of one version, pushes the gradient into that version's round, and the next
:meth:`~SyncLoop.params` waits until the round has closed (its mean applied) before it pulls::

    loop = SyncLoop(ps, ["layer1/kernel", "layer1/bias"])
    for _ in range(steps):
        params = loop.params()          # the parameters after the last round this worker joined
        loop.step(grads_of(params))     # joins the round on loop.versions
    loop.finish()                       # waits for the last round

Both count what became of their gradients (``applied``, ``accepted`` into a round,
``dropped`` as too stale, ``scaled``), from the push results (docs/PROTOCOL.md §3, Training
modes).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._exceptions import ConfigError, NotReadyError
from .client import PSClient
from .modes import MAX_ROUND_TIMEOUT

__all__ = ["DownpourLoop", "SyncLoop"]

#: The longest one wait for a round SyncLoop asks the shards for (they hold a poll 30 s at most);
#: between two it checks whether a shard came back from an older snapshot.
_WAIT = 30.0


class DownpourLoop:
    """One worker's Downpour schedule over ``names`` on ``ps``.

    ``n_fetch``: pull fresh values every n steps (the first :meth:`params` always pulls).
    ``n_push``: push every n steps the gradients accumulated since the last push.
    ``average``: push the mean of the accumulated gradients instead of their sum.
    ``counter``: a counter to :meth:`~client_sdk.PSClient.increment` once per step (e.g.
    ``"global_step"``), or ``None``.

    ``applied``, ``dropped`` and ``scaled`` count the gradients (one per variable and push)
    the shards applied, dropped as staler than their ``max_staleness``, and applied with a
    scaled step, as the pushes' results come in; all of them once :meth:`finish` returned.

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
        #: gradients applied (scaled ones included), dropped, and applied with a scaled step;
        #: and accepted into a sync round (a sync variable's; SyncLoop is its loop)
        self.applied = 0
        self.dropped = 0
        self.scaled = 0
        self.accepted = 0
        self._pending: list[concurrent.futures.Future[dict[str, dict[str, Any]]]] = []

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
        try:
            self.ps.flush()
        finally:
            self._tally(wait=True)

    def _tally(self, wait: bool = False) -> None:
        """Count the results of the pushes that finished (``wait``: of all, once finished)."""
        still = []
        for future in self._pending:
            if not (wait or future.done()):
                still.append(future)
                continue
            if future.exception() is None:
                _count(self, future.result())
        self._pending = still

    def _push(self) -> None:
        acc, n = self._acc, self._accumulated
        self._acc, self._accumulated = {}, 0
        if self.average and n > 1:
            for g in acc.values():
                g /= n
        if acc:
            self._pending.append(self.ps.push_async(acc))
            self._tally()


def _count(loop: DownpourLoop | SyncLoop, results: Mapping[str, Mapping[str, Any]]) -> None:
    """Add a push's per-variable results to ``loop``'s counts."""
    for result in results.values():
        status = result.get("status")
        if status == "applied":
            loop.applied += 1
            if result.get("scale") is not None:
                loop.scaled += 1
        elif status == "accepted":
            loop.accepted += 1
        elif status == "dropped":
            loop.dropped += 1


class SyncLoop:
    """One worker's side of sync training over ``names`` on ``ps`` (variables made with
    ``init(..., sync=Sync(...))``; see the module docstring).

    :meth:`params` returns the parameters of one version (``versions`` says which), waiting
    first until every round this worker's last :meth:`step` joined has closed; :meth:`step`
    pushes the step's gradients, computed on those parameters, into their rounds and returns
    the push's per-variable results. A gradient dropped as stale (its round closed without it,
    e.g. a backup worker's) is counted in ``dropped``, and the next :meth:`params` returns the
    newer parameters without waiting.

    ``timeout``: the longest one :meth:`params` waits for rounds to close, in seconds (default:
    a round's longest timeout, :data:`~client_sdk.modes.MAX_ROUND_TIMEOUT`, plus a minute). A
    round closes at most its own ``timeout`` after its first gradient, however many workers
    died; past this wait :class:`~client_sdk.NotReadyError` is raised (``missing``: the names
    whose round did not close).

    ``applied`` counts the gradients that closed a round, ``accepted`` those that joined one
    still open (applied when it closed), ``dropped`` those dropped; ``steps`` the calls to
    :meth:`step`. Blocking: :meth:`params` and :meth:`step` block (a pull, a push). Not
    thread-safe: one loop per training thread. Errors are the client's
    :class:`~client_sdk.PSError` subclasses.
    """

    def __init__(self, ps: PSClient, names: Sequence[str], *, timeout: float | None = None) -> None:
        if isinstance(names, str) or not names:
            raise ConfigError(f"names must be a non-empty list of variable names, got {names!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ConfigError(f"timeout must be a number of seconds above 0, got {timeout!r}")
        self.ps = ps
        self.names = list(names)
        self.timeout = MAX_ROUND_TIMEOUT + 60.0 if timeout is None else float(timeout)
        #: the version of each parameter :meth:`params` last returned
        self.versions: dict[str, int] = {}
        self.steps = 0
        self.applied = 0
        self.accepted = 0
        self.dropped = 0
        self.scaled = 0
        self._params: dict[str, np.ndarray] | None = None
        #: name -> the version to wait for: one past the round the last step joined
        self._targets: dict[str, int] = {}

    def params(self) -> dict[str, np.ndarray]:
        """The parameters to compute the next step on (read-only arrays): pulled once every
        round the last :meth:`step` joined has closed, so every worker of a round computes on
        the same version."""
        if self._params is None or self._targets:
            self._params = self._wait_and_pull()
        return self._params

    def step(self, grads: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Push one step's gradients (name -> array-like, a subset of ``names``), computed on
        the parameters :meth:`params` returned, into the rounds on ``versions``; returns the
        per-variable results (``"accepted"``, ``"applied"`` for the one that closed a round,
        ``"dropped"``)."""
        unknown = set(grads) - set(self.names)
        if unknown:
            raise ConfigError(
                f"gradients for {sorted(unknown)}, which this loop does not "
                f"train; its names are {self.names}"
            )
        if self._params is None or self._targets:
            raise ConfigError("call params() first: a step's gradients are computed on them")
        versions = {name: self.versions[name] for name in grads}
        results = self.ps.push(grads, versions)
        self.steps += 1
        _count(self, results)
        self._targets = {name: v + 1 for name, v in versions.items()}
        return results

    def finish(self) -> None:
        """Wait until every round the last :meth:`step` joined has closed (its mean is
        applied); then ``versions`` and :meth:`params` are the result."""
        if self._targets:
            self._params = self._wait_and_pull()

    def _wait_and_pull(self) -> dict[str, np.ndarray]:
        """Wait until each name has reached its target version (a round it joined closed:
        ``pull(..., min_version=...)``, which the shards answer when the round's mean is
        applied), then pull ``names`` and note their versions."""
        deadline = time.monotonic() + self.timeout
        params: dict[str, np.ndarray] | None = None
        while self._targets:
            groups: dict[int, list[str]] = {}
            for name, target in self._targets.items():
                groups.setdefault(target, []).append(name)
            for target, group in groups.items():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotReadyError(
                        f"the sync round(s) of {sorted(self._targets)[:10]} did not close within "
                        f"{self.timeout:g} s of this worker's gradient: check the shards "
                        "(paramshard status) and the variables' sync timeout",
                        missing=sorted(self._targets),
                    )
                try:
                    got = self.ps.pull(group, min_version=target, timeout=min(left, _WAIT))
                except NotReadyError:
                    continue
                for name in group:
                    del self._targets[name]
                if len(group) == len(self.names):  # one round for all: these are the params
                    params = got
            if self._targets:
                # A variable below the version it pushed on came back from an older snapshot
                # (its shard restarted after a crash): its round is gone, the next step starts
                # anew; a plain pull says so.
                self.ps.pull(list(self._targets))
                held = self.ps.versions(list(self._targets))
                for name, target in list(self._targets.items()):
                    if not target - 1 <= held.get(name, -1) < target:
                        del self._targets[name]
        if params is None:
            params = self.ps.pull(self.names)
        self.versions = self.ps.versions(self.names)
        return params
