"""The processes a benchmark talks to: paramshard shards and the raw-socket reference server.

Each is a child process in its own session, started on a free loopback port and stopped
(SIGTERM, then SIGKILL after a grace period) when its context exits, whatever happened inside.
Their output goes to a log file whose tail is shown if one fails to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ROOT", "free_port", "raw_server", "shards"]

ROOT = Path(__file__).resolve().parent.parent
_START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1.0) as r:
            return json.loads(r.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def shards(n: int, logdir: Path, *extra_args: str) -> Iterator[list[str]]:
    """Start ``n`` shards (``python -m server.cli serve``) and yield their URLs in index order,
    once every ``/healthz`` answers. Blocks while starting; stops them all on exit."""
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    logs = [logdir / f"shard{i}.log" for i in range(n)]
    try:
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-m", "server.cli", "serve", "--shard-index", str(i),
                   "--num-shards", str(n), "--host", "127.0.0.1", "--port", str(port),
                   *extra_args]
            with open(logs[i], "ab") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + _START_TIMEOUT
        for i, url in enumerate(urls):
            while not _healthy(url):
                if procs[i].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"shard {i} did not start (exit {procs[i].poll()}):\n"
                                       f"{_tail(logs[i])}")
                time.sleep(0.05)
        yield urls
    finally:
        for proc in procs:
            _stop(proc)


@contextlib.contextmanager
def raw_server(logdir: Path) -> Iterator[tuple[str, int]]:
    """Start ``python -m bench.rawsock`` and yield ``(host, port)``; stop it on exit."""
    log = logdir / "rawsock.log"
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bench.rawsock"], cwd=ROOT, env=_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
    try:
        line = proc.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"raw socket server did not start:\n{_tail(log)}")
        yield "127.0.0.1", int(line[1])
    finally:
        proc.stdin.close()
        _stop(proc, grace=5.0)
        proc.stdout.close()
