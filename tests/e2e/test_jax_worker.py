"""examples/jax_worker.py: asynchronous JAX worker processes train the digits network through
``client_sdk.jax`` on a real 2-shard fleet, and reach what the same training reaches in one
process with JAX.

The example runs as users run it (``run --workers 2``: the workers are processes it starts);
the reference is its ``train_reference`` in this process (the same network, initial weights,
Adagrad and number of gradient steps, with no parameter server). The check is the one the
example states: the fleet's held-out accuracy within 1 point of the reference's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys

import pytest

from client_sdk import PSClient
from tests.conftest import ROOT

pytest.importorskip("jax")

SCRIPT = ROOT / "examples" / "jax_worker.py"
_spec = importlib.util.spec_from_file_location("jax_worker", SCRIPT)
assert _spec is not None and _spec.loader is not None
jw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jw)

_RESULT = re.compile(r"held-out accuracy ([0-9.]+) \(fleet, 2 workers x 400 steps\)")


def _example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_async_jax_workers_match_one_process(fleet_factory):
    fleet = fleet_factory(2)
    workers, steps, seed = 2, 400, 1
    args = [f"--workers={workers}", f"--steps={steps}", f"--seed={seed}", "--prefix=jx"]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "run", *args, f"--shards={','.join(fleet.urls)}"],
        cwd=ROOT,
        env=_example_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the workers it starts are killed with it
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    found = _RESULT.search(out)
    assert found, out[-3000:]
    acc_fleet = float(found.group(1))

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
