"""A fork server for the tests' shards: one process per pytest process imports what ``paramshard
serve`` imports once, then forks each shard the tests start, so a start costs the shard's own
setup (``create_app``, binding) and not its imports, most of a start's CPU.

:func:`spawn` is how ``tests/conftest.py``'s ``Fleet`` starts a shard: it returns a
:class:`Forked`, a handle with what the launcher and the tests use of a ``subprocess.Popen``
(``pid``, ``args``, ``returncode``, ``poll``, ``wait`` with a timeout, ``send_signal``,
``terminate``, ``kill``), or ``None`` when this start must go through ``Popen`` instead:
``PARAMSHARD_TEST_FORK=0``, a command other than ``python -m server.cli serve ...`` (a prelude,
a wrapper), a working directory or an environment other than the fork server's (only
``PARAMSHARD_*`` and ``PYTEST_CURRENT_TEST``, which nothing reads at import, may differ), or a
fork server that could not start (a warning says why). ``server/`` knows nothing of this:
production starts stay ``python -m server.cli serve``.

**How a shard is made.** The pytest process sends the fork server (over a Unix socket) the
shard's arguments, environment and working directory, with its stdin, stdout and stderr and the
write end of a status pipe (``socket.send_fds``). The fork server forks a waiter, which forks
the shard, writes ``pid N`` to the status pipe, waits for the shard and writes ``exit CODE``
(Popen's return code: negative for a signal). The shard is the waiter's child, not the pytest
process's, so the handle reads its exit from that pipe instead of ``waitpid``; it is reaped by
its waiter the moment it ends, as a Popen child is by ``poll``.

**What a forked shard must not inherit.** The fork server checks, before it says it is ready,
that its imports left one thread (``server``, imported first, keeps OpenBLAS to one) and no open
file other than its socket and stdio, and configured no logging; it never runs an event loop. In
the shard: a new session (as ``start_new_session``), the given stdio and no other descriptor
(the socket is closed in the waiter), the environment replaced (plus what the imports set, as
``server``'s ``OPENBLAS_NUM_THREADS``), the signal handlers a fresh interpreter has (recorded at
the fork server's own start), numpy's global random state reseeded (``random`` reseeds itself on
fork), then ``server.cli`` run as ``__main__`` with its arguments, as ``-m`` runs it; the
interpreter's own exit (``SystemExit``, a traceback, threads joined, ``atexit``, flushing) ends
it. What stays the fork server's: Python's string hash seed (the same in all its shards) and
what ``/proc/<pid>/cmdline`` and ``environ`` show.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ENABLE", "Forked", "spawn"]

#: ``PARAMSHARD_TEST_FORK=0`` starts every shard with ``Popen``.
ENABLE = "PARAMSHARD_TEST_FORK"
#: Variables that may differ between the fork server's environment and a shard's (nothing reads
#: them at import): the shard's settings and the test pytest is running.
FREE = ("PARAMSHARD_", "PYTEST_CURRENT_TEST")
#: The command this forks; anything else goes through ``Popen``.
SERVE = ("-m", "server.cli", "serve")
#: What a shard imports before it serves, imported once by the fork server.
PRELOAD = (
    "server",  # first: it keeps OpenBLAS to one thread
    "numpy",
    "numpy.random",
    "prometheus_client",
    "server.cli_args",  # and what server.cli imports, not server.cli: -m runs it afresh
    "server.config",
    "server.status",
    "server.probes",
    "server.progress",
    "server.reshard",
    "server.serve",
    "server.app",
    "server.logs",
    "server.readguard",
    "server.store.heap",
    "server.upstream",
    "server.httptools_protocol",
    "server.immediate",
    "server.follow",
    "server.metrics.export",
    "server.pages.replicas",
    "server.routes_checkpoint",
    "server.routes_control",
    "server.routes_inspect",
    "server.routes_replication",
    "uvicorn.config",
    "uvicorn.server",
    "uvicorn.lifespan.on",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.websockets.auto",
)
_READY_TIMEOUT = 120.0
_PID_TIMEOUT = 30.0
_MAX_MESSAGE = 1 << 20


class Forked:
    """A shard forked by the fork server: what the launcher and the tests use of ``Popen``."""

    def __init__(self, args: list[str], pid: int, status: int, buffered: bytes) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._status = status  # the pipe the shard's waiter writes "exit CODE" to
        self._buffer = buffered

    def _read(self, timeout: float | None) -> None:
        """Read the status pipe for up to ``timeout`` seconds (``None``: until the exit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._status], [], [], left)
            if not readable:
                return
            chunk = os.read(self._status, 4096)
            self._buffer += chunk
            for line in self._buffer.splitlines():
                if line.startswith(b"exit "):
                    self.returncode = int(line.split()[1])
            if self.returncode is not None or not chunk:
                os.close(self._status)
                if self.returncode is None:
                    raise ChildProcessError(f"the fork server's waiter of pid {self.pid} ended")
            if left == 0.0:
                return

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                os.close(self._status)


