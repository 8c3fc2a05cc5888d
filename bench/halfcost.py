"""Where the time of a half-precision pull and push goes: ``python -m bench.halfcost [--size
2.5e7]``.

Not a case of ``make bench``: a diagnostic for whoever makes ``PSClient(wire_dtype=...)``
faster (the goal is in :mod:`bench.goals`). It starts one shard, inits one float32 variable
and times (medians of ``--reps``; each pull after a push of zeros, so the whole value travels):

pull
    * ``PSClient.pull`` in float32, float16 and bfloat16, as a user sees it; and in float16
      by a worker pulling a version another one pulled just before (the shard narrows a big
      value once per version: server/narrowed.py);
    * the same requests over a bare socket (no client library, no widening): the time until
      the reply's head arrives (the shard reads the value and, for a half dtype, narrows it,
      then starts sending) and the time to read the body into one buffer;
push
    * ``PSClient.push`` in each dtype (the SDK narrows, the shard widens and applies ``Add``);
local
    * the conversions in this process for the same element count: :func:`halves.narrow` and
      :func:`halves.widen` (what the shard and the SDK run, float16 through
      :mod:`client_sdk.wire.casts`, whose backend the first line names), numpy's own casts,
      and a plain copy of the float32 and of the float16 bytes for scale.

The conversions are timed on one thread and on :data:`client_sdk.wire.halves.THREADS` (what
the SDK and the shard use for big arrays: numpy releases the GIL while it casts).

Blocking; well under a minute at the default size on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from . import processes

__all__ = ["main", "run"]

HALVES = ("float16", "bfloat16")


def _median_ms(
    fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None
) -> float:
    samples = []
    for _ in range(reps + 1):  # the first is a warm-up
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples[1:])) * 1e3


class _Bare:
    """HTTP/1.1 over a bare socket, timing a POST's reply head and body apart."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head: list[float] = []
        self.body: list[float] = []

    def post(self, path: str, body: bytes, accept: str) -> None:
        t0 = time.perf_counter()
        self.sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/msgpack\r\n"
                f"accept: {accept}\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        raw = b""
        while b"\r\n\r\n" not in raw:
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("the shard closed the connection")
            raw += more
        t1 = time.perf_counter()
        head, rest = raw.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        if lines[0].split()[1] != "200":
            raise RuntimeError(f"{path}: {lines[0]}")
        length = next(
            int(v)
            for k, _, v in (x.partition(":") for x in lines[1:])
            if k.lower() == "content-length"
        )
        buf = np.empty(length, np.uint8)
        buf[: len(rest)] = np.frombuffer(rest, np.uint8)
        view, pos = memoryview(buf), len(rest)
        while pos < length:
            got = self.sock.recv_into(view[pos:])
            if not got:
                raise ConnectionError("the shard closed the connection mid-body")
            pos += got
        self.head.append(t1 - t0)
        self.body.append(time.perf_counter() - t1)

    def close(self) -> None:
        self.sock.close()


