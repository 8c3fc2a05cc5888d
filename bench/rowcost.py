"""Where the time of one ``pull_rows`` and one ``push_rows`` goes:
``python -m bench.rowcost [--rows 1e6] [--reps 200]``.

Not a case of ``make bench``: a diagnostic for whoever works on the rows goal (the ``rows``
case, :mod:`bench.rows`). It starts 1 and 2 shards and the raw-socket server, creates the
``rows`` case's table (``--rows`` x :data:`~bench.rows.DIM` float32, SGD, every row stored)
and times, per request of one :func:`bench.rows.batch` (4,096 ids, half of them repeats):

* ``PSClient.pull_rows`` and ``push_rows`` as a user sees them, through 1 and 2 shards, with
  the CPU time they cost: the client's process and the shards' (kernel time included: the
  sockets' copies, the page faults);
* the SDK's Python for each (the shards' real replies replayed, no I/O), and its pieces: the
  ids deduplicated (a push's repeats summed), placed on 2 shards, the request encoded, the
  reply decoded and a pull's rows put back in the order asked for;
* the shard's HTTP protocol and app for the 1-shard requests, in this process, over a table
  filled the same way (uvicorn's parser, then, as a shard serves both requests, its protocol's
  own answerer: :mod:`server.immediate`; the handler's checks and store calls, the encoding),
  writing to a transport that drops what it is given (no I/O), and its pieces: the ids
  checked (with their owner, for 2 shards), the id -> row lookup, the rows gathered, a push's
  operation built (gradients checked, repeats summed) and applied (the table's update), the
  reply encoded;
* the raw socket moving the ``[4096, 64]`` float32 bytes each way.

Each line shows the median wall time and the median CPU time of this thread (for the first
lines: the CPU seconds of the client and the shards over all repetitions, per request). On a
busy machine the wall times stretch with the load (each process waits for a core, and a
request wakes two or three of them) while the CPU times barely move: they are what to compare
between two versions of the code. Blocking; about a minute at the defaults (filling the
tables takes most of it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import processes
from .rawsock import RawClient
from .rows import BATCH, DIM, LR, batch
from .stepcost import NullTransport

__all__ = ["main", "run"]

NAME = "bench/rowcost"
FILL = 16_384
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

Add = Callable[[str, float, float], None]


def _median_us(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median wall and CPU (this thread) microseconds of ``fn()``."""
    for _ in range(min(reps, 20)):  # warm-up
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return float(np.median(wall)) * 1e6, float(np.median(cpu)) * 1e6


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _fill(push: Callable[[np.ndarray, np.ndarray], object], rows: int) -> None:
    zeros = np.zeros((FILL, DIM), np.float32)
    for start in range(0, rows, FILL):
        ids = np.arange(start, min(rows, start + FILL), dtype=np.int64)
        push(ids, zeros[: len(ids)])


def _end_to_end(
    clients: dict[int, tuple[Any, list[int]]],
    ids: np.ndarray,
    grads: np.ndarray,
    add: Add,
    reps: int,
) -> None:
    """Each verb through 1 and 2 shards, taking turns so all see the same machine."""
    calls = {
        "push_rows": lambda ps: ps.push_rows(NAME, ids, grads),
        "pull_rows": lambda ps: ps.pull_rows(NAME, ids),
    }
    for verb, call in calls.items():
        for n, (ps, pids) in clients.items():
            for _ in range(min(reps, 20)):
                call(ps)
            wall = []
            c0, s0 = time.process_time(), sum(_cpu_seconds(p) for p in pids)
            for _ in range(reps):
                t0 = time.perf_counter()
                call(ps)
                wall.append(time.perf_counter() - t0)
            client = (time.process_time() - c0) / reps
            shards = (sum(_cpu_seconds(p) for p in pids) - s0) / reps
            label = f"PSClient.{verb}, {n} shard{'s' * (n > 1)}"
            add(label, float(np.median(wall)) * 1e6, (client + shards) * 1e6)
            add("  of which the client's process", float("nan"), client * 1e6)
            their = "the shards' processes" if n > 1 else "the shard's process"
            add(f"  of which {their}", float("nan"), shards * 1e6)


