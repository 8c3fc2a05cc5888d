"""Workers writing through faults, each write recorded in a :class:`tests.helpers.history.History`.

:class:`Writers` runs ``n`` workers on threads of this process, each a ``PSClient`` given a
replica group (``URL|URL``: it follows the primary), alternating a push of a one-hot gradient
(a coordinate of ``v`` of its own) and an increment of ``counter`` by 1, as the history checker
wants them (tests/helpers/history.py). A write that raises is not acknowledged (what became of
it is unknown); the worker goes on with its next write, so the workers keep writing through
every fault until :meth:`Writers.stop`. ``client(w, name)`` makes worker ``w``'s client
instead (anything with ``push``, ``increment`` and ``close``: an ``AsyncPSClient`` on a loop of
its own, a client over httpx2); ``timeout=None`` leaves the SDK's default.

Run as a program (``python -m tests.helpers.writers SHARDS OUT_DIR``) it does the same in a
process of its own, for workers that must live on another host (a network namespace,
tests/helpers/netlab.py): each worker appends its history to ``OUT_DIR/<worker>.jsonl``, one
flushed line per event, and the program stops once ``OUT_DIR/stop`` exists;
:func:`read_history` reads the files back.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import numpy as np

from client_sdk import PSClient, PSError
from client_sdk.optimizers import SGD
from tests.helpers.history import History

__all__ = ["PER_WORKER", "WORKERS", "Writers", "create_variables", "final_state", "read_history"]

WORKERS = 4
#: Pushes each worker may send (its coordinates of ``v``); far more than a test's run needs.
PER_WORKER = 4000


def create_variables(url: str) -> None:
    """Create ``v`` (SGD, lr=1) and ``counter`` on the primary ``url`` (or a group)."""
    with PSClient(url, worker_id="chief", retry_deadline=60) as ps:
        ps.init({"v": np.zeros(WORKERS * PER_WORKER, np.float32)}, SGD(lr=1.0))
        ps.increment("counter", 0)


class Writers:
    """``n`` workers writing to ``shards`` on threads (module docstring)."""

    def __init__(
        self,
        shards: str,
        history: History | None = None,
        n: int = WORKERS,
        timeout: float | None = 3.0,
        retry_deadline: float = 30.0,
        record: Callable[[str, str, str, Any, Any], None] | None = None,
        client: Callable[[int, str], Any] | None = None,
    ) -> None:
        self.shards = shards
        self.client = client
        self.history = history if history is not None else History()
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.record = record
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(n)
        ]

    def _note(self, event: str, worker: str, verb: str, args: Any, answer: Any = None) -> None:
        if event == "sent":
            self.history.sent(worker, verb, args)
        else:
            self.history.acked(worker, verb, args, answer)
        if self.record is not None:
            self.record(event, worker, verb, args, answer)

    def _client(self, w: int, name: str) -> Any:
        if self.client is not None:
            return self.client(w, name)
        if self.timeout is None:
            return PSClient(self.shards, worker_id=name, retry_deadline=self.retry_deadline)
        return PSClient(
            self.shards, worker_id=name, timeout=self.timeout, retry_deadline=self.retry_deadline
        )

    def _work(self, w: int) -> None:
        name = f"writer-{w}"
        ps = self._client(w, name)
        try:
            for k in range(2 * PER_WORKER):
                if self._stop.is_set():
                    return
                try:
                    if k % 2:
                        self._note("sent", name, "increment", None)
                        value = int(ps.increment("counter", 1))
                        self._note("acked", name, "increment", None, value)
                    else:
                        at = w * PER_WORKER + k // 2
                        grad = np.zeros(WORKERS * PER_WORKER, np.float32)
                        grad[at] = 1.0
                        self._note("sent", name, "push", at)
                        ps.push({"v": grad})
                        self._note("acked", name, "push", at)
                except PSError as exc:  # not acknowledged: what became of it is unknown
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
                    time.sleep(0.2)
        finally:
            ps.close()

    def start(self) -> Writers:
        for t in self._threads:
            t.start()
        return self

    def acked(self) -> int:
        return len(self.history.acked_writes)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.retry_deadline + 30)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"writers still running: {alive}"


def final_state(url: str) -> tuple[np.ndarray, int]:
    """``v`` and ``counter`` as replica ``url`` holds them, whatever its role: each as the
    ``.npy`` of its ``GET /v1/variables/{name}`` (a replica that is not in-sync refuses
    pulls, even those a backup may answer)."""

    def value(name: str) -> np.ndarray:
        reply = httpx2.get(f"{url}/v1/variables/{name}", params={"format": "npy"}, timeout=30)
        reply.raise_for_status()
        return np.load(io.BytesIO(reply.content), allow_pickle=False)

    return value("v"), int(value("counter"))


def read_history(out: Path) -> History:
    """The history the program's workers wrote to ``out`` (module docstring)."""
    history = History()
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                event, worker, verb, args, answer = json.loads(line)
            except ValueError:
                continue  # a last line cut short by the program's end: never acknowledged
            if event == "sent":
                history.sent(worker, verb, args)
            else:
                history.acked(worker, verb, args, answer)
    return history


def main(argv: list[str]) -> int:
    shards, out = argv[0], Path(argv[1])
    files: dict[str, Any] = {}
    lock = threading.Lock()

    def record(event: str, worker: str, verb: str, args: Any, answer: Any) -> None:
        with lock:
            f = files.get(worker)
            if f is None:
                f = files[worker] = open(out / f"{worker}.jsonl", "a")
            f.write(json.dumps([event, worker, verb, args, answer]) + "\n")
            f.flush()

    create_variables(shards)
    writers = Writers(shards, record=record).start()
    while not (out / "stop").exists():
        time.sleep(0.1)
    writers.stop()
    for f in files.values():
        f.close()
    (out / "errors.txt").write_text("\n".join(writers.errors))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
