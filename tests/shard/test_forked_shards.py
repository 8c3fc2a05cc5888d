"""The tests' fork server (tests/helpers/forkserver.py): a shard it forks is started, logs,
stops, dies and fails as one started by ``Popen``, and its handle says so as ``Popen`` would
(return codes, ``poll``, ``wait`` with a timeout, signals); what it must not fork goes through
``Popen``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from server.launcher import LaunchError
from tests.helpers import forkserver


def session_and_parent(pid: int) -> tuple[int, int]:
    """``(session id, parent pid)`` of ``pid``, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[3]), int(fields[1])


def forked(fleet, i: int = 0) -> forkserver.Forked:
    proc = fleet.procs[i]
    assert isinstance(proc, forkserver.Forked), f"shard {i} was not forked: {proc!r}"
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_forked_shard_serves_logs_and_stops_as_a_started_one(fleet_factory):
    fleet = fleet_factory(1)
    proc = forked(fleet)
    assert proc.poll() is None and proc.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.05)
    session, parent = session_and_parent(proc.pid)
    assert session == proc.pid  # a session of its own, as start_new_session makes
    assert parent != os.getpid()  # its fork server's waiter's child
    assert f"Started server process [{proc.pid}]" in fleet.tail(0)
    assert "serving on http://127.0.0.1" in fleet.tail(0)  # stderr and stdout: the log
    assert "Warning" not in fleet.tail(0)  # e.g. runpy's, for server.cli imported before -m
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert proc.poll() == 0 and proc.returncode == 0
    proc.send_signal(signal.SIGTERM)  # ended: nothing to signal, as Popen
    assert "Finished server process" in fleet.tail(0)


def test_a_killed_forked_shard_returns_the_signal_and_starts_again(fleet_factory):
    fleet = fleet_factory(1)
    first = forked(fleet).pid
    assert fleet.kill(0) == -signal.SIGKILL
    fleet.start(0)
    assert forked(fleet).pid != first
    forked(fleet).send_signal(signal.SIGINT)
    assert forked(fleet).wait(15) == 0  # SIGINT stops a shard cleanly, as in a terminal


def test_a_forked_shard_that_cannot_start_says_why(fleet_factory):
    fleet = fleet_factory(1)
    fleet.stop(0)
    fleet.extra_args = ("--no-such-flag",)
    with pytest.raises(LaunchError, match="exited with status 2") as failed:
        fleet.start(0)
    assert "unrecognized arguments: --no-such-flag" in str(failed.value)
    assert forked(fleet).returncode == 2


def test_the_environment_reaches_a_forked_shard(fleet_factory):
    fleet = fleet_factory(1, env={"PARAMSHARD_HTTP": "stock"})
    forked(fleet)
    assert "(http stock," in fleet.tail(0)


def test_what_cannot_be_forked_is_started_with_popen(fleet_factory, monkeypatch):
    other_env = fleet_factory(1, env={"LC_PROBE": "C"})
    prelude = fleet_factory(1, prelude="pass")
    monkeypatch.setenv(forkserver.ENABLE, "0")
    off = fleet_factory(1)
    for fleet in (other_env, prelude, off):
        assert isinstance(fleet.procs[0], subprocess.Popen)
        assert fleet.kill(0) == -signal.SIGKILL


def test_a_changed_environment_gets_a_fork_server_of_its_own(fleet_factory, monkeypatch):
    monkeypatch.setenv("LC_PROBE", "C")  # every fleet's environment from now on
    forked(fleet_factory(1))
