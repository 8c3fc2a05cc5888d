"""A sparse model end to end: ``examples/matrix_factorization.py``, two embedding tables trained by
4 asynchronous worker processes through ``pull_rows`` / ``push_rows`` on a real 2-shard fleet.

The example runs as users run it (``run --workers 4``), and the check is the one its README
section states: the test RMSE is within 10% of the noise floor (the noise's standard deviation,
below which no model can go), far below predicting the mean. Its numpy reference (the same
training in one process) and its gradients are checked here in one process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys

import httpx2
import numpy as np
import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "examples" / "matrix_factorization.py"
_spec = importlib.util.spec_from_file_location("matrix_factorization", SCRIPT)
assert _spec is not None and _spec.loader is not None
mf = importlib.util.module_from_spec(_spec)
sys.modules["matrix_factorization"] = mf  # dataclasses look their module up there
_spec.loader.exec_module(mf)

_RESULT = re.compile(r"test RMSE ([0-9.]+) = ([0-9.]+)x the noise floor ([0-9.]+)")


def _example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(*args: str, timeout: float) -> str:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=_example_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the workers it starts are killed with it
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_four_asynchronous_workers_reach_the_noise_floor(fleet_factory):
    fleet = fleet_factory(2)
    out = _run("run", "--shards", ",".join(fleet.urls), "--workers", "4", timeout=240)
    found = _RESULT.search(out)
    assert found, out[-3000:]
    rmse, ratio, floor = (float(g) for g in found.groups())
    assert floor == pytest.approx(0.3) and ratio == pytest.approx(rmse / floor, abs=1e-3)
    assert ratio <= mf.TARGET, out[-3000:]
    for k in range(4):  # every worker ran every epoch
        assert f"[w{k}] epoch {mf.EPOCHS}/{mf.EPOCHS}" in out, out[-3000:]
    # the fleet's rows give the RMSE the run printed; every user and item has one row, both
    # shards hold some of each table, and each shard applied every push: a table's version
    # counts the pushes applied to it, one per worker step (each batch reaches both shards)
    from client_sdk import PSClient

    data = mf.make_ratings()
    with PSClient(fleet.urls, worker_id="check") as ps:
        assert mf.evaluate(ps, data, "mf") == pytest.approx(rmse, abs=1e-4)
    steps = 4 * mf.EPOCHS * -(-data.part(0, 4)[2].size // mf.BATCH)
    for name, ids in zip(mf.table_names("mf"), (data.train_users, data.train_items)):
        tables = [httpx2.get(f"{url}/v1/tables/{name}", timeout=10).json() for url in fleet.urls]
        rows = [t["rows"] for t in tables]
        assert min(rows) > 0 and sum(rows) == np.unique(ids).size
        assert [t["version"] for t in tables] == [steps, steps]


def test_the_numpy_reference_reaches_the_target_and_the_mean_does_not():
    data = mf.make_ratings()
    assert data.train_users.dtype == np.int64 and data.test_ratings.dtype == np.float32
    assert data.test_ratings.size == 25_000 and data.train_ratings.size == 225_000
    rmse = mf.train_reference(data, mf.EPOCHS, mf.BATCH)
    assert rmse <= mf.TARGET * data.noise
    assert mf.mean_rmse(data) > 3 * data.noise  # what learning nothing scores


def test_the_gradients_are_those_of_the_loss():
    rng = np.random.default_rng(1)
    p, q = rng.normal(size=(2, 5, mf.DIM))
    r = rng.normal(size=5)

    def loss(p, q):
        err = (p * q).sum(axis=1) - r
        return 0.5 * err @ err + mf.REG / 2 * ((p * p).sum() + (q * q).sum())

    _, gp, gq = mf.gradients(p, q, r)
    h = 1e-6
    for row, col in [(0, 0), (3, 5), (4, 7)]:
        d = np.zeros_like(p)
        d[row, col] = h
        assert gp[row, col] == pytest.approx((loss(p + d, q) - loss(p - d, q)) / (2 * h), rel=1e-5)
        assert gq[row, col] == pytest.approx((loss(p, q + d) - loss(p, q - d)) / (2 * h), rel=1e-5)
