"""``paramshard`` as a user runs it: bad settings, ``up`` in the foreground, ``status``.

Every command runs as a real subprocess (``python -m server.cli ...``); ``up`` runs in its own
session so that whatever a failing test leaves behind is killed as one process group.
"""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

from client_sdk import PSClient
from client_sdk.optimizers import Add
from client_sdk.placement import shard_for
from server.config import InvalidSetting, ShardConfig
from tests.conftest import ROOT, http_json
from tests.helpers.ports import refused_port


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- bad configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,env,key",
    [
        (["--shard-index", "2", "--num-shards", "2"], {}, "--shard-index"),
        (["--num-shards", "0"], {}, "--num-shards"),
        (["--port", "70000"], {}, "--port"),
        (["--max-request-bytes", "lots"], {}, "--max-request-bytes"),
        (["--log-level", "chatty"], {}, "--log-level"),
        ([], {"PARAMSHARD_PORT": "http"}, "PARAMSHARD_PORT"),
        (
            [],
            {"PARAMSHARD_NUM_SHARDS": "2", "PARAMSHARD_SHARD_INDEX": "-1"},
            "PARAMSHARD_SHARD_INDEX",
        ),
        (
            [],
            {"PARAMSHARD_NUM_SHARDS": "3", "PARAMSHARD_SHARD_INDEX": "3"},
            "PARAMSHARD_SHARD_INDEX",
        ),
        ([], {"PARAMSHARD_ACCESS_LOG": "sometimes"}, "PARAMSHARD_ACCESS_LOG"),
        (["--snapshot-interval", "-1"], {}, "--snapshot-interval"),
        (["--snapshot-interval", "nan"], {}, "--snapshot-interval"),
        (["--keep-snapshots", "0"], {}, "--keep-snapshots"),
        ([], {"PARAMSHARD_DATA_DIR": ""}, "PARAMSHARD_DATA_DIR"),
        (["--data-dir", "/tmp/x", "--restore", "no spaces"], {}, "--restore"),
        (["--restore", "ckpt-1"], {}, "--restore"),
        (["--max-queued-bytes", "1MiB"], {}, "--max-queued-bytes"),
        (["--max-queued-requests", "0"], {}, "--max-queued-requests"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_config_exits_2_naming_the_key(args, env, key):
    done = run_cli("serve", *args, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_shard_index_error_says_the_valid_range():
    done = run_cli("serve", env={"PARAMSHARD_NUM_SHARDS": "4", "PARAMSHARD_SHARD_INDEX": "4"})
    assert done.returncode == 2 and "0..3" in done.stderr


def test_flags_win_over_environment():
    flags = {"port": "7200", "shard_index": "1", "num_shards": None}
    env = {
        "PARAMSHARD_PORT": "7100",
        "PARAMSHARD_NUM_SHARDS": "2",
        "PARAMSHARD_SHARD_INDEX": "9",
        "PARAMSHARD_ACCESS_LOG": "yes",
    }
    config = ShardConfig.from_sources(flags, env)
    assert (config.port, config.shard_index, config.num_shards) == (7200, 1, 2)
    assert config.access_log is True and config.host == "127.0.0.1"
    assert config.max_request_bytes == 1 << 30
    assert (
        ShardConfig.from_sources({"max_request_bytes": "16MiB"}, {}).max_request_bytes == 16 << 20
    )
    with pytest.raises(InvalidSetting) as info:
        ShardConfig.from_sources({"port": "x"}, {"PARAMSHARD_PORT": "7100"})
    assert info.value.key == "--port"


def test_serve_exits_1_when_its_port_is_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = run_cli("serve", "--port", str(s.getsockname()[1]))
    assert done.returncode == 1
    assert "address already in use" in done.stderr.lower()


# -- up -------------------------------------------------------------------------------------


def free_run(n: int) -> int:
    """A base port with n free consecutive ports after it, below the kernel's ephemeral port
    range, so that no outgoing connection (another test's client) is handed one of them before
    ``up`` binds it (best effort: ``up`` checks again)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, ephemeral - 12000), ephemeral - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


class Up:
    """``paramshard up`` in the foreground, its stdout lines in a queue."""

    def __init__(self, *args: str, log: Path) -> None:
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "up", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def read_until(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line starting {prefix!r}; got {self.seen}") from None
            if line is None:
                raise AssertionError(
                    f"up exited ({self.proc.wait()}) before {prefix!r}; stdout {self.seen}; "
                    f"stderr:\n{self.stderr()}"
                )
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def stderr(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture
def start_up(tmp_path) -> Iterator:
    ups: list[Up] = []

    def start(*args: str) -> Up:
        u = Up(*args, log=tmp_path / f"up{len(ups)}.err")
        ups.append(u)
        return u

    yield start
    for u in ups:
        u.close()


def _pids(lines: Iterable[str]) -> list[int]:
    return [int(line.rsplit("(pid ", 1)[1].rstrip(")")) for line in lines if "(pid " in line]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone for our purposes only once reaped; `up` reaps its children
    return False


def test_up_starts_shards_status_prints_them_and_sigint_stops_all(start_up):
    base = free_run(2)
    up = start_up("--shards", "2", "--base-port", str(base))
    export = up.read_until("export PARAMSHARD_SHARDS=")
    urls = export.split("=", 1)[1].split(",")
    assert urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    for i, url in enumerate(urls):
        assert any(url in line for line in up.seen)
        info = http_json(url + "/v1/cluster")
        assert (info["shard_index"], info["num_shards"]) == (i, 2)
    pids = _pids(up.seen)
    assert len(pids) == 2

    done = run_cli("status", "--shards", ",".join(urls))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = done.stdout.strip().splitlines()
    assert rows[0].split() == [
        "URL",
        "SHARD",
        "INCARNATION",
        "VARIABLES",
        "BYTES",
        "PUSHES/S",
        "PULLS/S",
        "SNAPSHOT",
        "AUTH",
        "HEALTHY",
    ]
    for i, url in enumerate(urls):
        row = rows[1 + i].split()
        assert row[0] == url and row[1] == f"{i}/2" and row[-1] == "yes"
        assert row[2] == http_json(url + "/v1/cluster")["incarnation"]
        # `up` tells every shard the fleet: its fleet view lists the URLs workers get
        fleet = http_json(url + "/v1/fleet", timeout=10)
        assert [s["url"] for s in fleet["shards"]] == urls
        assert all(s["up"] for s in fleet["shards"])

    # PARAMSHARD_SHARDS works too; a dead shard shows as down and makes the exit status 1
    with refused_port() as port:
        dead = f"http://127.0.0.1:{port}"
        done = run_cli("status", env={"PARAMSHARD_SHARDS": ",".join([*urls, dead])})
    assert done.returncode == 1
    assert any(
        line.startswith(dead) and line.split()[-1] == "down" for line in done.stdout.splitlines()
    ), done.stdout

    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(30) == 0, up.stderr()
    assert all(_gone(pid) for pid in pids)
    for url in urls:
        with pytest.raises(OSError):
            http_json(url + "/healthz", timeout=1.0)


def test_up_sigterm_stops_cleanly(start_up, tmp_path):
    up = start_up(
        "--shards",
        "1",
        "--base-port",
        str(free_run(1)),
        "--data-dir",
        str(tmp_path / "fleet"),
        "--snapshot-interval",
        "5",
    )
    url = up.read_until("export PARAMSHARD_SHARDS=").split("=", 1)[1]
    assert http_json(url + "/v1/cluster")["data_dir"] is True
    assert (tmp_path / "fleet" / "shard-0").is_dir()
    pids = _pids(up.seen)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(30) == 0, up.stderr()
    assert all(_gone(pid) for pid in pids)


def test_status_probes_the_shards_straight_whatever_proxy_the_environment_sets(fleet_factory):
    """HTTP_PROXY and the like (here a proxy that refuses connections) are for reaching the
    outside: `status` still reaches the fleet; `--proxy` is how to ask for one."""
    fleet = fleet_factory(1)
    with refused_port() as port:
        proxy = f"http://127.0.0.1:{port}"
        env = {k: proxy for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")}
        done = run_cli(
            "status", "--shards", fleet.urls[0], env={**env, "NO_PROXY": "", "no_proxy": ""}
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.splitlines()[1].split()[-1] == "yes"
        done = run_cli("status", "--shards", fleet.urls[0], "--proxy", proxy)
        assert done.returncode == 1 and done.stdout.splitlines()[1].split()[-1] == "down"
    done = run_cli("status", "--shards", fleet.urls[0], "--proxy", "socks://x")
    assert done.returncode == 2 and "--proxy" in done.stderr


def test_up_exits_1_naming_the_shard_whose_final_snapshot_failed(start_up, tmp_path):
    """Shard 1's data dir is replaced by a file while it runs (root writes anywhere, but not
    into a file): its final snapshot fails, and `up`, told to stop, says so and exits 1;
    shard 0's is written."""
    data = tmp_path / "fleet"
    up = start_up(
        "--shards", "2", "--base-port", "0", "--data-dir", str(data), "--snapshot-interval", "0"
    )
    urls = up.read_until("export PARAMSHARD_SHARDS=").split("=", 1)[1].split(",")
    with PSClient(urls) as ps:  # a change on each shard: each has a final snapshot to write
        ps.init({name_on(0, "final"): np.zeros(2, np.float32)})
        ps.init({name_on(1, "final"): np.zeros(2, np.float32)})
    shutil.rmtree(data / "shard-1")
    (data / "shard-1").write_text("not a directory")
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 1, up.stderr()
    errors = [line for line in up.stderr().splitlines() if line.startswith("paramshard up: error")]
    assert len(errors) == 1, up.stderr()
    assert "shard 1" in errors[0] and urls[1] in errors[0] and "final snapshot" in errors[0]
    assert any(p.name.endswith(".json") for p in (data / "shard-0").iterdir())


def test_up_with_restart_limit_0_reports_a_dead_shard_and_stops_the_rest(start_up):
    up = start_up("--shards", "2", "--base-port", "0", "--restart-limit", "0")
    up.read_until("export PARAMSHARD_SHARDS=")
    pids = _pids(up.seen)
    os.kill(pids[1], signal.SIGKILL)
    assert up.proc.wait(30) == 1
    assert "shard 1" in up.stderr() and "SIGKILL" in up.stderr()
    assert _gone(pids[0])


def name_on(shard: int, prefix: str, n: int = 2) -> str:
    return next(f"{prefix}{k}" for k in range(10_000) if shard_for(f"{prefix}{k}", n) == shard)


def test_up_restarts_a_shard_that_dies_on_its_port_with_its_data(start_up, tmp_path):
    """kill -9 of one shard, then SIGINT to the other: each comes back on its port with what it
    held (the newest snapshot: a checkpoint's, then its own final one), and the fleet serves
    all along; only a signal to `up` itself stops the fleet."""
    up = start_up(
        "--shards", "2", "--base-port", "0", "--data-dir", str(tmp_path / "fleet"),
        "--snapshot-interval", "0",
    )  # fmt: skip
    urls = up.read_until("export PARAMSHARD_SHARDS=").split("=", 1)[1].split(",")
    pids = _pids(up.seen)
    a, b = name_on(0, "a"), name_on(1, "b")
    with PSClient(urls, worker_id="t", retry_deadline=60) as ps:
        ps.init({a: np.zeros(4, np.float32), b: np.zeros(4, np.float32)}, optimizer=Add())
        ps.push({a: np.ones(4, np.float32), b: np.ones(4, np.float32)})
        ps.checkpoint()  # on disk: a kill -9 loses nothing before this
        incarnation = http_json(urls[1] + "/v1/cluster")["incarnation"]

        os.kill(pids[1], signal.SIGKILL)
        np.testing.assert_array_equal(ps.pull([a])[a], np.ones(4))  # shard 0 serves meanwhile
        back = up.read_until("paramshard up: shard 1 is back")
        assert urls[1] in back and _pids([back]) != [pids[1]]
        assert "shard 1" in up.stderr() and "was killed by SIGKILL" in up.stderr()
        assert "restarting it on the same port and data dir" in up.stderr()
        assert http_json(urls[1] + "/v1/cluster")["incarnation"] != incarnation
        np.testing.assert_array_equal(ps.pull([b])[b], np.ones(4))  # restored, same URL

        ps.push({a: np.ones(4, np.float32)})  # after the checkpoint: in the final snapshot only
        os.kill(pids[0], signal.SIGINT)  # to the shard alone, not to `up`
        up.read_until("paramshard up: shard 0 is back")
        np.testing.assert_array_equal(ps.pull([a])[a], np.full(4, 2.0))
        ps.push({a: np.ones(4, np.float32), b: np.ones(4, np.float32)})  # both serve
    new_pids = _pids(line for line in up.seen if "is back" in line)
    assert len(new_pids) == 2 and not set(new_pids) & set(pids)
    assert up.proc.poll() is None  # still up

    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(30) == 0, up.stderr()
    assert all(_gone(pid) for pid in pids + new_pids)


def test_up_gives_up_on_a_shard_that_keeps_failing(start_up, tmp_path):
    """A shard whose restarts fail at once (its only snapshot torn) is restarted with a pause
    between tries, then given up on: `up` says so, stops the other shard and exits 1."""
    data = tmp_path / "fleet"
    up = start_up(
        "--shards", "2", "--base-port", "0", "--data-dir", str(data), "--snapshot-interval", "0",
        "--restart-limit", "2",
    )  # fmt: skip
    urls = up.read_until("export PARAMSHARD_SHARDS=").split("=", 1)[1].split(",")
    pids = _pids(up.seen)
    with PSClient(urls, worker_id="t") as ps:
        ps.init({name_on(1, "b"): np.zeros(4, np.float32)})
        ps.checkpoint()
    for values in (data / "shard-1").glob("*.safetensors"):
        values.write_bytes(values.read_bytes()[:-100])  # a shard refuses to start from it
    os.kill(pids[1], signal.SIGKILL)
    assert up.proc.wait(90) == 1, up.stderr()
    err = up.stderr()
    assert err.count("restarting it on the same port and data dir") == 2, err
    assert "failed 3 times in a row" in err and "giving up" in err and "--restart-limit 2" in err
    assert _gone(pids[0])


def test_up_fails_clearly_when_a_port_is_taken(start_up):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        up = start_up("--shards", "2", "--base-port", str(taken - 1))
        assert up.proc.wait(30) == 1
        err = up.stderr()
        assert str(taken) in err and "in use" in err and "shard 1" in err


def test_up_rejects_bad_arguments():
    done = run_cli("up", "--shards", "zero")
    assert done.returncode == 2 and "--shards" in done.stderr
    done = run_cli("up", "--shards", "2", "--max-request-bytes", "huge")
    assert done.returncode == 2 and "--max-request-bytes" in done.stderr


def test_status_without_shards_is_a_usage_error():
    env = {k: v for k, v in os.environ.items() if k != "PARAMSHARD_SHARDS"}
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "status"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "PARAMSHARD_SHARDS" in done.stderr
