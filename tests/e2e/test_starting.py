"""``GET /v1/cluster`` from the moment a shard's port opens until its process exits: never a 5xx.

Each test starts one shard process on a port picked for it (tests/helpers/replicas.py's
``free_ports``) and asks ``GET /v1/cluster`` on a new connection, over and over, from before
the process listens (refused connections are retried) through its start (restore, campaign,
backup links), a while of serving, and its stop (SIGTERM: draining, final snapshot) until it
exits. Every answer must be a 200 whose body says what the shard is; the states it passes
through (restoring, no primary yet, draining) are for the body to say, never a 500. Cases: a
plain shard, a shard restoring from its data dir, a replica of a static group whose other
replica is down, and a replica electing its primary in etcd. A part of the answer that raises
(a bug, injected into the shard's process) is named in ``errors`` and the rest answered.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from client_sdk import PSClient
from tests.conftest import ROOT
from tests.helpers.replicas import free_ports

#: Answers asked for once the shard first answered, before it is told to stop.
SERVING_ANSWERS = 50
#: Seconds a case may take at most (a hang, not a measure).
BOUND = 60.0


def _ask(port: int) -> tuple[int, bytes] | None:
    """One ``GET /v1/cluster`` on a new connection: (status, body), or ``None`` when the
    connection is refused or broken (the process not listening yet, or gone)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /v1/cluster HTTP/1.1\r\nhost: shard\r\nconnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(1 << 16):
                data += chunk
    except OSError:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None  # closed before answering (the process stopping)
    return int(parts[1]), body


def _hammer(workdir, args: list[str], port: int | None = None) -> dict[str, int]:
    """Start ``paramshard serve --port P *args`` (``{port}`` in ``args`` stands for P; a new P
    if the one picked was taken, unless ``port`` is given), ask it ``GET /v1/cluster``
    through its start, a while of serving and its stop; the count of answers by status. Fails
    on an answer that is not a 200 with the shard's cluster body."""
    for attempt in range(3 if port is None else 1):
        if port is None or attempt:
            (port,) = free_ports(1)
        log = workdir / f"shard-{attempt}.log"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *args]
        cmd = [a.replace("{port}", str(port)) for a in cmd]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        try:
            counts = _through_its_life(proc, port, log)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        if counts is not None:
            return counts
    raise AssertionError(f"the shard did not start in 3 attempts: {log.read_text()[-2000:]}")


def _through_its_life(proc: subprocess.Popen, port: int, log) -> dict[str, int] | None:
    counts: dict[str, int] = {}
    answered = 0
    deadline = time.monotonic() + BOUND
    stopped = False
    while time.monotonic() < deadline:
        got = _ask(port)
        if got is None:
            if proc.poll() is not None:
                if not answered:
                    return None  # it never listened (its port taken meanwhile): again
                return counts
            continue
        status, body = got
        counts[str(status)] = counts.get(str(status), 0) + 1
        assert status == 200, (status, body[:2000], log.read_text()[-3000:])
        info = json.loads(body)
        assert info["shard_index"] == 0 and isinstance(info["incarnation"], str), info
        answered += 1
        if answered >= SERVING_ANSWERS and not stopped:
            proc.send_signal(signal.SIGTERM)
            stopped = True
    raise AssertionError(f"the shard did not exit within {BOUND:g} s: {counts}")


def test_a_plain_shard(tmp_path):
    counts = _hammer(tmp_path, ["--shard-index", "0", "--num-shards", "1"])
    assert counts["200"] >= SERVING_ANSWERS


def test_a_shard_restoring_from_its_data_dir(tmp_path, fleet_factory):
    fleet = fleet_factory(1, data=True)
    with PSClient(fleet.urls, worker_id="w-start") as ps:
        ps.init({f"w{i}": np.zeros(1000, np.float32) for i in range(200)})
    assert fleet.stop(0) == 0  # its final snapshot: restored by the shard hammered
    data = str(fleet.data_dirs[0])
    _hammer(tmp_path, ["--shard-index", "0", "--num-shards", "1", "--data-dir", data])


def test_a_replica_of_a_static_group_whose_other_replica_is_down(tmp_path):
    (down,) = free_ports(1)
    group = f"http://127.0.0.1:{{port}}|http://127.0.0.1:{down}"
    args = ["--shard-index", "0", "--num-shards", "1", "--replica-group", group]
    args += ["--advertise-url", "http://127.0.0.1:{port}", "--replica-timeout", "1"]
    _hammer(tmp_path, args)


@pytest.mark.parametrize("role", ["alone", "joining"])
def test_a_replica_electing_its_primary_in_etcd(tmp_path, etcd, role):
    """``alone``: the replica campaigns while the other is down; ``joining``: it starts while
    the other leads, and becomes its backup (fed by it as it starts)."""
    this, other = free_ports(2)
    urls = [f"http://127.0.0.1:{p}" for p in (other, this)]
    common = ["--shard-index", "0", "--num-shards", "1", "--etcd", etcd.url, "--lease-ttl", "2"]
    common += ["--etcd-prefix", f"/start-{uuid.uuid4().hex[:8]}", "--replica-group", "|".join(urls)]
    leader = None
    try:
        if role == "joining":
            serve = [sys.executable, "-m", "server.cli", "serve", "--port", str(other)]
            leader = subprocess.Popen(
                [*serve, *common, "--advertise-url", urls[0]],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        _hammer(tmp_path, [*common, "--advertise-url", urls[1]], port=this)
    finally:
        if leader is not None:
            leader.kill()
            leader.wait(timeout=30)


#: Run in the shard before it serves: a part of ``/v1/cluster`` raises, as a bug in it would.
FAILING_PART = """
import server.narrowed as narrowed
def failing(self):
    raise RuntimeError("injected failure of the half cache's stats")
narrowed.NarrowedCache.stats = failing
"""


def test_a_part_that_fails_is_named_and_the_rest_answered(fleet_factory, http):
    """A part of the answer that raises (a bug, injected) is logged and named in ``errors``;
    the rest is answered, and a worker's fleet check (which reads the fleet fields) passes."""
    fleet = fleet_factory(1, prelude=FAILING_PART)
    r = http.get(fleet.urls[0] + "/v1/cluster")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["errors"] == {
        "admission": "RuntimeError: injected failure of the half cache's stats"
    }
    assert "half_cache" not in info and info["replication"]["role"] == "standalone"
    assert info["shard_index"] == 0 and info["variables"] == 0
    with PSClient(fleet.urls, worker_id="w-part") as ps:
        ps.init({"w": np.ones(3, np.float32)})
        assert ps.pull(["w"])["w"].tolist() == [1.0, 1.0, 1.0]
    log = fleet.log_tail(0, 200)
    assert "GET /v1/cluster: its part 'admission' failed" in log and "Traceback" in log, log