def run(n: int, reps: int) -> list[tuple[str, str, float]]:
    from client_sdk import PSClient, wire
    from client_sdk.optimizers import Add
    from client_sdk.wire import halves

    rows: list[tuple[str, str, float]] = []

    def add(group: str, what: str, ms: float) -> None:
        rows.append((group, what, ms))
        print(f"{group:<6}{what:<64}{ms:>9.1f} ms", flush=True)

    value = np.random.default_rng(0).random(n, dtype=np.float32)
    zeros = np.zeros(n, np.float32)
    with tempfile.TemporaryDirectory(prefix="paramshard-halfcost-") as tmp:
        with processes.shards(1, Path(tmp), "--log-level", "warning") as fleet:
            url = fleet.urls[0]
            clients = {
                dtype: PSClient(fleet.urls, worker_id=f"halfcost-{dtype}", wire_dtype=wire_dtype)
                for dtype, wire_dtype in (("float32", None), *((h, h) for h in HALVES))
            }
            plain = clients["float32"]
            try:
                plain.init({"x": value}, optimizer=Add())

                def bump() -> None:  # a new version: the next pull sends the whole value
                    plain.push({"x": zeros})

                for dtype, ps in clients.items():
                    add(
                        "pull",
                        f"PSClient.pull, {dtype}",
                        _median_ms(functools.partial(ps.pull, ["x"]), reps, bump),
                    )
                with PSClient(fleet.urls, worker_id="halfcost-next", wire_dtype="float16") as nxt:

                    def bump_and_narrow() -> None:  # the shard keeps this version narrowed
                        bump()
                        clients["float16"].pull(["x"])

                    add(
                        "pull",
                        "PSClient.pull, float16, the version's narrowing kept",
                        _median_ms(functools.partial(nxt.pull, ["x"]), reps, bump_and_narrow),
                    )
                for dtype in ("float32", *HALVES):
                    msg: dict = {"names": ["x"], "layout": "table", "uniform": True, "packed": True}
                    if dtype != "float32":
                        msg["wire_dtype"] = dtype
                    body = msgpack.packb(msg)
                    bare = _Bare(url)
                    try:
                        add(
                            "pull",
                            f"bare socket, {dtype}: total (no widening)",
                            _median_ms(
                                functools.partial(bare.post, "/v1/pull", body, wire.FRAME),
                                reps,
                                bump,
                            ),
                        )
                        add(
                            "pull",
                            "  of which: until the reply's head",
                            np.median(bare.head[1:]) * 1e3,
                        )
                        add("pull", "  of which: the body", np.median(bare.body[1:]) * 1e3)
                    finally:
                        bare.close()
                for dtype, ps in clients.items():
                    add(
                        "push",
                        f"PSClient.push, {dtype}",
                        _median_ms(functools.partial(ps.push, {"x": zeros}), reps),
                    )
            finally:
                for ps in clients.values():
                    ps.close()
    f16 = value.astype(np.float16)
    bf16 = halves.narrow(value, "bfloat16")[0].view(halves.bfloat16())
    threads = halves.THREADS
    for count in sorted({1, threads}):
        halves.THREADS = count  # what the SDK and the shard use, read at each call
        try:
            for name, half in (("float16", f16), ("bfloat16", bf16)):
                add(
                    "local",
                    f"halves.narrow, {name}, {count} thread(s)",
                    _median_ms(functools.partial(halves.narrow, value, name), reps),
                )
                add(
                    "local",
                    f"halves.widen, {name}, {count} thread(s)",
                    _median_ms(functools.partial(halves.widen, half), reps),
                )
        finally:
            halves.THREADS = threads
    add(
        "local",
        "numpy astype float32 -> float16",
        _median_ms(lambda: value.astype(np.float16), reps),
    )
    add(
        "local", "numpy astype float16 -> float32", _median_ms(lambda: f16.astype(np.float32), reps)
    )
    out16, out32 = np.empty(n, np.float16), np.empty(n, np.float32)
    add(
        "local",
        "numpy copyto float32 -> float16 (memory touched)",
        _median_ms(lambda: np.copyto(out16, value, casting="unsafe"), reps),
    )
    add(
        "local",
        "numpy copyto float16 -> float32 (memory touched)",
        _median_ms(lambda: np.copyto(out32, f16), reps),
    )
    add("local", "copy of the float32 bytes (fresh memory)", _median_ms(value.copy, reps))
    add("local", "copy of the float16 bytes (fresh memory)", _median_ms(f16.copy, reps))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.halfcost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size", type=float, default=2.5e7, help="float32 elements (default 2.5e7)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions of each step (default 7)")
    args = p.parse_args(argv)
    n = int(args.size)
    from client_sdk.wire import casts

    load = os.getloadavg()[0]
    print(
        f"one float32 variable of {n:,} elements ({4 * n / 1e6:.1f} MB), medians of "
        f"{args.reps}, load {load:.2f}; float16 casts by {casts.backend()}"
    )
    run(n, args.reps)


if __name__ == "__main__":
    main()
