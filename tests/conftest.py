"""One way to run real shards in tests: separate processes on loopback ports they pick.

``fleet_factory(n, *extra_args)`` starts ``paramshard serve`` n times through the fleet launcher
(:mod:`server.launcher`: each shard binds port 0 and reports the port it got), waits until
every ``/healthz`` answers, and returns a :class:`Fleet`. With ``data=True`` shard i
gets ``--data-dir <workdir>/data/shard-i`` (``Fleet.data_dirs``) and the factory waits until every
``/readyz`` answers (its snapshot is restored); ``data_dirs=[...]`` starts the shards on given
dirs (a fleet on what ``paramshard reshard`` wrote: tests/helpers/reshard.py). Every process a
test started is stopped when the test ends, killed if it does not stop in time.
``prelude=CODE`` runs CODE in each shard process before ``paramshard serve`` starts (e.g. to
hide httptools, or to stand in for another release of a dependency); ``env=`` adds environment
variables (``{"PARAMSHARD_HTTP": "stock"}``: the stock way of serving, :mod:`server.upstream`).
``fleet2`` is a module-scoped 2-shard fleet for tests that only add uniquely named variables;
``start_fleet2(factory, mode)`` starts one in the given way of serving (:data:`HTTP_MODES`), for
modules that run their data-plane tests both ways. ``fleet3`` is a module's 3-shard fleet, and
``ps3`` a client of it with a worker id of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
import uuid
from pathlib import Path

import httpx2
import pytest

from client_sdk import PSClient
from server import launcher
from tests.helpers import forkserver

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


def http_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Fleet(launcher.Fleet):
    """n shard processes (:class:`server.launcher.Fleet`); ``urls[i]`` is shard i, its output in
    ``workdir/shard<i>.log``. Restart a shard with ``start(i)`` (same port, same data dir)."""

    def __init__(
        self,
        n: int,
        workdir: Path,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        data: bool = False,
        prelude: str = "",
        data_dirs: list[Path] | None = None,
    ) -> None:
        self.workdir = workdir
        self.prelude = prelude
        if data and data_dirs is None:
            data_dirs = [workdir / "data" / f"shard-{i}" for i in range(n)]
        data = data_dirs is not None
        super().__init__(
            n,
            data_dirs=data_dirs,
            extra_args=extra_args,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            logdir=workdir,
            start_timeout=30.0,
        )
        try:
            self.start_all(ready=data)
        except BaseException:
            self.close()
            raise

    def command(self, i: int) -> list[str]:
        if not self.prelude:
            return super().command(i)
        run = (
            self.prelude + "\nimport sys\nfrom server.cli import main\nsys.exit(main(sys.argv[1:]))"
        )
        return [sys.executable, "-c", run, "serve", *self.serve_args(i)]

    def spawn(self, i: int, out):
        """Shard i forked by this pytest process's fork server (tests/helpers/forkserver.py),
        or started with ``Popen`` when it cannot be (``PARAMSHARD_TEST_FORK=0``, a prelude,
        another command or environment)."""
        if out is not None and self.own_session:
            base = launcher.shard_env({**os.environ, "PYTHONPATH": str(ROOT)})
            with open(os.devnull, "rb") as stdin:
                stdio = [stdin.fileno(), out.fileno(), out.fileno()]
                proc = forkserver.spawn(self.command(i), self.env, base, stdio)
            if proc is not None:
                return proc
        return super().spawn(i, out)

    def start(self, i: int, wait: bool = True, ready: bool | None = None) -> None:
        """Start shard i; with ``wait``, until it answers ``/readyz`` if it has a data dir (its
        state is restored), else ``/healthz``."""
        super().start(i, wait=wait, ready=self.data_dirs is not None if ready is None else ready)

    def wait_ready(self, i: int, timeout: float = 30.0) -> None:
        """Wait until shard i answers ``/readyz`` with 200 (its state is restored)."""
        self.wait(i, ready=True, timeout=timeout)

    def wait_healthy(self, i: int, timeout: float = 30.0) -> None:
        self.wait(i, timeout=timeout)

    def log_tail(self, i: int, lines: int = 40) -> str:
        return self.tail(i, lines)


@pytest.fixture
def fleet_factory(tmp_path):
    fleets: list[Fleet] = []

    def make(
        n: int,
        *extra_args: str,
        env: dict[str, str] | None = None,
        data: bool = False,
        prelude: str = "",
        data_dirs: list[Path] | None = None,
    ) -> Fleet:
        """n shards; ``data`` gives each a fresh data dir, ``data_dirs`` the given ones (e.g.
        what ``paramshard reshard`` wrote: each shard restores from its own at start)."""
        d = tmp_path / f"fleet{len(fleets)}"
        d.mkdir()
        f = Fleet(n, d, extra_args, env, data, prelude, data_dirs)
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


# -- fleets and clients shared by a module ------------------------------------------------------


@pytest.fixture(scope="module")
def module_fleet_factory(tmp_path_factory):
    """:func:`fleet_factory` for a whole module: the fleets it starts serve every test of the
    module (tests that only add uniquely named variables) and stop after the last one."""
    fleets: list[Fleet] = []

    def make(
        n: int,
        *extra_args: str,
        env: dict[str, str] | None = None,
        data: bool = False,
        prelude: str = "",
    ) -> Fleet:
        f = Fleet(n, tmp_path_factory.mktemp(f"fleet{n}-"), extra_args, env, data, prelude)
        fleets.append(f)
        return f

    yield make
    for f in fleets:
        f.close()


@pytest.fixture(scope="module")
def fleet1(module_fleet_factory) -> Fleet:
    """A 1-shard fleet shared by a module (a fleet of one owns every name)."""
    return module_fleet_factory(1)


@pytest.fixture(scope="module")
def fleet3(module_fleet_factory) -> Fleet:
    """A 3-shard fleet shared by a module: enough shards for a request split over several,
    with names on chosen shards from tests/helpers/names.py."""
    return module_fleet_factory(3)


@pytest.fixture
def ps3(fleet3):
    """A :class:`PSClient` of :func:`fleet3` with a worker id of its own, closed after the test."""
    with PSClient(fleet3.urls, worker_id=f"w-{uuid.uuid4().hex[:8]}") as client:
        yield client


@pytest.fixture(scope="module")
def http():
    """An httpx2 client for raw requests (the protocol as sent by hand, not by the SDK)."""
    with httpx2.Client(timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd server for a module (tests/helpers/etcd.py), killed after its last test;
    tests keep apart by using keys under a prefix of their own."""
    from tests.helpers import etcd as etcd_server

    server = etcd_server.start(tmp_path_factory.mktemp("etcd"))
    yield server
    server.close()
