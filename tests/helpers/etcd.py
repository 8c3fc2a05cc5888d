"""A real etcd server for a test module: :func:`start`, or the ``etcd`` fixture of a module.

Debian's ``etcd-server`` package (``/usr/bin/etcd``; ``make test`` installs it as root) runs as
a one-member cluster on loopback, with a data dir under the test's temporary directory. etcd
cannot bind port 0 and report the port it got, so :func:`start` picks two free ports (client
and peer), starts it, and when one of them was taken in between (another test file's server,
on the other xdist process) starts again on two others. The server is killed when the module
ends (:meth:`Etcd.close`); :meth:`Etcd.pause` and :meth:`Etcd.resume` freeze it (SIGSTOP) to
make it unreachable without losing its state.

Without etcd installed the module skips saying what to install (it fails under CI, where
``make test`` installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx2
import pytest

__all__ = ["ETCD", "Etcd", "require", "start"]

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
#: How long a starting etcd may take to answer (it fsyncs its first entries; slow under load).
START_TIMEOUT = 30.0


def require() -> str:
    """The etcd binary's path; skips the calling test (fails it under CI) when missing."""
    if os.access(ETCD, os.X_OK):
        return ETCD
    why = (
        "the leadership tests need etcd (Debian: apt-get install -y etcd-server; make test "
        "installs it as root)"
    )
    if os.environ.get("CI"):
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """One etcd process serving ``url`` (its client URL), its data in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log = workdir / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def _launch(self) -> bool:
        client, peer = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        data = self.workdir / "data"
        shutil.rmtree(data, ignore_errors=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    require(),
                    "--name",
                    "test",
                    "--data-dir",
                    str(data),
                    "--listen-client-urls",
                    self.url,
                    "--advertise-client-urls",
                    self.url,
                    "--listen-peer-urls",
                    peer_url,
                    "--initial-advertise-peer-urls",
                    peer_url,
                    "--initial-cluster",
                    f"test={peer_url}",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # a port was taken meanwhile (or another failure: see the log)
            try:
                r = httpx2.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}, timeout=2.0)
                if r.status_code == 200:
                    return True
            except httpx2.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not answer within {START_TIMEOUT:.0f} s: see {self.log}")

    def start(self, attempts: int = 5) -> Etcd:
        for _ in range(attempts):
            if self._launch():
                return self
        raise RuntimeError(f"etcd exited at start {attempts} times: see {self.log}")

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


def start(workdir: Path) -> Etcd:
    """A running etcd whose data lives in ``workdir`` (killed by :meth:`Etcd.close`)."""
    require()
    workdir.mkdir(parents=True, exist_ok=True)
    return Etcd(workdir).start()
