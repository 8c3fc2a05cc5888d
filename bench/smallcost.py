"""Where the time of one small pull, push and increment goes, on both sides:
``python -m bench.smallcost [--reps 2000] [--profile 15]``.

Not a case of ``make bench``: a diagnostic for whoever works on the small-request goals
(:mod:`bench.floor`). Two parts, each per op (a 4 KB ``pull``, a 4 KB ``push`` through ``Add``,
an ``increment``):

**Over the wire** (one shard, the raw-socket server and the floor's trivial server, each its
own process, on loopback; the systems take turns): per system the median wall time of one
call, and the CPU time the client process and the server process spent per call (the
client's from ``time.process_time``, the server's from ``/proc/<pid>/stat``, every thread
counted). A round trip where each side waits for the other costs about the two CPU figures
added up; what the raw socket's CPU is, is the kernel's part (a send, a receive, a wake-up).

**In one process, no I/O**: ``PSClient`` driving the shard's own HTTP protocol and app
(``ShardHttpProtocol``, the served app, uvloop when installed) through a socket stand-in
that hands each request to the protocol and runs the event loop until the reply is written:
the SDK's Python is the time outside the stand-in. The shard's Python (parsing, dispatch,
middleware, store, reply, event-loop turns) is timed apart: the requests the SDK sent are
fed again, each whole, to a fresh shard's protocol on a running loop. The same for the
floor (the SDK's connection code and the trivial server, :mod:`bench.floor`); and the shard
again with a token (auth on). Metrics are always counted (plain ints, :mod:`server.metrics`),
so they are in every shard line; no log record is written per request on the data path.
``--profile K`` adds each side's Python calls per request (a count no load changes) and its
K dearest functions (own time, from ``cProfile``, whose overhead inflates small functions).

The first part minus the second is the kernel and the scheduler; the second, side by side
with the floor's, is what the SDK and the shard add to a bare HTTP exchange.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import processes
from .floor import SMALL, FloorClient, _Trivial, floor_server
from .rawsock import RawClient

__all__ = ["LoopSocket", "main", "run_in_process", "run_over_wire"]

OPS = ("pull", "push", "increment")
N = 1000  # float32 elements: 4 KB
_TOKEN = "bench-smallcost-token-0123456789"


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sdk_calls(ps: Any, name: str, counter: str) -> dict[str, Callable[[], object]]:
    grad = np.zeros(N, np.float32)
    cache = ps._core.cache.entries

    def pull() -> None:
        cache.clear()  # the whole value comes, as after another worker's push
        ps.pull([name])

    return {
        "pull": pull,
        "push": lambda: ps.push({name: grad}),
        "increment": lambda: ps.increment(counter, 1),
    }


# -- over the wire ---------------------------------------------------------------------------


def run_over_wire(reps: int, out: Callable[[str], None] = print) -> dict[tuple[str, str], dict]:
    """Per (op, system): ``wall_us`` (median), ``client_cpu_us`` and ``server_cpu_us`` (per
    call)."""
    from client_sdk import PSClient
    from client_sdk.optimizers import Add

    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        logdir = Path(tmp)
        fleet = stack.enter_context(processes.shards(1, logdir, "--log-level", "warning"))
        raw_server = stack.enter_context(processes.raw_server(logdir))
        trivial = stack.enter_context(floor_server(logdir))
        ps = stack.enter_context(PSClient(fleet.urls, worker_id="bench-smallcost"))
        raw = stack.enter_context(RawClient(raw_server.host, raw_server.port))
        app = FloorClient(trivial.host, trivial.port, in_protocol=False)
        now = FloorClient(trivial.host, trivial.port, in_protocol=True)
        stack.callback(app.close)
        stack.callback(now.close)
        ps.init({"x": np.zeros(N, np.float32)}, optimizer=Add())
        grad, small = np.zeros(N, np.float32), np.zeros(SMALL, np.uint8)
        body = bytes(4 * N)
        systems: dict[str, tuple[int, dict[str, Callable[[], object]]]] = {
            "raw socket": (
                raw_server.pid,
                {
                    "pull": lambda: raw.pull(4 * N),
                    "push": lambda: raw.push(grad),
                    "increment": lambda: raw.push(small),
                },
            ),
            **{
                label: (
                    trivial.pid,
                    {
                        "pull": lambda c=client: c.call("pull", b"", 4 * N),
                        "push": lambda c=client: c.call("push", body, SMALL),
                        "increment": lambda c=client: c.call("increment", bytes(SMALL), SMALL),
                    },
                )
                for label, client in (("http, in protocol", now), ("http, app", app))
            },
            "paramshard": (fleet.pids[0], _sdk_calls(ps, "x", "c")),
        }
        block = max(1, reps // 10)  # taking turns in blocks: each sees the same machine
        for op in OPS:
            walls: dict[str, list[float]] = {s: [] for s in systems}
            cpu = {s: [0.0, 0.0] for s in systems}
            for _ in range(max(1, reps // block)):
                for system, (pid, calls) in systems.items():
                    call = calls[op]
                    for _ in range(5):
                        call()
                    s0, c0 = _server_cpu(pid), time.process_time()
                    samples = walls[system]
                    for _ in range(block):
                        t0 = time.perf_counter()
                        call()
                        samples.append(time.perf_counter() - t0)
                    cpu[system][0] += time.process_time() - c0
                    cpu[system][1] += _server_cpu(pid) - s0
            for system, samples in walls.items():
                n = len(samples)
                row = {
                    "wall_us": float(np.median(samples)) * 1e6,
                    "client_cpu_us": cpu[system][0] / n * 1e6,
                    "server_cpu_us": cpu[system][1] / n * 1e6,
                }
                results[op, system] = row
                out(
                    f"{op:<10}{system:<20}{row['wall_us']:>9.1f}{row['client_cpu_us']:>12.1f}"
                    f"{row['server_cpu_us']:>12.1f}"
                )
    return results


# -- in one process --------------------------------------------------------------------------


class _Captured(asyncio.Transport):
    """The server side's transport: keeps what the protocol writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        #: Set when something is written (a future of the loop, while it runs for a reply).
        self.written: asyncio.Future | None = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: Any) -> None:
        self.out += data
        self._wake()

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.out += piece
        self._wake()

    def _wake(self) -> None:
        if self.written is not None and not self.written.done():
            self.written.set_result(None)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: Any) -> None:
        raise NotImplementedError("bodies this small never switch protocols")