def _sdk_only(ps: Any, ids: np.ndarray, grads: np.ndarray, n: int, add: Add, reps: int) -> None:
    """The SDK's Python per pull_rows and push_rows, the shards' last real replies replayed."""
    real = ps._send_all
    canned: dict[str, list] = {}

    def capture(batch: list) -> list:
        out = real(batch)
        canned[batch[0].verb] = out
        return out

    ps._send_all = capture
    try:
        ps.pull_rows(NAME, ids)
        ps.push_rows(NAME, ids, grads)
        ps._send_all = lambda batch: canned[batch[0].verb]
        shards = f"{n} shard{'s' * (n > 1)}"
        add(
            f"the SDK's Python for a pull_rows, {shards} (no I/O)",
            *_median_us(lambda: ps.pull_rows(NAME, ids), reps),
        )
        add(
            f"the SDK's Python for a push_rows, {shards} (no I/O)",
            *_median_us(lambda: ps.push_rows(NAME, ids, grads), reps),
        )
    finally:
        ps._send_all = real


def _sdk_parts(ids: np.ndarray, grads: np.ndarray, add: Add, reps: int) -> None:
    """The SDK's pieces of a pull and a push, called as its flows call them."""
    from client_sdk import wire
    from client_sdk.embedding import distinct, segment_sum
    from client_sdk.placement import row_shard

    unique, inverse = distinct(ids)
    _, summed = segment_sum(ids, grads)
    rows = np.zeros((len(unique), DIM), np.float32)
    reply = wire.encode({"rows": rows, "version": 1}, tensors=True)
    body = reply.join()

    def decode() -> np.ndarray:
        return wire.decode_tensor(wire.unpack(body, reply.content_type)["rows"], body)

    push = {"name": NAME, "ids": unique, "grads": summed, "worker_id": "w", "seq": 1}
    add(
        "  dedupe a pull's ids (distinct: unique, inverse)",
        *_median_us(lambda: distinct(ids), reps),
    )
    add("  sum a push's repeats (segment_sum)", *_median_us(lambda: segment_sum(ids, grads), reps))
    add(
        "  place the distinct ids on 2 shards (row_shard)",
        *_median_us(lambda: row_shard(NAME, unique, 2), reps),
    )
    add(
        "  encode the pull request",
        *_median_us(lambda: wire.encode({"name": NAME, "ids": unique}), reps),
    )
    add("  encode the push request", *_median_us(lambda: wire.encode(push), reps))
    add("  decode a pull's reply", *_median_us(decode, reps))
    add(
        "  expand the rows to the ids' order (rows[inverse])",
        *_median_us(lambda: rows[inverse], reps),
    )


