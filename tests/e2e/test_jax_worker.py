"""examples/jax_worker.py and examples/keras_worker.py: the digits network trained through
``client_sdk.jax`` by worker processes on a real 2-shard fleet.

Each example runs as users run it (``run``: the workers are processes it starts). The JAX
workers (2, asynchronous) must reach what the same training reaches in one process with JAX:
the example's ``train_reference`` in this process (the same network, initial weights, Adagrad
and number of gradient steps, with no parameter server), within 1 point of held-out accuracy.
The Keras 3 worker (one, on the JAX backend: Keras imports take seconds per process) must learn
(held-out accuracy above 0.93; untrained it is about 0.1), its weights the fleet's variables
under the names its layers give.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from client_sdk import PSClient
from tests.conftest import ROOT
from tests.helpers.examples import run_example

pytest.importorskip("jax")

SCRIPT = ROOT / "examples" / "jax_worker.py"
_spec = importlib.util.spec_from_file_location("jax_worker", SCRIPT)
assert _spec is not None and _spec.loader is not None
jw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jw)

_RESULT = re.compile(r"held-out accuracy ([0-9.]+) \(fleet, ")


@pytest.fixture(scope="module")
def fleet(module_fleet_factory):
    return module_fleet_factory(2)


def run_script(script: str, *args: str) -> float:
    """Run ``examples/<script> run *args``; its fleet's held-out accuracy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSHARD_", "KERAS_"))}
    out = run_example(ROOT / "examples" / script, ["run", *args], env, timeout=240)
    found = _RESULT.search(out)
    assert found, out[-3000:]
    return float(found.group(1))


@pytest.mark.slow
def test_async_jax_workers_match_one_process(fleet):
    workers, steps, seed = 2, 800, 1
    shards = ",".join(fleet.urls)
    acc_fleet = run_script(
        "jax_worker.py", f"--workers={workers}", f"--steps={steps}", f"--seed={seed}",
        "--prefix=jx", f"--shards={shards}",
    )  # fmt: skip

    with PSClient(fleet.urls, worker_id="test") as ps:
        summaries = {v["name"]: v for v in ps.variables()}
    names = ["jx/layer1/kernel", "jx/layer1/bias", "jx/layer2/kernel", "jx/layer2/bias"]
    for name in names:  # every gradient of every worker applied once, with Adagrad
        assert summaries[name]["updates"] == workers * steps, summaries[name]
        assert summaries[name]["optimizer"]["type"] == "adagrad"

    data = jw.load_data(seed)
    ref = jw.train_reference(data, steps=workers * steps, batch_size=32, lr=0.05, seed=seed)
    acc_ref = jw.accuracy(ref, data)
    assert acc_ref > 0.93, acc_ref
    assert acc_fleet >= acc_ref - 0.01, (acc_fleet, acc_ref)


@pytest.mark.slow
def test_a_keras_model_trains_through_the_fleet(fleet):
    if importlib.util.find_spec("keras") is None:  # imported by the example's workers only
        pytest.skip("keras is not installed: pip install -e '.[test]'")
    shards = ",".join(fleet.urls)
    acc = run_script("keras_worker.py", "--workers=1", "--steps=400", f"--shards={shards}")
    assert acc > 0.93, acc
    with PSClient(fleet.urls, worker_id="test") as ps:
        summaries = {v["name"]: v for v in ps.variables() if v["name"].startswith("digits-keras/")}
    assert sorted(summaries) == sorted(
        f"digits-keras/{w}"
        for w in ("hidden/kernel", "hidden/bias", "scores/kernel", "scores/bias")
    )
    assert {s["updates"] for s in summaries.values()} == {400}
