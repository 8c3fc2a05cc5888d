"""The processes a benchmark talks to: paramshard shards (started by the fleet launcher,
:mod:`server.launcher`), the raw-socket reference server, and whatever a peer adapter needs
(:func:`spawn`).

Each is a child process in its own session, on a loopback port, stopped (SIGTERM, then SIGKILL
of its whole process group after a grace period) when its context exits, whatever happened
inside. Output goes to a log file whose tail is shown if one fails.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from server import launcher

__all__ = [
    "ROOT",
    "Fleet",
    "LineReader",
    "RawServer",
    "env",
    "free_port",
    "raw_server",
    "shards",
    "spawn",
    "stop",
    "tail",
]

ROOT = Path(__file__).resolve().parent.parent
_START_TIMEOUT = 60.0


class Fleet(NamedTuple):
    """Running shards: their URLs and process ids, both in ``--shard-index`` order."""

    urls: list[str]
    pids: list[int]


class RawServer(NamedTuple):
    """The running raw-socket reference server."""

    host: str
    port: int
    pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository on ``PYTHONPATH`` (children import
    ``bench``, ``server`` and ``client_sdk`` from this checkout) plus ``extra``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **extra}


def tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def spawn(
    cmd: Sequence[str],
    log: Path,
    *,
    pipes: bool = False,
    extra_env: dict[str, str] | None = None,
    own_session: bool = True,
) -> subprocess.Popen:
    """Start ``cmd`` in the repository root, output appended to ``log``.

    With ``pipes`` its stdin and stdout are pipes (a line protocol); otherwise stdin is
    ``/dev/null`` and stdout goes to the log too. ``own_session`` puts it in a session (and
    process group) of its own; a peer's server started by its driver stays in the driver's
    group instead, so that stopping the driver sweeps it up too. Stop it with :func:`stop`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            env=env(**(extra_env or {})),
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else out,
            stderr=out,
            start_new_session=own_session,
        )


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop a child and wait for it. Blocks up to about twice ``grace`` seconds.

    A child with a stdin pipe is first asked to leave by closing it (it cleans up after
    itself), then gets SIGTERM, then SIGKILL, ``grace`` seconds apart. Whatever is left in
    its process group afterwards (helpers it started) is killed too, if it leads a group."""
    steps: list[object] = []
    if proc.stdin is not None:
        steps.append("close")
    steps += [signal.SIGTERM, signal.SIGKILL]
    for step in steps:
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError):
            if step == "close":
                proc.stdin.close()
            else:
                proc.send_signal(step)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
    if os.getpgid(0) != proc.pid:  # never our own group
        for pid in _group(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _group(pgid: int) -> list[int]:
    """Processes whose process group is ``pgid`` (read from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
                members.append(int(entry.name))
    return members


@contextlib.contextmanager
def shards(n: int, logdir: Path, *extra_args: str) -> Iterator[Fleet]:
    """Start ``n`` shards through the fleet launcher (:mod:`server.launcher`: each on a port it
    picks and reports) and yield their URLs and pids in index order, once every ``/healthz``
    answers. Blocks while starting; stops them on exit (SIGTERM, then SIGKILL of the process
    group after :data:`server.launcher.STOP_GRACE` seconds)."""
    fleet = launcher.Fleet(n, extra_args=extra_args, logdir=logdir)
    try:
        try:
            fleet.start_all()
        except launcher.LaunchError as exc:
            raise RuntimeError(str(exc)) from None
        yield Fleet(fleet.urls, fleet.pids)
    finally:
        fleet.close()


class LineReader:
    """Reads a child's stdout pipe line by line with a timeout (a line protocol). Not
    thread-safe."""

    def __init__(self, proc: subprocess.Popen, log: Path, what: str) -> None:
        assert proc.stdout is not None, "spawn(..., pipes=True) first"
        self._proc, self._log, self._what = proc, log, what
        self._fd = proc.stdout.fileno()
        self._buf = bytearray()

    def readline(self, timeout: float) -> str:
        """The next line, without its newline. Blocks up to ``timeout`` seconds; raises
        RuntimeError with the log's tail if the child exits or stays silent."""
        deadline = time.monotonic() + timeout
        while (end := self._buf.find(b"\n")) < 0:
            left = deadline - time.monotonic()
            with selectors.DefaultSelector() as sel:
                sel.register(self._fd, selectors.EVENT_READ)
                ready = left > 0 and sel.select(left)
            if not ready:
                raise RuntimeError(
                    f"{self._what}: no answer within {timeout:.0f} s; its log "
                    f"ends:\n{tail(self._log)}"
                )
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise RuntimeError(
                    f"{self._what} exited (code {self._proc.wait()}); its log "
                    f"ends:\n{tail(self._log)}"
                )
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        return line.decode(errors="replace")


@contextlib.contextmanager
def raw_server(logdir: Path) -> Iterator[RawServer]:
    """Start ``python -m bench.rawsock`` and yield its address and pid; stop it on exit."""
    log = logdir / "rawsock.log"
    proc = spawn([sys.executable, "-m", "bench.rawsock"], log, pipes=True)
    try:
        words = LineReader(proc, log, "raw socket server").readline(_START_TIMEOUT).split()
        if len(words) != 2 or words[0] != "port":
            raise RuntimeError(f"raw socket server did not start:\n{tail(log)}")
        yield RawServer("127.0.0.1", int(words[1]), proc.pid)
    finally:
        stop(proc, grace=5.0)
