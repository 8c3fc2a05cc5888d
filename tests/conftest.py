"""One way to run real shards in tests: separate processes on free loopback ports.

``fleet_factory(n, *extra_args)`` starts ``paramshard serve`` n times (``python -m server.cli``),
waits until every ``/healthz`` answers, and returns a :class:`Fleet`. With ``data=True`` shard i
gets ``--data-dir <workdir>/data/shard-i`` (``Fleet.data_dirs``) and the factory waits until every
``/readyz`` answers (its snapshot is restored). Every process a test started is stopped when the
test ends, killed if it does not stop in time.
``prelude=CODE`` runs CODE in each shard process before ``paramshard serve`` starts (e.g. to
hide httptools, or to stand in for another release of a dependency); ``env=`` adds environment
variables (``{"PARAMSHARD_HTTP": "stock"}``: the stock way of serving, :mod:`server.upstream`).
``fleet2`` is a module-scoped 2-shard fleet for tests that only add uniquely named variables;
``start_fleet2(factory, mode)`` starts one in the given way of serving (:data:`HTTP_MODES`), for
modules that run their data-plane tests both ways.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class OnLoop:
    """An ``AsyncPSClient`` driven from synchronous code, on an event loop of its own: each
    method runs to completion when called (``push_async``'s tasks progress in later calls)."""

    def __init__(self, client) -> None:
        self.client = client
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, verb: str):
        method = getattr(self.client, verb)
        return lambda *args, **kwargs: self.loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def examples(n: int) -> int:
    """``n`` Hypothesis examples, times ``PARAMSHARD_TEST_SCALE`` (default 1): raise it for a
    long hunt with the randomized tests (``PARAMSHARD_TEST_SCALE=20 make test``)."""
    return max(1, round(n * float(os.environ.get("PARAMSHARD_TEST_SCALE", "1"))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Fleet:
    """n shard processes; ``urls[i]`` is shard i. Restart a shard with ``start(i)``."""

    def __init__(
        self,
        n: int,
        workdir: Path,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        data: bool = False,
        prelude: str = "",
    ) -> None:
        self.n = n
        self.workdir = workdir
        self.extra_args = tuple(extra_args)
        self.env = env or {}
        self.prelude = prelude
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.logs = [workdir / f"shard{i}.log" for i in range(n)]
        self.data_dirs = [workdir / "data" / f"shard-{i}" for i in range(n)] if data else None
        for i in range(n):
            self.start(i, wait=False)
        for i in range(n):
            self.wait_ready(i) if data else self.wait_healthy(i)

    def command(self, i: int) -> list[str]:
        data = ["--data-dir", str(self.data_dirs[i])] if self.data_dirs else []
        start = (
            ["-m", "server.cli"]
            if not self.prelude
            else [
                "-c",
                self.prelude + "\nimport sys\nfrom server.cli import main\n"
                "sys.exit(main(sys.argv[1:]))",
            ]
        )
        return [
            sys.executable,
            *start,
            "serve",
            "--shard-index",
            str(i),
            "--num-shards",
            str(self.n),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.ports[i]),
            *data,
            *self.extra_args,
        ]

    def wait_ready(self, i: int, timeout: float = 30.0) -> None:
        """Wait until shard i answers ``/readyz`` with 200 (its state is restored)."""
        self.wait_healthy(i, timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                http_json(self.urls[i] + "/readyz", timeout=1.0)
                return
            except OSError:
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(
                        f"shard {i} exited with {proc.returncode}:\n{self.log_tail(i)}"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"shard {i} not ready after {timeout}s:\n{self.log_tail(i)}"
                    ) from None
                time.sleep(0.05)

    def start(self, i: int, wait: bool = True) -> None:
        assert self.procs[i] is None or self.procs[i].poll() is not None, f"shard {i} is running"
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        log = open(self.logs[i], "ab")
        self.procs[i] = subprocess.Popen(
            self.command(i),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if wait:
            self.wait_ready(i) if self.data_dirs else self.wait_healthy(i)

    def wait_healthy(self, i: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[i]
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"shard {i} exited with {proc.returncode}:\n{self.log_tail(i)}")
            try:
                http_json(self.urls[i] + "/healthz", timeout=1.0)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"shard {i} not healthy after {timeout}s:\n{self.log_tail(i)}")

    def log_tail(self, i: int, lines: int = 40) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, i: int, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise

    def kill(self, i: int) -> None:
        self.stop(i, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.procs:
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def fleet_factory(tmp_path):
    fleets: list[Fleet] = []

    def make(
        n: int,
        *extra_args: str,
        env: dict[str, str] | None = None,
        data: bool = False,
        prelude: str = "",
    ) -> Fleet:
        d = tmp_path / f"fleet{len(fleets)}"
        d.mkdir()
        f = Fleet(n, d, extra_args, env, data, prelude)
        fleets.append(f)
        return f

    yield make
    for f in fleets:
        f.close()


#: The ways a shard serves HTTP (``--http``; "fast" is ``auto`` on a web stack that offers
#: what the fast path needs, as tests/shard/test_upstream.py checks).
HTTP_MODES = ("fast", "stock")


def start_fleet2(tmp_path_factory, mode: str = "fast") -> Fleet:
    """A 2-shard fleet serving the ``mode`` way (:data:`HTTP_MODES`)."""
    env = {"PARAMSHARD_HTTP": "stock"} if mode == "stock" else {"PARAMSHARD_HTTP": "auto"}
    return Fleet(2, tmp_path_factory.mktemp(f"fleet2-{mode}"), env=env)


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory):
    f = start_fleet2(tmp_path_factory)
    yield f
    f.close()
