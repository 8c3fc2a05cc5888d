"""A learner with actors: ``examples/cartpole_actors.py`` on gymnasium's CartPole, across processes.

The example runs as users run it (``cartpole_actors.py run``: one learner process and several
actor processes) against a real 2-shard fleet; the actors wait for each new policy with
``pull(..., newer_than="cached")`` and the learner for their experience the same way. The check
is the one the README states: the mean return climbs well above a random policy's (~22 steps).
The policy gradient itself is checked against finite differences here, in one process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "examples" / "cartpole_actors.py"
_spec = importlib.util.spec_from_file_location("cartpole_actors", SCRIPT)
assert _spec is not None and _spec.loader is not None
cartpole = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cartpole)

#: A random policy keeps the pole up ~22 steps; the run must reach well above that.
RANDOM_RETURN = 22.0


def example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSHARD_", "CARTPOLE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_the_learner_and_its_actors_learn_cartpole(fleet_factory):
    fleet = fleet_factory(2)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "run",
            "--shards",
            ",".join(fleet.urls),
            "--actors",
            "3",
            "--updates",
            "150",
            "--target",
            "150",
            "--wait",
            "10",
        ],
        cwd=ROOT,
        env=example_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the learner and actors it starts are killed with it
    )
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    final = re.search(r"final mean return ([0-9.]+) after (\d+) episodes", out)
    assert final, out[-3000:]
    assert float(final.group(1)) >= 100 > 4 * RANDOM_RETURN, out[-3000:]
    first = re.search(r"update 1 .* return ([0-9.]+)", out)
    assert first and float(first.group(1)) < 60, out[-3000:]  # it started near random


def test_the_policy_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    policy = {k: v.astype(np.float64) for k, v in cartpole.init_policy(3).items()}
    policy["cartpole/w2"] = rng.normal(0, 0.3, policy["cartpole/w2"].shape)
    obs = rng.normal(0, 1, (12, cartpole.N_OBS))
    actions = rng.integers(0, 2, 12)
    advantages = rng.normal(0, 1, 12)

    def loss(p: dict[str, np.ndarray]) -> float:
        probs = cartpole.action_probs(p, obs)[1]
        return float(-np.mean(advantages * np.log(probs[np.arange(12), actions])))

    grads = cartpole.policy_gradient(policy, obs, actions, advantages)
    eps = 1e-6
    for name, value in policy.items():
        for index in [(0,) * value.ndim, tuple(s - 1 for s in value.shape)]:
            up, down = dict(policy), dict(policy)
            up[name], down[name] = value.copy(), value.copy()
            up[name][index] += eps
            down[name][index] -= eps
            numeric = (loss(up) - loss(down)) / (2 * eps)
            assert grads[name][index] == pytest.approx(numeric, rel=1e-5, abs=1e-8), name


def test_the_example_refuses_bad_arguments():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--actors", "0"],
        cwd=ROOT,
        env=example_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--actors must be at least 1" in proc.stderr
