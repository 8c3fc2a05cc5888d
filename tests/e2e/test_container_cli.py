"""What containers rely on in the CLI: ``--shard-index auto``, ``paramshard health``, and the
example worker waiting for the shards' ``/readyz`` itself (``--wait-for-shards``: Podman's
compose starts it without waiting for the health checks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from server import config as config_module
from server.config import InvalidSetting, ShardConfig, index_from_hostname
from server.demo.digits_worker import parse_args as digits_args
from server.demo.digits_worker import wait_for_shards
from tests.conftest import ROOT, http_json
from tests.helpers.eventually import eventually
from tests.helpers.ports import refused_port


@pytest.mark.parametrize(
    "hostname,index",
    [
        ("paramshard-0", 0),
        ("paramshard-12", 12),
        ("ps3", 3),
        ("paramshard-2.paramshard.default.svc.cluster.local", 2),
    ],
)
def test_index_from_hostname(hostname, index):
    assert index_from_hostname(hostname) == index


@pytest.mark.parametrize("hostname", ["web", "3abc", "", "paramshard-2x"])
def test_index_from_hostname_without_a_trailing_number(hostname):
    with pytest.raises(ValueError, match="give the index as a number"):
        index_from_hostname(hostname)


def test_auto_index_in_config(monkeypatch):
    monkeypatch.setattr(config_module.socket, "gethostname", lambda: "paramshard-2")
    env = {"PARAMSHARD_SHARD_INDEX": "auto", "PARAMSHARD_NUM_SHARDS": "4"}
    assert ShardConfig.from_sources({}, env).shard_index == 2
    assert ShardConfig.from_sources({"shard_index": "AUTO"}, env).shard_index == 2
    assert ShardConfig.from_sources({"shard_index": "1"}, env).shard_index == 1  # flag wins

    monkeypatch.setattr(config_module.socket, "gethostname", lambda: "paramshard-4")
    with pytest.raises(InvalidSetting) as info:
        ShardConfig.from_sources({}, env)
    assert info.value.key == "PARAMSHARD_SHARD_INDEX"
    assert "0..3" in str(info.value) and "'paramshard-4'" in str(info.value)

    monkeypatch.setattr(config_module.socket, "gethostname", lambda: "web")
    with pytest.raises(InvalidSetting) as info:
        ShardConfig.from_sources({"shard_index": "auto"}, env)
    assert info.value.key == "--shard-index" and "'web'" in str(info.value)


needs_uts = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("hostname") is None,
    reason="needs root and unshare(1) to give a shard process a host name of its own",
)


def serve_as(hostname: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``paramshard serve`` in a UTS namespace whose host name is ``hostname``."""
    script = 'hostname "$0" && exec "$@"'
    cmd = [
        "unshare",
        "--uts",
        "sh",
        "-c",
        script,
        hostname,
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        *args,
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@needs_uts
def test_statefulset_pod_serves_the_shard_of_its_ordinal(tmp_path):
    port_file = tmp_path / "port"
    proc = serve_as(
        "paramshard-1",
        "--num-shards",
        "3",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        env={"PARAMSHARD_SHARD_INDEX": "auto"},
    )
    try:

        def cluster() -> dict | None:
            assert proc.poll() is None, proc.communicate()
            try:
                return http_json(f"http://127.0.0.1:{int(port_file.read_text())}/v1/cluster")
            except (OSError, ValueError):  # no port yet, or not answering yet
                return None

        info = eventually(cluster, "the shard reports its port and answers")
        assert (info["shard_index"], info["num_shards"]) == (1, 3)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


@needs_uts
def test_auto_index_on_a_host_name_without_a_number_exits_2():
    proc = serve_as("web", "--shard-index", "auto", "--num-shards", "3")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--shard-index" in lines[0] and "'web'" in lines[0], err


# -- paramshard health ----------------------------------------------------------------------


def health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "health", *args],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_health_of_a_running_shard(fleet2):
    port = str(fleet2.ports[1])
    done = health(env={"PARAMSHARD_PORT": port, "PARAMSHARD_HOST": "0.0.0.0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"http://127.0.0.1:{port}/healthz ok"
    done = health("--port", port, "--ready")
    assert done.returncode == 0, done.stderr
    assert "/readyz ok" in done.stdout


def test_health_without_a_shard_fails_and_says_why():
    with refused_port() as bound:
        port = str(bound)
        done = health(env={"PARAMSHARD_PORT": port})
    assert done.returncode == 1
    assert f"127.0.0.1:{port}/healthz did not answer" in done.stderr


@pytest.mark.parametrize(
    "args,env,key",
    [
        (["--timeout", "soon"], {}, "--timeout"),
        ([], {"PARAMSHARD_PORT": "http"}, "PARAMSHARD_PORT"),
    ],
)
def test_health_rejects_bad_settings(args, env, key):
    done = health(*args, env=env)
    assert done.returncode == 2 and key in done.stderr and "Traceback" not in done.stderr


# -- the example worker waits for the shards ---------------------------------------------------


def digits_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSHARD_", "DIGITS_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "server.demo.digits_worker", *args],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_worker_waits_until_the_shard_is_up_then_trains(tmp_path):
    with refused_port() as port:
        worker = digits_worker(
            "--steps", "20", "--log-every", "10",
            env={"PARAMSHARD_SHARDS": f"http://127.0.0.1:{port}", "DIGITS_WAIT_FOR_SHARDS": "120"},
        )  # fmt: skip
        try:
            assert worker.stdout is not None
            first = worker.stdout.readline()  # blocks until the worker has polled once
            assert f"waiting for http://127.0.0.1:{port} (ConnectError)" in first, first
        except BaseException:
            worker.kill()
            raise
    # The port is free from here: the shard takes it (nothing else on this host asks for it).
    serve = ["serve", "--num-shards", "1", "--shard-index", "0", "--port", str(port)]
    shard = subprocess.Popen(
        [sys.executable, "-m", "server.cli", *serve, "--data-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err
        assert "step 20/20" in out and "held-out accuracy" in out, out
    finally:
        worker.kill()
        shard.send_signal(signal.SIGTERM)
        shard.communicate(timeout=30)


def test_worker_gives_up_waiting_and_says_which_shard(fleet1):
    with refused_port() as port:
        shards = f"{fleet1.urls[0]},http://127.0.0.1:{port}"
        worker = digits_worker("--wait-for-shards", "1", env={"PARAMSHARD_SHARDS": shards})
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 1
    assert (
        f"error: the shards are not ready after 1 s: http://127.0.0.1:{port} (ConnectError)" in err
    )
    assert fleet1.urls[0] + " (" not in err  # the one that answers is not named
    assert "step" not in out


def test_worker_waits_for_one_ready_replica_of_each_group(fleet1):
    """A shard given as a replica group (``URL|URL``, docker-compose.yml) is ready when one of
    its replicas is: its other one may be down for good (killed) without holding workers up."""
    with refused_port() as port, refused_port() as other:
        dead, dead2 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{other}"
        assert wait_for_shards([f"{dead}|{fleet1.urls[0]}"], 30) is None
        why = wait_for_shards([f"{fleet1.urls[0]}|{dead}", f"{dead}|{dead2}"], 0.5)
    assert why is not None and f"{dead} (ConnectError)" in why and dead2 in why, why
    assert fleet1.urls[0] not in why


@pytest.mark.parametrize(
    ("key", "value"),
    [("DIGITS_TIMEOUT", "0"), ("DIGITS_TIMEOUT", "soon"), ("DIGITS_RETRY_DEADLINE", "inf")],
)
def test_worker_rejects_a_bad_timeout(monkeypatch, capsys, key, value):
    monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        digits_args([])
    assert exited.value.code == 2
    flag = key.removeprefix("DIGITS_").lower().replace("_", "-")
    assert flag in capsys.readouterr().err.replace("_", "-").lower()


def test_worker_reads_its_timeouts_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("DIGITS_TIMEOUT", "5")
    args = digits_args(["--retry-deadline", "120"])
    assert (args.timeout, args.retry_deadline) == (5.0, 120.0)


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_worker_rejects_a_bad_wait(value):
    worker = digits_worker(env={"DIGITS_WAIT_FOR_SHARDS": value, "PARAMSHARD_SHARDS": "http://x:1"})
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 2
    assert "wait-for-shards" in err.replace("WAIT_FOR_SHARDS", "wait-for-shards").lower(), err