class LoopSocket(socket.socket):
    """A client socket whose peer is an HTTP protocol object in this process: ``sendmsg``
    hands the bytes to the protocol (and keeps a copy in :attr:`sent`) and runs the event
    loop until it has written something; ``recv_into`` returns what it wrote. Time spent in
    both is added to :attr:`inside`. Built on a connected loopback TCP socket (a file
    descriptor the SDK's connection accepts; nothing is ever read or written there)."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, protocol: Any) -> None:
        super().__init__(fileno=fd)
        self.loop = loop
        self.protocol = protocol
        self.transport = _Captured()
        self.inside = 0.0
        self.sent: list[bytes] = []
        self.peer: socket.socket | None = None
        protocol.connection_made(self.transport)

    def sendmsg(self, buffers: Any, *args: Any) -> int:  # type: ignore[override]
        t0 = time.perf_counter()
        data = b"".join(buffers)
        self.sent.append(data)
        self.protocol.data_received(data)
        self._run_until_written()
        self.inside += time.perf_counter() - t0
        return len(data)

    def _run_until_written(self) -> None:
        transport = self.transport
        if transport.out:
            return
        loop = self.loop
        written = transport.written = loop.create_future()
        timer = loop.call_later(10.0, written.cancel)  # a bug, not a wait: fail, don't hang
        try:
            loop.run_until_complete(written)
        finally:
            timer.cancel()
            transport.written = None

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[override]
        t0 = time.perf_counter()
        out = self.transport.out
        if not out:
            self._run_until_written()
        view = memoryview(buffer)
        n = min(len(out), len(view) if not nbytes else nbytes)
        view[:n] = out[:n]
        del out[:n]
        self.inside += time.perf_counter() - t0
        return n


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@contextlib.contextmanager
def _served(
    app: Any, loop: asyncio.AbstractEventLoop, lifespan: Any
) -> Iterator[Callable[[], Any]]:
    """A factory of the shard's HTTP protocol serving ``app`` on ``loop`` (as a shard serves:
    no access log, no proxy headers, no server header), with ``lifespan`` entered."""
    import uvicorn
    from uvicorn.server import ServerState

    from server.httptools_protocol import protocol_class

    config = uvicorn.Config(
        app,
        http=protocol_class(),
        lifespan="off",
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
    )
    config.load()
    state = ServerState()
    asyncio.set_event_loop(loop)
    if lifespan is not None:
        loop.run_until_complete(lifespan.__aenter__())
    try:
        yield lambda: protocol_class()(config=config, server_state=state, app_state={})
    finally:
        if lifespan is not None:
            loop.run_until_complete(lifespan.__aexit__(None, None, None))


def _wire_pool(pool: Any, loop: asyncio.AbstractEventLoop, make_protocol: Callable) -> LoopSocket:
    """Make ``pool`` (an :class:`~client_sdk._http.pool.HTTPPool`) connect through one
    :class:`LoopSocket` to a protocol from ``make_protocol``; return the socket."""
    from client_sdk._http.pool import BlockingConnection

    class Ready(BlockingConnection):
        """Never waits: the stand-in's socket always has its peer's answer (its descriptor
        never becomes readable, so a real wait would last until the deadline)."""

        def _wait(self, writing: bool, deadline: float) -> bool:
            return True

    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    sock = LoopSocket(a.detach(), loop, make_protocol())
    sock.peer = b  # kept open: a closed peer would make the connection look stale
    pool.connect = lambda origin, deadline: Ready(sock)
    return sock


async def _ready(app: Any) -> None:
    """Until the shard's gate admits requests (its restore ran)."""
    for _ in range(1000):
        if app.state.gate.phase == "ready":
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"the shard stayed {app.state.gate.phase!r}")


