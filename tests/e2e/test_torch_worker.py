"""``examples/torch_worker.py``: 3 asynchronous torch worker processes train the digits MLP on a
real 2-shard fleet, run as users run it (``run --workers 3``).

The check is the one the issue states: the held-out accuracy of the fleet's weights is within
1 point of the same training in one process with torch (the example prints both), which takes
the workers' mini-batches in turn. The workers start stepping together (each creates a ready
mark and waits for every worker's), so their steps interleave as the reference's do however
unevenly a loaded machine starts the processes: run one after another, the workers leave the
fleet trained last on one worker's slice, up to 1.5 points below the reference. Every gradient
reached the shards once: each parameter was updated workers x steps times. Torch is imported by
4 processes (the run and its 3 workers): that is most of the test's time.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.conftest import ROOT
from tests.helpers.examples import run_example

torch = pytest.importorskip("torch")

SCRIPT = ROOT / "examples" / "torch_worker.py"
_RESULT = re.compile(r"held-out accuracy: fleet ([0-9.]+), one process ([0-9.]+)")
WORKERS, STEPS = 3, 400


@pytest.mark.slow
def test_three_torch_workers_match_one_process_within_a_point(fleet_factory):
    fleet = fleet_factory(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    args = ["run", "--shards", ",".join(fleet.urls), f"--workers={WORKERS}", f"--steps={STEPS}"]
    out = run_example(SCRIPT, args, env, timeout=300)
    for k in range(WORKERS):
        assert f"[w{k}] step {STEPS}/{STEPS} loss" in out, out[-3000:]
    found = _RESULT.search(out)
    assert found, out[-3000:]
    fleet_acc, one_process = (float(g) for g in found.groups())
    assert one_process > 0.95, out[-3000:]
    assert abs(fleet_acc - one_process) <= 0.01, out[-3000:]

    from client_sdk import PSClient

    with PSClient(fleet.urls, worker_id="check") as ps:
        summaries = {v["name"]: v for v in ps.variables() if "name" in v}
    for k in range(WORKERS):
        assert f"torch-digits/ready/{k}" in summaries, sorted(summaries)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        name = "torch-digits/" + name
        assert summaries[name]["updates"] == WORKERS * STEPS, summaries[name]
        assert summaries[name]["optimizer"]["type"] == "adagrad"