class _Client:
    """This pytest process's side of its fork server."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = {k: v for k, v in env.items() if not k.startswith(FREE)}
        self.cwd = os.getcwd()
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.lock = threading.Lock()
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                env=self.env,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.problem: str | None = None
        self.set_env: dict[str, str] = {}
        readable, _, _ = select.select([ours], [], [], _READY_TIMEOUT)
        reply = ours.recv(_MAX_MESSAGE) if readable else b""
        if not reply:
            self.problem = "the fork server did not start"
        else:
            ready = json.loads(reply)
            self.problem = ready["problem"]
            self.set_env = ready["set_env"]
        if self.problem is not None:
            self.close()

    def fits(self, env: Mapping[str, str]) -> bool:
        return (
            self.problem is None
            and os.getcwd() == self.cwd
            and {k: v for k, v in env.items() if not k.startswith(FREE)} == self.env
        )

    def spawn(self, args: list[str], env: Mapping[str, str], stdio: Sequence[int]) -> Forked:
        # what the fork server's imports set goes on as they set it
        request = {"argv": args[3:], "env": {**env, **self.set_env}, "cwd": self.cwd}
        status_r, status_w = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [*stdio, status_w])
        except OSError:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        buffered = b""
        deadline = time.monotonic() + _PID_TIMEOUT
        while b"\n" not in buffered:
            readable, _, _ = select.select([status_r], [], [], deadline - time.monotonic())
            chunk = os.read(status_r, 4096) if readable else b""
            if not chunk:
                os.close(status_r)
                raise ChildProcessError("the fork server did not report the shard's pid")
            buffered += chunk
        first, _, rest = buffered.partition(b"\n")
        return Forked(args, int(first.split()[1]), status_r, rest)

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


_client: _Client | None = None
_client_lock = threading.Lock()


def spawn(
    args: list[str],
    env: Mapping[str, str],
    base: Mapping[str, str],
    stdio: Sequence[int],
) -> Forked | None:
    """Fork ``args`` (``[sys.executable, "-m", "server.cli", "serve", ...]``) in a new session
    with ``env`` and the ``stdio`` descriptors (stdin, stdout, stderr); ``None`` if it must go
    through ``Popen`` (see the module's docstring). ``base`` is the environment of a shard that
    a test gives none: the fork server's, started again when it has changed."""
    global _client
    if os.environ.get(ENABLE, "1") == "0" or args[:4] != [sys.executable, *SERVE]:
        return None
    with _client_lock:
        if _client is not None and _client.owner != os.getpid():
            _client = None  # a process forked from this one: start its own
        if _client is not None and _client.problem is None and not _client.fits(base):
            _client.close()
            _client = None
        if _client is None:
            _client = _Client(base)
            if _client.problem is not None:
                warnings.warn(f"tests start shards with Popen: {_client.problem}", stacklevel=2)
        client = _client
    if not client.fits(env):
        return None
    try:
        return client.spawn(args, env, stdio)
    except (OSError, ChildProcessError) as exc:
        client.problem = f"the fork server failed: {exc}"
        warnings.warn(f"tests start shards with Popen: {client.problem}", stacklevel=2)
        return None


# -- the fork server ---------------------------------------------------------------------------


def _fork_safety_problem(sock: socket.socket) -> str | None:
    """Why this process must not fork shards (``None``: it may)."""
    import logging

    threads = os.listdir("/proc/self/task")
    if len(threads) != 1 or threading.active_count() != 1:
        return f"its imports started threads ({len(threads)} tasks)"
    fds = {int(fd) for fd in os.listdir("/proc/self/fd")}
    stray = sorted(
        fd for fd in fds - {0, 1, 2, sock.fileno()} if os.path.exists(f"/proc/self/fd/{fd}")
    )
    if stray:
        return f"its imports left descriptors open: {stray}"
    if logging.getLogger().handlers:
        return "its imports configured logging"
    if "server.cli" in sys.modules:  # -m would warn that it runs a module imported already
        return "its imports imported server.cli"
    return None


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork a waiter per request; returns the request in the shard, ``None`` at the end."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped as they end
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
        except OSError:
            return None
        if not message:
            return None  # the pytest process has gone
        request = json.loads(message)
        request["fds"] = fds
        if os.fork() == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock.close()
                pid = os.fork()
            except BaseException:
                os._exit(1)
            if pid == 0:
                return request
            try:
                os.write(fds[3], f"pid {pid}\n".encode())
                for fd in fds[:3]:
                    os.close(fd)
                _, status = os.waitpid(pid, 0)
                os.write(fds[3], f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)


def _become_shard(request: dict[str, Any], handlers: dict[int, Any]) -> None:
    """Turn this forked process into ``python -m server.cli serve ...`` as Popen starts it."""
    stdin, stdout, stderr, status = request["fds"]
    os.close(status)
    os.setsid()
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr}:
        if fd > 2:
            os.close(fd)
    for signum, handler in handlers.items():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import numpy

    numpy.random.seed()
    sys.argv = ["-m", *request["argv"]]
    import runpy

    runpy.run_module("server.cli", run_name="__main__", alter_sys=True)


def main(fd: int) -> None:
    import importlib

    handlers = {}
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(signum)
            if handler is not None:
                handlers[signum] = handler
    sock = socket.socket(fileno=fd)
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    set_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    problem = _fork_safety_problem(sock)
    sock.send(json.dumps({"problem": problem, "set_env": set_env}).encode())
    if problem is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    request = _serve(sock)
    if request is not None:
        _become_shard(request, handlers)


if __name__ == "__main__":
    main(int(sys.argv[1]))
