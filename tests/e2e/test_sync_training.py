"""Sync training across processes: k workers in sync mode reach what one process reaches by
averaging the same k gradients per step, and a worker killed mid-run never hangs the rest.

The workers are ``tests/helpers/sync_worker.py`` run as separate processes against a real
fleet, each with :class:`client_sdk.training.SyncLoop`; their gradients are a function of
(worker, version, parameters), so the reference (``sync_worker.reference``) computes in this
process exactly what the fleet should have applied.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from client_sdk import PSClient
from client_sdk.placement import shard_for
from tests.conftest import ROOT, http_json
from tests.helpers import sync_worker


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start_worker(urls: list[str], worker: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.helpers.sync_worker",
            "--shards",
            ",".join(urls),
            "--worker",
            str(worker),
            *args,
        ],
        cwd=ROOT,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each worker's (exit status, output), waiting at most ``timeout`` seconds in all;
    workers still running then are killed and the test fails."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a sync worker did not finish within {timeout} s: it hangs")
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def variable(fleet, name: str) -> dict:
    """``GET /v1/variables/{name}`` of the shard that owns ``name``."""
    return http_json(f"{fleet.urls[shard_for(name, fleet.n)]}/v1/variables/{name}")


@pytest.mark.slow
def test_sync_workers_match_one_process_averaging_their_gradients(fleet_factory):
    workers, steps = 3, 20
    fleet = fleet_factory(2)
    procs = [
        start_worker(fleet.urls, i, "--replicas", str(workers), "--steps", str(steps))
        for i in range(workers)
    ]
    results = finish(procs, timeout=180)
    for status, text in results:
        assert status == 0, text
        assert "done" in text, text
    with PSClient(fleet.urls) as ps:
        got = ps.pull(list(sync_worker.NAMES))
    want = sync_worker.reference(list(range(workers)), steps)
    for name in sync_worker.NAMES:
        scale = float(np.max(np.abs(want[name]))) or 1.0
        assert np.max(np.abs(got[name] - want[name])) <= 1e-6 * scale, name
    for name in sync_worker.NAMES:
        v = variable(fleet, name)
        assert v["version"] == steps
        assert v["updates"] == steps
        assert v["rounds"]["filled"] == steps
        assert v["rounds"]["timed_out"] == 0
        assert v["counts"]["applied"] == steps * workers
        assert v["counts"]["dropped"] == 0


@pytest.mark.slow
def test_a_worker_killed_with_sigkill_never_hangs_the_others(fleet_factory):
    workers, steps, kill_after = 3, 12, 3
    fleet = fleet_factory(2)
    args = ("--replicas", str(workers), "--timeout", "0.5", "--steps", str(steps))
    procs = [start_worker(fleet.urls, i, *args) for i in range(workers)]
    victim = procs[-1]
    deadline = time.monotonic() + 120
    seen = []
    while time.monotonic() < deadline:  # follow the victim until it pushed a few steps
        line = victim.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(f"step {kill_after}"):
            os.kill(victim.pid, signal.SIGKILL)
            break
    assert victim.wait(30) == -signal.SIGKILL, "".join(seen)
    results = finish(procs[:-1], timeout=120)
    for status, text in results:
        assert status == 0, text
        done = json.loads(text.rsplit("done ", 1)[1])
        assert done["applied"] + done["accepted"] + done["dropped"] >= steps - kill_after
    timed_out = 0
    for name in sync_worker.NAMES:
        v = variable(fleet, name)
        assert v["version"] >= steps
        timed_out += v["rounds"]["timed_out"]
        assert v["round"] is None or v["round"]["contributors"] < workers
    assert timed_out >= 2  # the rounds after the kill timed out, on each variable
