"""The demo's worker processes: each runs :mod:`server.demo.digits_worker`, its output shown
line by line with its tag (``[w0] step 100/500 ...``) as it comes; :class:`Workers` waits for
all of them and stops them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from ..launcher import exit_reason

__all__ = ["Printer", "WorkerFailed", "Workers"]


class WorkerFailed(Exception):
    """A worker exited with an error, or they did not finish in time."""


class Printer:
    """Prints lines from several threads without interleaving them (errors to ``err``)."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self.lock = threading.Lock()

    def __call__(self, text: str = "", *, error: bool = False) -> None:
        stream = self.err if error else self.out
        with self.lock:
            if error:
                self.out.flush()
            stream.write(text + "\n")
            stream.flush()


class Workers:
    """Worker processes of the digits model, each in a session of its own."""

    def __init__(self, env: Mapping[str, str], say: Printer) -> None:
        self.env = dict(env)
        self.say = say
        self.procs: list[subprocess.Popen[str]] = []
        self.readers: list[threading.Thread] = []

    def start(self, args: Sequence[str], tag: str) -> None:
        """Start ``python -m server.demo.digits_worker ARGS``; its output lines are printed,
        prefixed with ``tag`` unless they start with it."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.demo.digits_worker", *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.procs.append(proc)
        reader = threading.Thread(
            target=self._relay, args=(proc, tag), daemon=True, name=f"demo-relay-{tag}"
        )
        reader.start()
        self.readers.append(reader)

    def _relay(self, proc: subprocess.Popen[str], tag: str) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.say(line if line.startswith(tag) else f"{tag} {line}")

    def wait(self, timeout: float, check: Callable[[], None]) -> None:
        """Block until every worker exited 0, calling ``check()`` (which may raise: a shard
        died) between looks; raise :class:`WorkerFailed` at the first failure or after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            check()
            codes = [w.poll() for w in self.procs]
            for i, code in enumerate(codes):
                if code not in (None, 0):
                    self.readers[i].join(2.0)
                    raise WorkerFailed(
                        f"worker w{i} {exit_reason(code)} (its output, if any, is above)"
                    )
            if all(code == 0 for code in codes):
                for r in self.readers:
                    r.join(5.0)
                return
            if time.monotonic() > deadline:
                raise WorkerFailed(f"the workers did not finish within {timeout:g} s (--timeout)")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM every worker still running, SIGKILL what is left after ``timeout``; returns
        how many had to be stopped. Blocks until all have exited."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in running:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for r in self.readers:
            r.join(2.0)
        for p in self.procs:
            if p.stdout is not None:
                p.stdout.close()
        return len(running)
