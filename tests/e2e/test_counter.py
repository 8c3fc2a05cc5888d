"""``increment`` is an atomic fetch-and-add: many callers, every value handed out once."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import uuid

from client_sdk import PSClient
from tests.conftest import ROOT

PROCESSES = 6
INCREMENTS = 100

WORKER = """
import json, sys
from client_sdk import PSClient
shards, name, count = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
with PSClient(shards) as ps:
    print(json.dumps([ps.increment(name) for _ in range(count)]))
"""


def test_processes_incrementing_one_counter_get_distinct_values(fleet2):
    name = f"global_step_{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, ",".join(fleet2.urls), name, str(INCREMENTS)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    seen: list[int] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            values = json.loads(out)
            assert len(values) == INCREMENTS
            assert values == sorted(values)  # one caller sees its own values increase
            seen += values
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    total = PROCESSES * INCREMENTS
    assert sorted(seen) == list(range(1, total + 1))
    with PSClient(fleet2.urls) as ps:
        assert ps.increment(name, 0) == total
        assert int(ps.pull([name])[name]) == total


def test_threads_sharing_a_client_get_distinct_values(fleet2):
    name = f"counter_{uuid.uuid4().hex[:8]}"
    with PSClient(fleet2.urls) as ps:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            values = list(pool.map(lambda _: ps.increment(name), range(200)))
        assert sorted(values) == list(range(1, 201))


def test_float_counter_and_deltas(fleet2):
    name = f"loss_sum_{uuid.uuid4().hex[:8]}"
    with PSClient(fleet2.urls) as ps:
        assert ps.increment(name, 0.5) == 0.5
        assert ps.increment(name, 2.25) == 2.75
        steps = f"steps_{uuid.uuid4().hex[:8]}"
        assert ps.increment(steps, 10) == 10
        assert ps.increment(steps, -3) == 7
        assert isinstance(ps.increment(steps), int)