def _profiled(fn: Callable[[], object], reps: int) -> pstats.Stats:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    return pstats.Stats(prof)


def _client_side(
    fn: Callable[[], object], sock: LoopSocket, reps: int, profile: int
) -> tuple[float, list[bytes], pstats.Stats | None]:
    """Median µs per call spent outside ``sock`` (the client's Python); the requests sent
    in the timed calls; a profile of further calls if asked."""
    for _ in range(min(reps, 100)):
        fn()
    outside = []
    first = len(sock.sent)
    for _ in range(reps):
        before = sock.inside
        t0 = time.perf_counter()
        fn()
        outside.append(time.perf_counter() - t0 - (sock.inside - before))
    sent = sock.sent[first:]
    sock.sent.clear()
    stats = _profiled(fn, reps) if profile else None
    sock.sent.clear()
    return float(np.median(outside)) * 1e6, sent, stats


def _server_side(
    loop: asyncio.AbstractEventLoop,
    make_protocol: Callable,
    setup: list[bytes],
    requests: list[bytes],
    profile: int,
) -> tuple[float, pstats.Stats | None]:
    """Median µs the server's protocol and app take per request of ``requests`` (after
    ``setup``, untimed), each fed whole to a fresh connection's protocol and the loop turned
    until the reply's last byte is written; with ``profile``, half of them profiled instead."""
    from client_sdk._http.http11 import read_response

    async def go() -> tuple[float, pstats.Stats | None]:
        protocol = make_protocol()
        transport = _Captured()
        protocol.connection_made(transport)
        buf = bytearray(1 << 16)

        async def exchange(raw: bytes) -> None:
            protocol.data_received(raw)
            reading = read_response(buf, 1 << 21)  # until the whole reply was written
            target = next(reading)
            try:
                while True:
                    while not transport.out:  # noqa: ASYNC110 (the loop runs the reply)
                        await asyncio.sleep(0)
                    n = min(len(target), len(transport.out))
                    target[:n] = transport.out[:n]
                    del transport.out[:n]
                    target = reading.send(n)
            except StopIteration as done:
                if done.value[0].status != 200:
                    raise RuntimeError(f"the server answered {done.value[0].status}") from None

        for raw in setup:
            await exchange(raw)
        timed = requests[: len(requests) // 2] if profile else requests
        samples = []
        for raw in timed:
            t0 = time.perf_counter()
            await exchange(raw)
            samples.append(time.perf_counter() - t0)
        stats = None
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for raw in requests[len(timed) :]:
                await exchange(raw)
            prof.disable()
            stats = pstats.Stats(prof)
        protocol.connection_lost(None)
        return float(np.median(samples[len(samples) // 10 :])) * 1e6, stats

    return loop.run_until_complete(go())


#: What a side's functions live in, by path.
_SIDES = {
    False: ("/client_sdk/",),
    True: ("/server/", "uvicorn", "starlette", "fastapi", "asyncio"),
}


def _calls(stats: pstats.Stats, calls_made: int, server: bool) -> float:
    """Python function calls per call on one side (as the profiler counts them: a measure of
    the interpreter's work that no load on the machine changes)."""
    total = 0
    for (path, _, _), (_, calls, _, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "smallcost" not in path and any(part in path for part in _SIDES[server]):
            total += calls
    return total / calls_made


def _top(stats: pstats.Stats, calls_made: int, k: int, server: bool) -> list[str]:
    """The ``k`` Python functions of one side with the most own time, µs per call."""
    rows = []
    for (path, line, func), (_, calls, own, _cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "smallcost" in path or not any(part in path for part in _SIDES[server]):
            continue
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}"
        rows.append((own / calls_made * 1e6, calls / calls_made, f"{where} {func}"))
    rows.sort(reverse=True)
    return [f"      {us:7.2f} us  {calls:5.1f}x  {what}" for us, calls, what in rows[:k]]


def run_in_process(
    reps: int, profile: int = 0, out: Callable[[str], None] = print, layers: bool = True
) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (op, variant): µs per call of the client's Python and of the server's (medians);
    without ``layers``, the shard only as it runs by default."""
    from client_sdk import PSClient
    from client_sdk._http.http11 import Origin
    from client_sdk._http.pool import HTTPPool
    from client_sdk.optimizers import Add
    from server.app import create_app, serving_app
    from server.config import ShardConfig

    results: dict[tuple[str, str], tuple[float, float]] = {}

    def report(
        op: str,
        variant: str,
        client: tuple[float, list[bytes], pstats.Stats | None],
        server: tuple[float, pstats.Stats | None],
    ) -> None:
        results[op, variant] = (client[0], server[0])
        out(f"{op:<10}{variant:<34}{client[0]:>9.1f}{server[0]:>11.1f}")
        for side, stats, n in (("client", client[2], reps), ("server", server[1], reps // 2)):
            if stats is not None:
                out(f"    {side} side: {_calls(stats, n, side == 'server'):.0f} Python calls")
                for line in _top(stats, n, profile, server=side == "server"):
                    out(line)

    # the floor: the SDK's connection code and the trivial server
    loop = _new_loop()
    try:
        with _served(_Trivial(), loop, None) as make:
            body = bytes(4 * N)
            for op, path, sent, reply in (
                ("pull", "/now/pull", b"", 4 * N),
                ("push", "/app/push", body, SMALL),
                ("increment", "/app/increment", bytes(SMALL), SMALL),
            ):
                pool = HTTPPool(max_idle=1, connect_timeout=5, timeout=30, max_reply=1 << 21)
                sock = _wire_pool(pool, loop, make)
                client = FloorClient.__new__(FloorClient)
                client._pool, client._origin = pool, Origin("http://127.0.0.1:1")
                client._paths = {op: path}
                measured = _client_side(
                    lambda c=client, o=op, s=sent, r=reply: c.call(o, s, r), sock, reps, profile
                )
                report(
                    op,
                    f"floor ({'in protocol' if path.startswith('/now') else 'app'})",
                    measured,
                    _server_side(loop, make, [], measured[1], profile),
                )
    finally:
        loop.close()

    variants: list[tuple[str, dict[str, Any]]] = [
        ("paramshard", {}),
        ("paramshard, token (auth on)", {"token": (_TOKEN,)}),
    ]
    for variant, settings in variants if layers else variants[:1]:
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            # one shard records what the SDK sends; a fresh one is timed replaying it
            recorded: dict[str, tuple[float, list[bytes], pstats.Stats | None]] = {}
            loop = _new_loop()
            try:
                app = create_app(ShardConfig(data_dir=f"{tmp}/recorded", **settings))
                with _served(serving_app(app), loop, app.router.lifespan_context(app)) as make:
                    with PSClient(
                        ["http://127.0.0.1:1"],
                        worker_id="bench-smallcost",
                        token=_TOKEN if "token" in settings else None,
                    ) as ps:
                        sock = _wire_pool(ps._sender.pool, loop, make)
                        ps.init({"x": np.zeros(N, np.float32)}, optimizer=Add())
                        setup = list(sock.sent)
                        sock.sent.clear()
                        calls = _sdk_calls(ps, "x", "c")
                        for op in OPS:
                            recorded[op] = _client_side(calls[op], sock, reps, profile)
            finally:
                loop.close()
            loop = _new_loop()
            try:
                app = create_app(ShardConfig(data_dir=f"{tmp}/replayed", **settings))
                with _served(serving_app(app), loop, app.router.lifespan_context(app)) as make:
                    loop.run_until_complete(_ready(app))
                    for op in OPS:
                        server = _server_side(loop, make, setup, recorded[op][1], profile)
                        report(op, variant, recorded[op], server)
            finally:
                loop.close()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.smallcost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--reps", type=int, default=2000, help="timed calls per line (default 2000)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="K",
        help="also list each side's K dearest functions (in-process part)",
    )
    p.add_argument(
        "--part", choices=("wire", "process", "both"), default="both", help="which part to run"
    )
    p.add_argument(
        "--no-layers",
        action="store_true",
        help="in-process part: the shard as it runs by default only (not with a token too)",
    )
    args = p.parse_args(argv)
    if args.reps < 10 or args.profile < 0:
        p.error("--reps must be >= 10 and --profile >= 0")
    print(f"4 KB pull, 4 KB push, increment; medians of {args.reps}; load {os.getloadavg()}")
    if args.part in ("wire", "both"):
        print(
            f"\n{'op':<10}{'over the wire':<20}{'wall us':>9}{'client CPU':>12}{'server CPU':>12}"
        )
        run_over_wire(args.reps)
    if args.part in ("process", "both"):
        print(f"\n{'op':<10}{'in one process, no I/O':<34}{'SDK us':>9}{'server us':>11}")
        run_in_process(args.reps, args.profile, layers=not args.no_layers)


if __name__ == "__main__":
    main()
