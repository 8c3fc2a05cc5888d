"""Where the time of a step's pull of many small variables goes:
``python -m bench.stepcost [--variables 100] [--size 1000] [--reps 1000]``.

Not a case of ``make bench``: a diagnostic for whoever works on the step goal (100 x 4 KB in
one pull). It starts one shard and the raw-socket server and times, per pull of
``--variables`` float32 variables of ``--size`` elements each (medians):

* ``PSClient.pull`` as a user sees it, each after a push that changed every variable (so the
  pull moves every value), and the same bytes as one variable;
* the SDK's own Python for that pull: the same call fed the shard's real reply over and over
  (no I/O: what the SDK costs per pull beyond the socket);
* the shard's HTTP protocol and app for that request, in this process (uvicorn's parser, the
  shard's middleware, the handler, the encoding), writing to a transport that drops what it is
  given (no I/O: what the shard costs per pull beyond the socket);
* the same two for the variables as a step group (``ps.group(names)``, ``g.pull()``), and the
  shard's part of the group's push (``g.push(flat)``, applied with ``Add``);
* the raw socket moving the same bytes, and 8 bytes (its floor: a round trip of two
  wake-ups and four system calls);
* then, live, per group pull, group push (the gradient buffer ``g.grads``, versions sent),
  raw pull and raw push of the same bytes, where the wall time goes: the calling process's
  CPU in user space (its Python) and in the kernel (system calls, the copies out of and into
  the socket), the server's the same way (``/proc/<pid>/stat``, over all repetitions: a tick
  is 10 ms, all threads), and the rest, when
  neither ran: waking the other side (on this VM an idle vCPU halts without polling, so each
  wake-up pays a halt exit and an interrupt), and, on a loaded machine, waiting for a core.
  Two processes taking turns, so wall = client + server + rest (the rest may be negative when
  they overlap: the client reads the first bytes while the server still writes).

What the first line has beyond the two no-I/O lines is the kernel (the copies, waking the
other side) and each process running with caches the other one and the copies just used;
the live split says how much of each.
Blocking; about a minute at the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import processes
from .cpu import cpu_split
from .rawsock import RawClient

__all__ = ["NullTransport", "main", "run"]


def _median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(min(reps, 50)):  # warm-up
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e6


class NullTransport(asyncio.Transport):
    """A transport that takes whatever is written and drops it (counting the calls); what an
    HTTP protocol needs of a transport besides, answered as for a loopback connection."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: Any) -> None:
        self.writes += 1

    def writelines(self, pieces: Any) -> None:
        self.writes += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _shard_in_process(
    names: list[str], size: int, reps: int, group: bool = False, push: bool = False
) -> float:
    """Microseconds per pull through the shard's protocol and app, in this process (with
    ``group``, per pull of the names as a step group, registered first; with ``push`` too, per
    push of zeros to the group, one flat tensor, a seq of its own each)."""
    import uvicorn
    from uvicorn.server import ServerState

    from client_sdk import wire
    from client_sdk.optimizers import Add
    from client_sdk.wire import groups as group_wire
    from server import httptools_protocol as protocol
    from server.app import create_app, serving_app
    from server.config import ShardConfig

    def request(path: str, enc: wire.Encoded) -> bytes:
        body = enc.join()
        return (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\naccept: {wire.FRAME}\r\n"
            f"content-type: {enc.content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def go() -> float:
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

            value = np.zeros(size, np.float32)
            await exchange(
                request(
                    "/v1/init",
                    wire.encode(
                        {
                            "variables": {
                                n: {"value": value, "optimizer": Add().to_wire()} for n in names
                            }
                        }
                    ),
                )
            )
            pull = request(
                "/v1/pull", wire.encode({"names": names, "layout": "table"}, tensors=False)
            )
            if group:
                gid = app.state.store.groups.register(
                    app.state.store, names, len(names), 1 << 40
                ).id
                pull = request("/v1/group_pull", wire.encode({"group": gid}, tensors=False))
            todo = [pull] * (min(reps, 50) + reps)
            if group and push:
                grads = np.zeros(size * len(names), np.float32).data.cast("B")
                todo = [
                    request(
                        "/v1/group_push",
                        group_wire.encode(
                            {"group": gid, "worker_id": "stepcost", "seq": seq},
                            None,
                            "grads",
                            "<f4",
                            [grads],
                            len(grads),
                        ),
                    )
                    for seq in range(len(todo))
                ]
            for raw in todo[: min(reps, 50)]:
                await exchange(raw)
            samples = []
            for raw in todo[min(reps, 50) :]:
                t0 = time.perf_counter()
                await exchange(raw)
                samples.append(time.perf_counter() - t0)
            return float(np.median(samples)) * 1e6

    # As served: uvloop's transports take the reply's pieces in one vectored write.
    vectored, protocol._vectored = protocol._vectored, lambda transport: True
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(go())
        return uvloop.run(go())
    finally:
        protocol._vectored = vectored


def _live_split(fn: Callable[[], object], reps: int, server_pid: int) -> list[float]:
    """Microseconds per call of ``fn`` over ``reps`` calls in a row: wall, this process's
    user and system CPU, the server's user and system CPU, and the rest (wall less those)."""
    fn()
    me = os.getpid()
    before = [*(cpu_split(me) or (0.0, 0.0)), *(cpu_split(server_pid) or (0.0, 0.0))]
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    wall = time.perf_counter() - t0
    after = [*(cpu_split(me) or (0.0, 0.0)), *(cpu_split(server_pid) or (0.0, 0.0))]
    used = [b - a for a, b in zip(before, after)]
    per = 1e6 / reps
    return [wall * per, *(u * per for u in used), (wall - sum(used)) * per]


def run(count: int, size: int, reps: int, out: Callable[[str], None] = print) -> dict[str, float]:
    """The figures, in microseconds per pull, keyed as printed."""
    from client_sdk import PSClient
    from client_sdk.optimizers import Add

    figures: dict[str, float] = {}

    def add(what: str, us: float) -> None:
        figures[what] = us
        out(f"{what:<66}{us:>9.1f} us")

    names = [f"bench/stepcost/v{i:04d}" for i in range(count)]
    nbytes = 4 * size * count
    with tempfile.TemporaryDirectory() as tmp:
        logdir = Path(tmp)
        with (
            processes.shards(1, logdir) as fleet,
            processes.raw_server(logdir) as raw,
            PSClient(fleet.urls, worker_id="bench-stepcost") as ps,
            RawClient(raw.host, raw.port) as sock,
        ):
            ps.init({n: np.zeros(size, np.float32) for n in names}, optimizer=Add())
            ps.init({"bench/stepcost/one": np.zeros(size * count, np.float32)}, optimizer=Add())
            grads = {n: np.zeros(size, np.float32) for n in names}
            one = {"bench/stepcost/one": np.zeros(size * count, np.float32)}

            samples: dict[str, list[float]] = {"many": [], "one": []}
            for _ in range(reps):  # taking turns, so both see the same machine
                for key, g in (("many", grads), ("one", one)):
                    ps.push(g)
                    t0 = time.perf_counter()
                    ps.pull(list(g))
                    samples[key].append(time.perf_counter() - t0)
            add(
                f"PSClient.pull of {count} x {size:,} float32 (after a push)",
                float(np.median(samples["many"])) * 1e6,
            )
            add(
                f"PSClient.pull of the same {nbytes / 1e3:,.0f} KB as one variable",
                float(np.median(samples["one"])) * 1e6,
            )

            # The SDK alone: the same call, fed the shard's last real reply (no I/O).
            real = ps._send_all
            canned: list = []

            def capture(batch: list) -> list:
                canned[:] = real(batch)
                return canned

            ps._send_all = capture  # type: ignore[method-assign]
            ps.push(grads)
            ps.pull(names)
            ps._send_all = lambda batch: canned  # type: ignore[method-assign]
            cache = ps._core.cache.entries

            def sdk_only() -> None:
                cache.clear()  # every value arrives fresh, as after a push
                ps.pull(names)

            try:
                add(
                    "  the SDK's Python for it (the shard's reply replayed, no I/O)",
                    _median_us(sdk_only, reps),
                )
            finally:
                ps._send_all = real  # type: ignore[method-assign]
            add(
                "  the shard's protocol and app for it (in this process, no I/O)",
                _shard_in_process(names, size, reps),
            )
            group = ps.group(names)
            group_samples = []
            for _ in range(reps):
                group.push(group.flat)
                t0 = time.perf_counter()
                group.pull()
                group_samples.append(time.perf_counter() - t0)
            add(
                f"StepGroup.pull of the same {count} (after a push)",
                float(np.median(group_samples)) * 1e6,
            )
            add(
                "  the shard's protocol and app for the group's pull (in this process, no I/O)",
                _shard_in_process(names, size, reps, group=True),
            )
            add(
                "  the shard's protocol and app for a group push of zeros (in process, no I/O)",
                _shard_in_process(names, size, reps, group=True, push=True),
            )
            flat = np.zeros(size * count, np.float32)
            add(
                f"raw socket: {nbytes / 1e3:,.0f} KB pushed",
                _median_us(lambda: sock.push(flat), reps),
            )
            add(
                f"raw socket: {nbytes / 1e3:,.0f} KB pulled",
                _median_us(lambda: sock.pull(nbytes), reps),
            )
            add("raw socket: 8 bytes pulled", _median_us(lambda: sock.pull(8), reps))
            live = (
                ("group pull", group.pull, fleet.pids[0]),
                ("group push", lambda: group.push(), fleet.pids[0]),
                ("raw pull", lambda: sock.pull(nbytes), raw.pid),
                ("raw push", lambda: sock.push(flat), raw.pid),
            )
            for what, fn, pid in live:
                wall, c_user, c_sys, s_user, s_sys, rest = _live_split(fn, reps, pid)
                add(f"{what}, live: wall per call (mean of {reps} in a row)", wall)
                add(f"  {what}: the caller's CPU in user space (Python)", c_user)
                add(f"  {what}: the caller's CPU in the kernel (system calls, copies)", c_sys)
                add(f"  {what}: the server's CPU in user space", s_user)
                add(f"  {what}: the server's CPU in the kernel", s_sys)
                add(f"  {what}: neither running (wake-ups, waiting for a core)", rest)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.stepcost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--variables", type=int, default=100, help="variables per pull (default 100)")
    p.add_argument(
        "--size", type=float, default=1000, help="float32 elements per variable (default 1000)"
    )
    p.add_argument("--reps", type=int, default=1000, help="timed repetitions (default 1000)")
    args = p.parse_args(argv)
    if args.variables < 1 or args.size < 1 or args.size != int(args.size) or args.reps < 1:
        p.error("--variables, --size and --reps must be whole numbers >= 1")
    size = int(args.size)
    print(
        f"{args.variables} float32 variables of {size:,} elements in one pull, medians of "
        f"{args.reps}"
    )
    run(args.variables, size, args.reps)


if __name__ == "__main__":
    main()
