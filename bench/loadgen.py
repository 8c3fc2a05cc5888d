"""One worker process of the ``workers`` case: ``python -m bench.loadgen --target ... ...``.

It connects to every target it is given (``--target "LABEL=raw:HOST:PORT"`` or
``--target "LABEL=sdk:URL,URL"``), then serves commands, one JSON object per line on stdin:

``{"target": LABEL, "op": "push"|"step", "start": T, "seconds": D}``
    Do one untimed operation (connections open, buffers touched), wait until
    ``time.monotonic() == T`` (CLOCK_MONOTONIC: the same clock in every process on the
    machine, so all workers start together), then repeat the operation until ``T + D`` and
    answer ``{"samples": [seconds, ...], "bytes": moved, "end": monotonic time of the last
    one}``.

``push`` sends zeros for every ``--names`` variable (``--size`` float32 elements each) in one
call and returns once applied; ``step`` is a training step: that push, then a pull of the same
variables (the push made the cached versions stale, so the pull moves every byte). Against the
raw socket the same bytes go in one message each way. Exits when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np

from .rawsock import RawClient

__all__ = ["main"]


def _operations(
    spec: str, names: list[str], size: int, worker_id: str
) -> tuple[dict[str, Callable[[], int]], Callable[[], None]]:
    """``({"push": fn, "step": fn}, close)`` for one target; each fn returns bytes moved."""
    kind, _, where = spec.partition(":")
    grads = {name: np.zeros(size, dtype=np.float32) for name in names}
    nbytes = sum(g.nbytes for g in grads.values())
    if kind == "raw":
        host, _, port = where.rpartition(":")
        raw = RawClient(host, int(port))
        flat = np.zeros(nbytes // 4, dtype=np.float32)

        def raw_step() -> int:
            raw.push(flat)
            raw.pull(nbytes)
            return 2 * nbytes

        return {"push": lambda: (raw.push(flat), nbytes)[1], "step": raw_step}, raw.close
    if kind == "sdk":
        from client_sdk import PSClient

        ps = PSClient(where.split(","), worker_id=worker_id)

        def sdk_step() -> int:
            ps.push(grads)
            pulled = ps.pull(names)
            return nbytes + sum(v.nbytes for v in pulled.values())

        return {"push": lambda: (ps.push(grads), nbytes)[1], "step": sdk_step}, ps.close
    raise SystemExit(f"--target {spec!r}: expected raw:HOST:PORT or sdk:URL[,URL...]")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", required=True, metavar="LABEL=KIND:WHERE")
    p.add_argument("--names", required=True, help="comma-separated variable names")
    p.add_argument("--size", type=int, required=True, help="float32 elements per variable")
    p.add_argument("--worker-id", required=True)
    args = p.parse_args(argv)
    targets, closers = {}, []
    for item in args.target:
        label, _, spec = item.partition("=")
        targets[label], close = _operations(spec, args.names.split(","), args.size, args.worker_id)
        closers.append(close)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = targets[cmd["target"]][cmd["op"]]
            op()  # untimed
            start, stop = cmd["start"], cmd["start"] + cmd["seconds"]
            time.sleep(max(0.0, start - time.monotonic()))
            samples, moved = [], 0
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                moved += op()
                samples.append(time.perf_counter() - t0)
            print(
                json.dumps({"samples": samples, "bytes": moved, "end": time.monotonic()}),
                flush=True,
            )
    finally:
        for close in closers:
            close()


if __name__ == "__main__":
    main()
