"""Shards as local processes: start ``paramshard serve`` n times, learn the port each one bound,
wait until each answers, restart one, stop them all, read their logs.

One launcher for everything that runs a fleet on this machine: ``paramshard up``
(:mod:`server.supervisor`), ``paramshard demo`` (:mod:`server.demo`), the benchmarks
(``bench/processes.py``) and the tests (``tests/conftest.py``).

    fleet = Fleet(2, logdir=Path("logs"))   # shard i on a port it picks; logs/shard<i>.log
    fleet.start_all()                       # blocks until every shard answers /healthz
    fleet.urls                              # ["http://127.0.0.1:41233", "http://127.0.0.1:39017"]
    fleet.restart(1)                        # same port, same data dir
    fleet.close()                           # SIGTERM, then SIGKILL after the grace period

**Ports.** A shard started on port 0 binds a port the system picks and writes it to its
``--port-file`` as soon as it is bound (:func:`server.serve.serve`); the launcher reads it from
there. Nothing picks a free port in one process for another to bind later, a race that any
program on the machine can win. A shard restarted is given the port it bound first, since its
clients know it, and the same data dir, so it restores what it held.

**Children.** Each shard runs ``python -m server.cli serve`` with this interpreter and the
``server`` package this process imported (its directory goes first on ``PYTHONPATH`` unless it
is the interpreter's own ``site-packages``), so a fleet started from a source checkout runs that
checkout and one started from an installed wheel runs the wheel. Its output goes to
``logdir/shard<i>.log`` (appended to, across restarts), or to this process's own stdout and
stderr when there is no ``logdir``.

**Stopping.** :meth:`Fleet.stop` sends SIGTERM, on which a shard finishes the requests in flight
and writes its final snapshot, waits up to a grace period, then SIGKILLs it (its whole process
group when it leads one: ``own_session``). Every wait here has a deadline; a shard that exits
or stays silent past it raises :class:`LaunchError` with the end of its log.

Nothing here imports the web stack: starting shards needs only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import site
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from client_sdk.wire import ENV_PREFIX

__all__ = [
    "START_TIMEOUT",
    "STOP_GRACE",
    "Fleet",
    "LaunchError",
    "answers",
    "client_host",
    "exit_reason",
    "package_root",
    "shard_env",
    "tail",
]

#: Seconds a shard may take from its start to answering ``/healthz`` (or ``/readyz``).
START_TIMEOUT = 60.0
#: Seconds between SIGTERM and SIGKILL when a shard is stopped.
STOP_GRACE = 15.0
_POLL = 0.05


class LaunchError(RuntimeError):
    """A shard exited, or did not answer in time; the message says which and how its log ends."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def package_root() -> Path:
    """The directory holding the ``server`` package this process runs."""
    return Path(__file__).resolve().parent.parent


def _site_dirs() -> set[Path]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    dirs.append(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs if d}


def shard_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) for a child that must import the same
    ``server`` and ``client_sdk`` as this process: their directory first on ``PYTHONPATH``
    (unless it is a ``site-packages``, which the child's interpreter has already), and
    ``PYTHONUNBUFFERED=1`` so that its output reaches its log as it is written."""
    env = dict(os.environ if base is None else base)
    root = package_root()
    if root not in _site_dirs():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def client_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def answers(url: str, timeout: float = 1.0) -> bool:
    """True if a GET of ``url`` answers 200 (never through a proxy). Blocks up to ``timeout``.
    An ``https://`` URL's certificate is not verified: this asks whether a shard this host
    started is up, not who it is."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=unverified())
    )
    try:
        with opener.open(url, timeout=timeout) as r:
            r.read()
            return bool(r.status == 200)
    except (OSError, ValueError):  # refused, reset, timed out, an HTTP error status
        return False