def _shard_in_process(rows: int, ids: np.ndarray, add: Add, reps: int) -> None:
    """The shard's protocol and app for one pull_rows and push_rows, in this process."""
    import uvicorn
    from uvicorn.server import ServerState

    from client_sdk import wire
    from client_sdk.embedding import TableSpec
    from client_sdk.optimizers import SGD
    from client_sdk.placement import row_shard
    from server import httptools_protocol as protocol
    from server.app import create_app, serving_app
    from server.config import ShardConfig
    from server.embedding import operations

    unique = np.unique(ids)
    summed = np.zeros((len(unique), DIM), np.float32)

    def request(path: str, enc: wire.Encoded) -> bytes:
        body = enc.join()
        return (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\naccept: {wire.FRAME}\r\n"
            f"content-type: {enc.content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def go() -> None:
        app = create_app(ShardConfig())
        config = uvicorn.Config(
            serving_app(app),
            http=protocol.ShardHttpProtocol,
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
        )  # as a shard serves
        config.load()
        tables = app.state.tables
        tables.create(NAME, TableSpec(dim=DIM, optimizer=SGD(lr=LR), seed=rows).to_wire())
        fills = iter(range(1, 1 << 62))
        _fill(lambda i, g: tables.push(NAME, "fill", next(fills), i, g), rows)
        table = tables.get(NAME)
        async with app.router.lifespan_context(app):
            proto = protocol.ShardHttpProtocol(
                config=config, server_state=ServerState(), app_state={}
            )
            transport = NullTransport()
            proto.connection_made(transport)

            async def exchange(raw: bytes) -> None:
                before = transport.writes
                proto.data_received(raw)
                while transport.writes == before:  # noqa: ASYNC110 (the loop runs the reply)
                    await asyncio.sleep(0)

            async def median(make: Callable[[], bytes]) -> tuple[float, float]:
                for _ in range(min(reps, 20)):
                    await exchange(make())
                wall, cpu = [], []
                for _ in range(reps):
                    raw = make()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    await exchange(raw)
                    cpu.append(time.thread_time() - c0)
                    wall.append(time.perf_counter() - t0)
                return float(np.median(wall)) * 1e6, float(np.median(cpu)) * 1e6

            pull = request("/v1/pull_rows", wire.encode({"name": NAME, "ids": unique}))
            seqs = iter(range(1, 1 << 62))

            def push() -> bytes:
                msg = {"name": NAME, "ids": unique, "grads": summed, "worker_id": "w"}
                return request("/v1/push_rows", wire.encode({**msg, "seq": next(seqs)}))

            got = table.gather(unique)
            add("the shard's protocol and app for a pull (no I/O)", *await median(lambda: pull))
            add(
                "  check the ids (1 shard)",
                *_median_us(lambda: operations.check_ids(NAME, unique, 1 << 18, 0, 1), reps),
            )
            add(
                "  check the ids' owner (2 shards: row_shard)",
                *_median_us(lambda: row_shard(NAME, unique, 2), reps),
            )
            add(
                "  look the ids up (id -> row)",
                *_median_us(lambda: table.index.lookup(unique), reps),
            )
            add(
                "  gather the rows (lookup included)",
                *_median_us(lambda: table.gather(unique), reps),
            )
            add(
                "  encode the reply",
                *_median_us(lambda: wire.encode({"rows": got, "version": 1}), reps),
            )
            add("the shard's protocol and app for a push (no I/O)", *await median(push))
            add(
                "  build the operation (grads checked, repeats summed)",
                *_median_us(lambda: operations.push_rows(table, "w", 1, unique, summed), reps),
            )
            add(
                "  apply it (the table's update: lookup, optimizer, write)",
                *_median_us(lambda: table.update(unique, summed), reps),
            )

    # As served: uvloop's transports take the reply's pieces in one vectored write.
    vectored, protocol._vectored = protocol._vectored, lambda transport: True
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(go())
            return
        uvloop.run(go())
    finally:
        protocol._vectored = vectored


def run(
    rows: int, reps: int, out: Callable[[str], None] = print, fleets: tuple[int, ...] = (1, 2)
) -> dict[str, tuple[float, float]]:
    """The figures (wall, CPU), in microseconds per request, keyed as printed (a line that
    says ``of which`` is keyed after the line it belongs to). ``fleets``: the shard counts
    to go through (the SDK's pieces and the shard in this process are 1 shard's)."""
    from client_sdk import PSClient
    from client_sdk.optimizers import SGD

    figures: dict[str, tuple[float, float]] = {}
    parent = [""]

    def add(what: str, wall: float, cpu: float) -> None:
        if what.lstrip().startswith("of which"):
            figures[f"{parent[0]}: {what.strip()}"] = (wall, cpu)
        else:
            parent[0] = what
            figures[what] = (wall, cpu)
        shown = "" if wall != wall else f"{wall:>9.0f}"
        out(f"{what:<64}{shown:>9}{cpu:>10.0f}")

    out(f"{'':<64}{'wall us':>9}{'CPU us':>10}")
    ids = batch(rows, 0)
    grads = np.zeros((len(ids), DIM), np.float32)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logdir = Path(tmp)
        clients: dict[int, tuple[Any, list[int]]] = {}
        for n in fleets:
            (logdir / str(n)).mkdir()
            fleet = stack.enter_context(processes.shards(n, logdir / str(n)))
            ps = stack.enter_context(PSClient(fleet.urls, worker_id=f"bench-rowcost-{n}"))
            ps.create_table(NAME, DIM, optimizer=SGD(lr=LR), seed=rows)
            _fill(lambda i, g, ps=ps: ps.push_rows(NAME, i, g), rows)
            clients[n] = (ps, fleet.pids)
        raw = stack.enter_context(processes.raw_server(logdir))
        sock = stack.enter_context(RawClient(raw.host, raw.port))
        _end_to_end(clients, ids, grads, add, reps)
        for n, (ps, _) in clients.items():
            _sdk_only(ps, ids, grads, n, add, reps)
        _sdk_parts(ids, grads, add, reps)
        flat = np.zeros((len(ids), DIM), np.float32)
        kb = f"{flat.nbytes / 1e3:,.0f} KB"
        add(f"raw socket: {kb} pushed", *_median_us(lambda: sock.push(flat), reps))
        add(f"raw socket: {kb} pulled", *_median_us(lambda: sock.pull(flat.nbytes), reps))
    _shard_in_process(rows, ids, add, reps)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rowcost", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=float, default=1e6, help="the table's rows (default 1e6)")
    p.add_argument("--reps", type=int, default=200, help="timed repetitions (default 200)")
    args = p.parse_args(argv)
    if args.rows < 1 or args.rows != int(args.rows) or args.reps < 1:
        p.error("--rows and --reps must be whole numbers >= 1")
    rows = int(args.rows)
    print(
        f"pull_rows and push_rows of {min(BATCH, 2 * rows):,} ids (half repeats) on a "
        f"{rows:,} x {DIM} float32 table (SGD), medians of {args.reps}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    run(rows, args.reps)


if __name__ == "__main__":
    main()
