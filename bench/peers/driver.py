"""One process per peer: it runs the peer's adapter and times each call; the bench steers it
over a pipe.

    python -m bench.peers.driver drive NAME LOGDIR     # what start_peers() runs
    python -m bench.peers.driver serve NAME ARGS...    # a peer's own server process, if any

The protocol is one JSON object per line on stdin, one answer per line on stdout; the
driver's own stdout is moved to stderr first, so whatever TensorFlow, PyTorch or Ray print
goes to the log and never into the protocol. Commands:

``{"cmd": "init", "names": [...], "size": n}``
    create the variables, each ``n`` float32 values drawn from a generator seeded with ``n``
    (as the transfer case does), and keep a zero gradient of each.
``{"cmd": "pull", "names": [...]}`` → ``{"s": seconds, "nbytes": bytes received}``
    one timed ``adapter.pull``, checked for shape and dtype outside the timing.
``{"cmd": "push", "names": [...]}`` → ``{"s": seconds}``
    one timed ``adapter.push`` of zero gradients, so the values stay as they were (a peer
    whose push only stores, ``APPLIES = False``, is sent the values themselves).
``{"cmd": "check", "names": [...]}`` → ``{"ok": true}``
    pull once more and compare with the initial values.

Peers whose adapter has ``init_table`` (``"tables": true`` in the ready line) also take the
embedding-table commands of the rows case (:mod:`bench.rows`), whose ids are
:func:`bench.rows.batch` ``(rows, i)``, made in this process outside the timing:

``{"cmd": "table", "name": t, "rows": n, "dim": d}``
    create a ``[n, d]`` float32 table and read the rows of batch ``-1`` (kept for the check).
``{"cmd": "pull_rows", "name": t, "rows": n, "i": i}`` → ``{"s": seconds}``
    one timed ``adapter.pull_rows`` of batch ``i``, checked for shape and dtype after.
``{"cmd": "push_rows", "name": t, "rows": n, "i": i}`` → ``{"s": seconds}``
    one timed ``adapter.push_rows`` of zero gradients for batch ``i``.
``{"cmd": "check_rows", "name": t, "rows": n}`` → ``{"ok": true}``
    read batch ``-1`` again and compare with what ``table`` read.

A failure answers ``{"error": "..."}``. The driver exits when stdin closes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import processes
from . import PEERS

__all__ = ["Peer", "start_peers"]

#: For every peer process: unbuffered logs, quiet TensorFlow, and PyTorch's TensorPipe and
#: Gloo bound to the loopback interface (they would otherwise pick the host's first address).
_LOOPBACK_ENV = {
    "PYTHONUNBUFFERED": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TP_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
}
_START_TIMEOUT = 240.0  # importing TensorFlow and starting Ray on a busy 2-core box
_CALL_TIMEOUT = 300.0


class Peer:
    """The bench's handle on one driver process. Blocking; not thread-safe."""

    def __init__(self, name: str, logdir: Path) -> None:
        self.name = name
        self.label = PEERS[name].label
        self.log = logdir / f"peer-{name}.log"
        self._proc = processes.spawn(
            [sys.executable, "-m", "bench.peers.driver", "drive", name, str(logdir)],
            self.log,
            pipes=True,
            extra_env=_LOOPBACK_ENV,
        )
        self._lines = processes.LineReader(self._proc, self.log, f"peer {name!r}")
        self.server_pids: list[int] = []
        self.applies = True
        self.tables = False

    def wait_ready(self) -> None:
        """Block until the driver has started the peer and connected."""
        ready = self._answer(_START_TIMEOUT)
        self.server_pids = list(ready["server_pids"])
        self.applies = bool(ready["applies"])
        self.tables = bool(ready["tables"])

    def _answer(self, timeout: float) -> dict[str, Any]:
        reply = json.loads(self._lines.readline(timeout))
        if "error" in reply:
            raise RuntimeError(f"peer {self.name!r}: {reply['error']}\n(log: {self.log})")
        return reply

    def _call(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        self._proc.stdin.flush()
        return self._answer(_CALL_TIMEOUT)

    def init(self, names: list[str], size: int) -> None:
        self._call("init", names=names, size=size)

    def pull(self, names: list[str]) -> float:
        """Seconds one pull of ``names`` took, timed by the driver."""
        return self._call("pull", names=names)["s"]

    def push(self, names: list[str]) -> float:
        """Seconds one push of zeros to ``names`` took (until applied), timed by the driver."""
        return self._call("push", names=names)["s"]

    def check(self, names: list[str]) -> None:
        """Raise RuntimeError unless the values are still the ones ``init`` made."""
        self._call("check", names=names)

    def init_table(self, name: str, rows: int, dim: int) -> None:
        self._call("table", name=name, rows=rows, dim=dim)

    def pull_rows(self, name: str, rows: int, i: int) -> float:
        """Seconds one ``pull_rows`` of batch ``i`` took, timed by the driver."""
        return self._call("pull_rows", name=name, rows=rows, i=i)["s"]

    def push_rows(self, name: str, rows: int, i: int) -> float:
        """Seconds one ``push_rows`` of zeros for batch ``i`` took (until applied)."""
        return self._call("push_rows", name=name, rows=rows, i=i)["s"]

    def check_rows(self, name: str, rows: int) -> None:
        """Raise RuntimeError unless the probed rows are still the ones ``init_table`` read."""
        self._call("check_rows", name=name, rows=rows)

    def close(self) -> None:
        processes.stop(self._proc, grace=30.0)


@contextlib.contextmanager
def start_peers(names: tuple[str, ...], logdir: Path) -> Iterator[list[Peer]]:
    """Start a driver for each peer, all at once, and yield them once all are ready. Blocks
    while starting; stops them all on exit."""
    peers: list[Peer] = []
    try:
        for name in names:
            peers.append(Peer(name, logdir))
        for peer in peers:
            print(f"  waiting for peer {peer.name} ...", file=sys.stderr, flush=True)
            peer.wait_ready()
        yield peers
    finally:
        for peer in peers:
            peer.close()


# -- the driver process ------------------------------------------------------------------------


def _values(size: int) -> np.ndarray:
    return np.random.default_rng(size).random(size, dtype=np.float32)


def _drive(name: str, logdir: Path, proto: Any) -> None:
    def answer(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        module = importlib.import_module(PEERS[name].module)
        adapter = module.Adapter(logdir)
    except Exception as exc:  # reported to the bench, which stops the run
        traceback.print_exc()
        answer({"error": f"could not start: {type(exc).__name__}: {exc}"})
        return
    answer(
        {
            "ready": True,
            "server_pids": adapter.server_pids,
            "applies": getattr(module, "APPLIES", True),
            "tables": hasattr(adapter, "init_table"),
        }
    )
    expected: dict[str, np.ndarray] = {}
    grads: dict[str, np.ndarray] = {}
    applies = getattr(module, "APPLIES", True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            try:
                answer(_command(adapter, req, expected, grads, applies))
            except Exception as exc:
                traceback.print_exc()
                answer({"error": f"{req.get('cmd')}: {type(exc).__name__}: {exc}"})
    finally:
        adapter.close()


def _command(
    adapter: Any,
    req: dict[str, Any],
    expected: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    applies: bool,
) -> dict[str, Any]:
    cmd = req["cmd"]
    if cmd in _ROW_COMMANDS:
        return _rows_command(adapter, req, expected)
    names = list(req["names"])
    if cmd == "init":
        size = int(req["size"])
        value = _values(size)
        adapter.init({n: value for n in names})
        for n in names:
            expected[n] = value
            # A push adds zeros; a peer that only stores gets the value itself (same bytes).
            grads[n] = np.zeros(size, dtype=np.float32) if applies else value
        return {"ok": True}
    if cmd == "pull":
        t0 = time.perf_counter()
        got = adapter.pull(names)
        seconds = time.perf_counter() - t0
        nbytes = 0
        for n, arr in zip(names, got, strict=True):
            if arr.dtype != np.float32 or arr.shape != expected[n].shape:
                raise ValueError(
                    f"pulled {n} as {arr.dtype}{arr.shape}, expected float32{expected[n].shape}"
                )
            nbytes += arr.nbytes
        return {"s": seconds, "nbytes": nbytes}
    if cmd == "push":
        batch = {n: grads[n] for n in names}
        t0 = time.perf_counter()
        adapter.push(batch)
        return {"s": time.perf_counter() - t0}
    if cmd == "check":
        for n, arr in zip(names, adapter.pull(names), strict=True):
            if not np.array_equal(arr, expected[n]):
                raise ValueError(f"{n}: value changed by pushing zeros")
        return {"ok": True}
    raise ValueError(f"unknown command {cmd!r}")


_ROW_COMMANDS = ("table", "pull_rows", "push_rows", "check_rows")


def _rows_command(adapter: Any, req: dict[str, Any], probed: dict[str, np.ndarray]) -> dict:
    from ..rows import batch

    cmd, name, rows = req["cmd"], req["name"], int(req["rows"])
    if cmd == "table":
        adapter.init_table(name, rows, int(req["dim"]))
        probed[name] = adapter.pull_rows(name, batch(rows, -1))
        return {"ok": True}
    if cmd == "check_rows":
        if not np.array_equal(adapter.pull_rows(name, batch(rows, -1)), probed[name]):
            raise ValueError(f"{name}: rows changed by pushing zeros")
        return {"ok": True}
    ids = batch(rows, int(req["i"]))
    dim = probed[name].shape[1]
    if cmd == "push_rows":
        grads = np.zeros((ids.size, dim), dtype=np.float32)
        t0 = time.perf_counter()
        adapter.push_rows(name, ids, grads)
        return {"s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    got = adapter.pull_rows(name, ids)
    seconds = time.perf_counter() - t0
    if got.dtype != np.float32 or got.shape != (ids.size, dim):
        raise ValueError(f"pulled rows as {got.dtype}{got.shape}, expected float32{ids.size, dim}")
    return {"s": seconds}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in PEERS:
        importlib.import_module(PEERS[argv[1]].module).serve(argv[2:])
        return
    if len(argv) != 3 or argv[0] != "drive" or argv[1] not in PEERS:
        sys.exit(f"usage: python -m bench.peers.driver drive|serve {{{','.join(PEERS)}}} ...")
    # The protocol keeps the real stdout; everything else printing to fd 1 lands in the log.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # SIGTERM unwinds like an exception, so the adapter still stops the peer's servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    _drive(argv[1], Path(argv[2]), proto)


if __name__ == "__main__":
    main()