def unverified() -> ssl.SSLContext:
    """A TLS context that checks no certificate (probes of a shard on this host)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def tail(log: Path | None, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    if log is None:
        return "(its output went to this terminal)"
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n".join(text) or "(empty log)"


def exit_reason(code: int) -> str:
    """``exited with status 1`` / ``was killed by SIGKILL``, for a Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Fleet:
    """``n`` shard processes on this machine; shard ``i`` is ``procs[i]`` at ``urls[i]``.

    ``ports[i]`` is 0 (the shard picks one, and :meth:`start` learns it) or the port to bind;
    ``data_dirs[i]`` its ``--data-dir`` (``None``: no snapshots); ``extra_args`` go to every
    shard's ``serve``; ``env`` is the children's environment before :func:`shard_env` (default:
    this process's). Not thread-safe: one thread drives a fleet.
    """

    def __init__(
        self,
        n: int,
        *,
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        data_dirs: Sequence[Path | None] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        logdir: Path | None = None,
        own_session: bool = True,
        start_timeout: float = START_TIMEOUT,
        grace: float = STOP_GRACE,
    ) -> None:
        if ports is not None and len(ports) != n:
            raise ValueError(f"{len(ports)} ports for {n} shards")
        if data_dirs is not None and len(data_dirs) != n:
            raise ValueError(f"{len(data_dirs)} data dirs for {n} shards")
        self.n = n
        self.host = host
        self.ports = list(ports) if ports is not None else [0] * n
        self.data_dirs = list(data_dirs) if data_dirs is not None else None
        self.extra_args = tuple(extra_args)
        self.env = shard_env(env)
        #: ``https`` when the shards serve TLS (``--tls-cert``, or ``PARAMSHARD_TLS_CERT`` in
        #: their environment), else ``http``.
        self.scheme = (
            "https"
            if "--tls-cert" in self.extra_args or self.env.get(ENV_PREFIX + "TLS_CERT")
            else "http"
        )
        self.logdir = logdir
        self.logs: list[Path | None] = [
            logdir / f"shard{i}.log" if logdir is not None else None for i in range(n)
        ]
        self.own_session = own_session
        self.start_timeout = start_timeout
        self.grace = grace
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        #: When each shard was last started (``time.monotonic()``).
        self.started_at = [0.0] * n
        self._rundir = Path(tempfile.mkdtemp(prefix="paramshard-fleet-"))

    # -- what runs ---------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Shard i's URL (its port is 0 until :meth:`start` learnt it)."""
        return [f"{self.scheme}://{client_host(self.host)}:{port}" for port in self.ports]

    @property
    def pids(self) -> list[int]:
        return [p.pid if p is not None else 0 for p in self.procs]

    def port_file(self, i: int) -> Path:
        return self._rundir / f"shard{i}.port"

    def serve_args(self, i: int) -> list[str]:
        """The arguments after ``paramshard serve`` for shard ``i``."""
        data = self.data_dirs[i] if self.data_dirs is not None else None
        return [
            "--shard-index",
            str(i),
            "--num-shards",
            str(self.n),
            "--host",
            self.host,
            "--port",
            str(self.ports[i]),
            "--port-file",
            str(self.port_file(i)),
            *(["--data-dir", str(data)] if data is not None else []),
            *self.extra_args,
        ]

    def command(self, i: int) -> list[str]:
        """Shard ``i``'s command line (a subclass may wrap it)."""
        return [sys.executable, "-m", "server.cli", "serve", *self.serve_args(i)]

    # -- starting ----------------------------------------------------------------------------

    def start_all(self, ready: bool = False) -> None:
        """Start every shard, then wait until each answers ``/healthz`` (``ready``:
        ``/readyz``, its snapshot restored). Blocks; raises :class:`LaunchError` (and leaves
        the others running: :meth:`close` them) if one exits or stays silent."""
        for i in range(self.n):
            self.start(i, wait=False)
        for i in range(self.n):
            self.wait(i, ready=ready)

    def start(self, i: int, wait: bool = True, ready: bool = False) -> None:
        """Start shard ``i`` (on ``ports[i]``; 0: a port it picks) and, with ``wait``, block
        until it answers (see :meth:`wait`)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            raise RuntimeError(f"shard {i} is running (pid {proc.pid})")
        self._rundir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.port_file(i).unlink()
        log = self.logs[i]
        out = open(log, "ab") if log is not None else None  # the child keeps its own copy
        try:
            self.procs[i] = self.spawn(i, out)
        finally:
            if out is not None:
                out.close()
        self.started_at[i] = time.monotonic()
        if wait:
            self.wait(i, ready=ready)

    def spawn(self, i: int, out: IO[bytes] | None) -> subprocess.Popen[bytes]:
        """Start shard ``i``'s process (:meth:`command`, the fleet's environment, stdin from
        ``/dev/null``, stdout and stderr to ``out`` or else this process's own). A subclass may
        start it another way and return a handle with ``Popen``'s ``pid``, ``poll``, ``wait``
        and ``send_signal``."""
        return subprocess.Popen(
            self.command(i),
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=self.own_session,
        )

    def poll(self, i: int) -> int | None:
        """Shard ``i``'s exit status, or ``None`` while it runs (or was never started)."""
        proc = self.procs[i]
        return None if proc is None else proc.poll()

    def learn_port(self, i: int) -> bool:
        """True once shard ``i``'s port is known: read from its port file when it reported
        one (the port it asked for, or the one the system gave it for port 0). Non-blocking."""
        try:
            text = self.port_file(i).read_text()
        except FileNotFoundError:
            return False
        port = int(text)
        if self.ports[i] and port != self.ports[i]:
            raise LaunchError(i, f"shard {i} reports port {port}, not {self.ports[i]}")
        self.ports[i] = port
        return True

    def answers(self, i: int, ready: bool = False, timeout: float = 1.0) -> bool:
        """True if shard ``i`` reported its port and answers ``/healthz`` (``ready``:
        ``/readyz``) with 200. Blocks up to ``timeout`` seconds."""
        if not self.learn_port(i):
            return False
        return answers(self.urls[i] + ("/readyz" if ready else "/healthz"), timeout)

    def wait(
        self,
        i: int,
        ready: bool = False,
        timeout: float | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Block until shard ``i`` answers ``/healthz`` (``ready``: ``/readyz``), ``timeout``
        seconds at most (default: the fleet's ``start_timeout``) or until ``cancelled()``.
        Raises :class:`LaunchError` if it exits first or the time runs out."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not cancelled():
            code = self.poll(i)
            if code is not None:
                raise LaunchError(i, self.describe_exit(i, code))
            if self.answers(i, ready, timeout=1.0):
                return
            if time.monotonic() > deadline:
                what = "/readyz" if ready else "/healthz"
                where = self.urls[i] if self.ports[i] else "before reporting its port"
                raise LaunchError(
                    i,
                    f"shard {i} ({where}) did not answer {what} within {timeout:g} s{self._log(i)}",
                )
            time.sleep(_POLL)

    def describe_exit(self, i: int, code: int) -> str:
        """``shard 1 (URL) exited with status 1; its log ends with: ...``"""
        where = f" ({self.urls[i]})" if self.ports[i] else ""
        return f"shard {i}{where} {exit_reason(code)}{self._log(i)}"

    def _log(self, i: int) -> str:
        if self.logs[i] is None:
            return " (its output is above)"
        return f"; its log ends with:\n{self.tail(i)}"

    def tail(self, i: int, lines: int = 30) -> str:
        return tail(self.logs[i], lines)

    # -- stopping ----------------------------------------------------------------------------

    def restart(self, i: int, wait: bool = True, ready: bool = False) -> None:
        """Stop shard ``i`` (see :meth:`stop`) and start it again on the same port with the
        same data dir."""
        self.stop(i)
        self.start(i, wait=wait, ready=ready)

    def send(self, i: int, sig: int) -> None:
        """Send ``sig`` to shard ``i`` if it runs."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    def stop(self, i: int, sig: int = signal.SIGTERM, grace: float | None = None) -> int | None:
        """Send ``sig`` to shard ``i``, wait up to ``grace`` seconds (default: the fleet's),
        then SIGKILL it; returns its exit status (``None`` if it was never started)."""
        proc = self.procs[i]
        if proc is None:
            return None
        self.send(i, sig)
        try:
            return proc.wait(self.grace if grace is None else grace)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            return proc.wait()

    def kill(self, i: int) -> int | None:
        """SIGKILL shard ``i`` (as a crash would end it) and reap it."""
        return self.stop(i, signal.SIGKILL)

    def close(self, grace: float | None = None) -> list[int | None]:
        """Stop every shard still running: SIGTERM to all at once, then SIGKILL to what is
        left after ``grace`` seconds (default: the fleet's). Blocks until all have exited;
        returns each shard's exit status (``None`` for one never started)."""
        for i in range(self.n):
            self.send(i, signal.SIGTERM)
        deadline = time.monotonic() + (self.grace if grace is None else grace)
        codes: list[int | None] = []
        for proc in self.procs:
            if proc is None:
                codes.append(None)
                continue
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self._kill(proc)
                codes.append(proc.wait())
        shutil.rmtree(self._rundir, ignore_errors=True)
        return codes

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.own_session:
                os.killpg(proc.pid, signal.SIGKILL)  # and whatever it started
            else:
                proc.kill()
