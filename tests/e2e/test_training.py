"""Downpour SGD across processes: asynchronous workers reach what one process reaches.

The workers are the demo's own (``server.demo.digits_worker``, which ``examples/digits_worker.py``
runs), run as separate processes against a real fleet; the reference is the same model and
optimizer trained in this process (``server.demo.reference``, with the shard's own optimizer
code).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from client_sdk import ConfigError, PSClient
from client_sdk.optimizers import Add
from client_sdk.training import DownpourLoop
from server.demo import digits_worker as digits
from server.demo.reference import train_one_process
from tests.conftest import ROOT

#: The worker as users run it from a checkout: a thin entry that runs server.demo.digits_worker.
EXAMPLE = ROOT / "examples" / "digits_worker.py"


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSHARD_", "DIGITS_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_workers(
    urls: list[str], n: int, *args: str, timeout: float = 120.0
) -> list[tuple[int, str]]:
    """Run n digits workers at once; return each one's (exit status, output)."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.demo.digits_worker",
                "--shards",
                ",".join(urls),
                "--worker-index",
                str(i),
                "--num-workers",
                str(n),
                *args,
            ],
            cwd=ROOT,
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n)
    ]
    try:
        return [(p.wait(timeout), p.communicate()[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.slow
def test_async_workers_match_one_process(fleet_factory):
    workers, steps, batch, lr, seed = 3, 400, 32, 0.05, 3
    fleet = fleet_factory(3)
    results = run_workers(
        fleet.urls,
        workers,
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
        "--n-fetch",
        "2",
        "--lr",
        str(lr),
        "--seed",
        str(seed),
    )
    for i, (code, out) in enumerate(results):
        assert code == 0, f"worker {i} failed:\n{out}"
        assert f"[w{i}] step {steps}/{steps} loss" in out, out

    total = workers * steps
    with PSClient(fleet.urls, worker_id="test") as ps:
        params = ps.pull(list(digits.PARAM_NAMES))
        assert ps.increment(digits.STEP_COUNTER, 0) == total  # every step counted once
        summaries = {v["name"]: v for v in ps.variables()}
    for name in digits.PARAM_NAMES:  # every gradient applied exactly once
        assert summaries[name]["updates"] == total, summaries[name]
        assert summaries[name]["optimizer"]["type"] == "adagrad"
    assert {summaries[name]["shard"] for name in digits.PARAM_NAMES} == {1, 2}  # really sharded

    data = digits.load_data(seed)
    acc_ps = digits.accuracy(params, data.X_test, data.y_test)
    ref = train_one_process(data, steps=total, batch_size=batch, lr=lr, seed=seed)
    acc_ref = digits.accuracy(ref, data.X_test, data.y_test)
    assert acc_ref > 0.9, acc_ref
    assert acc_ps >= acc_ref - 0.02, (acc_ps, acc_ref)


def test_one_process_reference_learns_and_is_deterministic():
    data = digits.load_data(0)
    untrained = digits.accuracy(digits.init_params(0), data.X_test, data.y_test)
    a = train_one_process(data, steps=300, batch_size=32, lr=0.05, seed=0)
    b = train_one_process(data, steps=300, batch_size=32, lr=0.05, seed=0)
    for name in digits.PARAM_NAMES:
        np.testing.assert_array_equal(a[name], b[name])
    assert untrained < 0.3
    assert digits.accuracy(a, data.X_test, data.y_test) > 0.85


def test_data_split_is_shared_and_disjoint():
    a, b = digits.load_data(5), digits.load_data(5)
    np.testing.assert_array_equal(a.X_test, b.X_test)
    assert len(a.y_train) + len(a.y_test) == 1797
    train_rows = {row.tobytes() for row in a.X_train}
    overlap = sum(row.tobytes() in train_rows for row in a.X_test)
    assert overlap < 10  # the digits set has a few duplicate images, no more
    slices = [digits.worker_slice(len(a.y_train), i, 3) for i in range(3)]
    assert sorted(np.concatenate(slices).tolist()) == list(range(len(a.y_train)))


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    params = {
        k: v.astype(np.float64) + rng.normal(0, 0.1, v.shape)
        for k, v in digits.init_params(1).items()
    }
    data = digits.load_data(1)
    X, y = data.X_train[:16].astype(np.float64), data.y_train[:16]
    _, grads = digits.loss_and_grads(params, X, y)
    eps = 1e-5
    for name in digits.PARAM_NAMES:
        flat = params[name].reshape(-1)
        for j in rng.choice(flat.size, size=5, replace=False):
            old = flat[j]
            flat[j] = old + eps
            up, _ = digits.loss_and_grads(params, X, y)
            flat[j] = old - eps
            down, _ = digits.loss_and_grads(params, X, y)
            flat[j] = old
            numeric = (up - down) / (2 * eps)
            assert abs(numeric - grads[name].reshape(-1)[j]) < 1e-4, (name, j)


def test_worker_rejects_bad_arguments():
    for args, message in (
        (["--worker-index", "3", "--num-workers", "3"], "--worker-index must be in 0..2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--worker-index", "first"], "expected an integer or 'auto'"),
        (["DIGITS_WORKER_INDEX=first"], "DIGITS_WORKER_INDEX must be an integer or 'auto'"),
    ):
        env = worker_env()
        if args[0].startswith("DIGITS_"):
            key, _, value = args.pop().partition("=")
            env[key] = value
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), "--shards", "http://127.0.0.1:9", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc
        assert message in proc.stderr, proc.stderr


def test_auto_indexed_replicas_claim_distinct_indices(fleet_factory):
    # `docker compose up --scale worker=3`: identical containers, DIGITS_WORKER_INDEX=auto.
    fleet = fleet_factory(2)
    env = {
        **worker_env(),
        "PARAMSHARD_SHARDS": ",".join(fleet.urls),
        "DIGITS_WORKER_INDEX": "auto",
        "DIGITS_STEPS": "20",
        "DIGITS_LOG_EVERY": "10",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "server.demo.digits_worker"],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    claimed = sorted(int(out.split("claimed worker index ")[1].split()[0]) for out in outs)
    assert claimed == [0, 1, 2]
    with PSClient(fleet.urls, worker_id="check") as ps:
        assert ps.pull(["global_step"])["global_step"] == 3 * 20
        assert ps.increment(digits.WORKER_COUNTER, 0) == 3


def test_worker_reports_a_conflicting_fleet(fleet2):
    # Someone else's "layer1/kernel" with another shape: the worker must stop with a clear error.
    with PSClient(fleet2.urls, worker_id="other") as ps:
        ps.init({"layer1/kernel": np.zeros((2, 2), np.float32)})
    [(code, out)] = run_workers(fleet2.urls, 1, "--steps", "5")
    assert code == 1, out
    assert "[w0] error:" in out and "layer1/kernel" in out, out


# -- client_sdk.training.DownpourLoop ---------------------------------------------------------


def test_downpour_loop_schedule(fleet2):
    with PSClient(fleet2.urls, worker_id="loop") as ps:
        ps.init(
            {"loop/x": np.zeros(3, np.float32), "loop/y": np.zeros(2, np.float32)}, optimizer=Add()
        )
        loop = DownpourLoop(ps, ["loop/x", "loop/y"], n_fetch=3, n_push=2, counter="loop/step")
        fetched = []
        for _ in range(5):
            params = loop.params()
            fetched.append(params)
            loop.step({"loop/x": np.ones(3, np.float32)})  # "loop/y" gets no gradient
        loop.finish()
        assert [f is fetched[0] for f in fetched] == [True, True, True, False, False]
        assert fetched[3] is fetched[4]
        assert loop.steps == 5 and loop.global_step == 5
        final = ps.pull(["loop/x", "loop/y"])
        np.testing.assert_array_equal(final["loop/x"], np.full(3, 5.0))  # 2 + 2 + 1
        np.testing.assert_array_equal(final["loop/y"], np.zeros(2))
        updates = {v["name"]: v["updates"] for v in ps.variables()}
        assert updates["loop/x"] == 3 and updates["loop/y"] == 0  # pushes, not steps

        ps.init({"loop/avg": np.zeros(2, np.float32)}, optimizer=Add())
        avg = DownpourLoop(ps, ["loop/avg"], n_push=2, average=True)
        for value in (1.0, 3.0, 10.0):
            avg.step({"loop/avg": np.full(2, value, np.float32)})
        avg.finish()
        assert avg.global_step is None
        np.testing.assert_array_equal(ps.pull(["loop/avg"])["loop/avg"], np.full(2, 12.0))


def test_downpour_loop_rejects_bad_arguments():
    with PSClient(["http://127.0.0.1:9"], worker_id="loop") as ps:  # no I/O happens
        for kwargs in ({"n_fetch": 0}, {"n_push": 1.5}, {"n_push": True}):
            with pytest.raises(ConfigError):
                DownpourLoop(ps, ["a"], **kwargs)
        with pytest.raises(ConfigError):
            DownpourLoop(ps, "a")
        loop = DownpourLoop(ps, ["a"], n_push=5)
        with pytest.raises(ConfigError, match="does not train"):
            loop.step({"b": np.ones(1)})
        loop.step({"a": np.ones(2)})
        with pytest.raises(ConfigError, match="shape"):
            loop.step({"a": np.ones(3)})
