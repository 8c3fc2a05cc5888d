"""Failover time: from a kill -9 of a shard's primary to the first write a worker sees
acknowledged by the new one (server/replication/leadership.py, client_sdk/_replicas.py).

One etcd (Debian's ``etcd-server``; the case is skipped, saying so, without it) and two
replicas of one shard index electing their primary in it (``--etcd``, ``--lease-ttl``). A
worker (``PSClient`` given both replicas, ``URL|URL``) increments a counter in a loop. Each
repetition waits until one replica leads and the other may take over, kills the primary with
SIGKILL, and times from the kill to the completion of the first increment started after it
(which finds the new primary and is applied there); then the killed replica is started again
and caught up before the next repetition. Every increment's value is checked: no value is
handed out twice, none skipped.

Rows: ``op`` ``failover``; ``system`` ``kill -> first acked write`` and, as the reference, the
lease TTL itself (a failover cannot be faster than the lease's end). The goal
(:mod:`bench.goals`): p50 <= 1.5 x the TTL (3 s with the default 2 s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from client_sdk import PSClient
from server import launcher

from .context import Context
from .timing import summarize

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "FAILOVER", "LEASE", "TTL", "run"]

DESCRIPTION = (
    "failover: kill -9 of a primary elected in etcd -> the first write a worker sees "
    "acknowledged by the new primary (2 replicas, --lease-ttl 2), vs the lease TTL"
)
DEFAULT_SIZES = ()
FAILOVER, LEASE = "kill -> first acked write", "lease TTL"
TTL = 2
ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/v1/cluster", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _wait(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        time.sleep(0.05)
    raise RuntimeError(f"bench failover: no {what} within {timeout:.0f} s")


class _Etcd:
    def __init__(self, workdir: Path) -> None:
        for _ in range(4):
            client, peer = _ports(2)
            self.url = f"http://127.0.0.1:{client}"
            peer_url = f"http://127.0.0.1:{peer}"
            data = workdir / "etcd"
            shutil.rmtree(data, ignore_errors=True)
            with open(workdir / "etcd.log", "ab") as log:
                self.proc = subprocess.Popen(
                    [ETCD, "--data-dir", str(data), "--listen-client-urls", self.url,
                     "--advertise-client-urls", self.url, "--listen-peer-urls", peer_url,
                     "--initial-advertise-peer-urls", peer_url, "--initial-cluster",
                     f"default={peer_url}", "--log-level", "warn"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    req = urllib.request.Request(self.url + "/v3/kv/range", data=b'{"key":"AA=="}')
                    with urllib.request.urlopen(req, timeout=2):
                        return
                except OSError:
                    time.sleep(0.05)
            self.close()
        raise RuntimeError(f"bench failover: etcd did not start (see {workdir / 'etcd.log'})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class _Group(launcher.Fleet):
    """Two replicas of shard 0/1 electing their primary in etcd."""

    def __init__(self, etcd: str, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        ports = _ports(2)
        self.group = [f"http://127.0.0.1:{p}" for p in ports]
        super().__init__(
            2,
            ports=ports,
            logdir=logdir,
            extra_args=(
                *("--log-level", "warning", "--replica-group", "|".join(self.group)),
                *("--etcd", etcd, "--etcd-prefix", "/bench", "--lease-ttl", str(TTL)),
            ),
        )

    def serve_args(self, i: int) -> list[str]:
        args = super().serve_args(i)
        args[args.index("--shard-index") + 1] = "0"
        args[args.index("--num-shards") + 1] = "1"
        return [*args, "--advertise-url", self.group[i]]


def _settled(group: _Group) -> int | None:
    """The primary's index once one leads and the other is its backup and may take over."""
    infos = [_get(u) for u in group.group]
    if any(i is None or not (i.get("leadership") or {}).get("eligible") for i in infos):
        return None
    roles = [i["replication"]["role"] for i in infos]  # type: ignore[index]
    if sorted(roles) != ["backup", "primary"]:
        return None
    return roles.index("primary")


def _failed(failures: list[BaseException]) -> None:
    if failures:
        raise RuntimeError(f"bench failover: the worker failed: {failures[0]!r}")


def run(ctx: Context) -> list[dict]:
    if not os.access(ETCD, os.X_OK):
        print("bench failover: skipped, no etcd (apt-get install -y etcd-server)")
        return []
    reps = 1 if ctx.quick else max(3, min(ctx.reps, 7))
    etcd = _Etcd(ctx.logdir)
    group = _Group(etcd.url, ctx.logdir / "failover")
    stop = threading.Event()
    acked: list[tuple[float, float, int]] = []  # (started, done, value)
    failures: list[BaseException] = []

    def worker() -> None:
        try:
            with PSClient("|".join(group.group), worker_id="bench-failover") as ps:
                while not stop.is_set():
                    started = time.perf_counter()
                    value = int(ps.increment("failover_steps"))
                    acked.append((started, time.perf_counter(), value))
        except BaseException as exc:
            failures.append(exc)

    try:
        group.start_all()
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        samples = []
        for _ in range(reps):
            primary = _wait(lambda: _settled(group), "primary with an eligible backup")
            _wait(lambda: _failed(failures) or len(acked) > 10 or None, "acknowledged increments")
            killed = time.perf_counter()
            group.stop(primary, signal.SIGKILL)
            first = _wait(
                lambda k=killed: (
                    _failed(failures) or next((d for s, d, _ in list(acked) if s > k), None)
                ),
                "write acknowledged after the kill",
            )
            samples.append(first - killed)
            group.start(primary, wait=True)
        stop.set()
        thread.join(timeout=120)
        if failures:
            raise RuntimeError(f"bench failover: the worker failed: {failures[0]!r}")
        values = sorted(v for _, _, v in acked)
        if values != list(range(values[0], values[0] + len(values))):
            raise RuntimeError("bench failover: an increment was applied twice or lost")
    finally:
        stop.set()
        group.close()
        etcd.close()
    base = {"case": "failover", "op": "failover", "size": None}
    return [
        {**base, "system": LEASE, "reference": True, **summarize([float(TTL)] * len(samples))},
        {**base, "system": FAILOVER, "reference": False, **summarize(samples)},
    ]
