"""The training loop helpers of ``client_sdk.training`` against a real shard: SyncLoop runs a
worker's side of sync rounds (pull, compute, push, wait for the round), and both loops count
what became of their gradients (applied, accepted, dropped).

Workers here are threads of this process, each with a client of its own; the cross-process run
(and a worker killed mid-run) is tests/e2e/test_sync_training.py.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from client_sdk import ConfigError, PSClient
from client_sdk.modes import Sync
from client_sdk.optimizers import SGD, Add
from client_sdk.training import DownpourLoop, SyncLoop


def fresh(prefix: str = "v") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def grad_of(worker: int, version: int, value: np.ndarray) -> np.ndarray:
    """A deterministic gradient: a function of (worker, version, value)."""
    return (value * 0.5 + worker + version).astype(value.dtype)


def run_threads(targets) -> None:
    errors: list[BaseException] = []

    def guard(fn):
        try:
            fn()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a worker thread hangs"
    if errors:
        raise errors[0]


def test_sync_loops_in_threads_apply_the_mean_of_each_round(fleet2):
    name, workers, steps = fresh(), 2, 6
    w0 = np.arange(4, dtype=np.float64)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({name: w0}, optimizer=SGD(lr=0.25), sync=Sync(replicas=workers, timeout=60))
    loops: dict[int, SyncLoop] = {}

    def worker(i: int) -> None:
        with PSClient(fleet2.urls, worker_id=fresh(f"w{i}")) as ps:
            loop = loops[i] = SyncLoop(ps, [name])
            while True:
                params = loop.params()
                version = loop.versions[name]
                if version >= steps:
                    break
                loop.step({name: grad_of(i, version, params[name])})
            loop.finish()

    run_threads([lambda i=i: worker(i) for i in range(workers)])
    want = w0.copy()
    for version in range(steps):
        mean = sum(grad_of(i, version, want) for i in range(workers)) / workers
        want = want - 0.25 * mean
    with PSClient(fleet2.urls) as ps:
        np.testing.assert_allclose(ps.pull([name])[name], want, rtol=1e-12)
    for loop in loops.values():
        assert loop.dropped == 0
        assert loop.applied + loop.accepted == steps


def test_a_sync_loop_whose_gradient_is_dropped_goes_on_with_the_newer_values(fleet2):
    name = fresh()
    with (
        PSClient(fleet2.urls, worker_id=fresh("w")) as fast,
        PSClient(fleet2.urls, worker_id=fresh("w")) as slow,
    ):
        fast.init({name: np.zeros(2)}, optimizer=Add(), sync=Sync(replicas=1, timeout=60))
        slow_loop = SyncLoop(slow, [name])
        slow_loop.params()  # version 0
        fast_loop = SyncLoop(fast, [name])
        fast_loop.params()
        fast_loop.step({name: np.ones(2)})  # fills the round alone: version 1
        result = slow_loop.step({name: np.ones(2) * 100})
        assert result[name]["status"] == "dropped"
        assert slow_loop.dropped == 1
        params = slow_loop.params()  # no wait: the variable is past the round it missed
        assert slow_loop.versions[name] == 1
        np.testing.assert_array_equal(params[name], [1.0, 1.0])


def test_a_downpour_loop_counts_its_dropped_and_scaled_gradients(fleet2):
    drop, scale = fresh(), fresh()
    with (
        PSClient(fleet2.urls, worker_id=fresh("w")) as fast,
        PSClient(fleet2.urls, worker_id=fresh("w")) as slow,
    ):
        fast.init({drop: np.zeros(2)}, optimizer=Add(), max_staleness=0)
        fast.init({scale: np.zeros(2)}, optimizer=Add(), max_staleness=0, staleness_policy="scale")
        loop = DownpourLoop(slow, [drop, scale], n_fetch=100)
        loop.params()  # version 0 of both
        fast.pull([drop, scale])
        fast.push({drop: np.ones(2), scale: np.ones(2)})  # both at version 1 now
        loop.step({drop: np.ones(2), scale: np.ones(2)})  # computed on 0: staleness 1
        loop.finish()
        assert (loop.applied, loop.dropped, loop.scaled) == (1, 1, 1)
        got = fast.pull([drop, scale])
        np.testing.assert_array_equal(got[drop], [1.0, 1.0])
        np.testing.assert_array_equal(got[scale], [1.5, 1.5])


def test_a_sync_loop_refuses_bad_arguments(fleet2):
    with PSClient(fleet2.urls) as ps:
        with pytest.raises(ConfigError):
            SyncLoop(ps, [])
        with pytest.raises(ConfigError):
            SyncLoop(ps, "w")
        loop = SyncLoop(ps, ["a"])
        with pytest.raises(ConfigError):
            loop.step({"b": np.ones(1)})
