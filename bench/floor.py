"""The floor under a small request: one round trip of 4 KB through the shard's own HTTP stack
with nothing behind it, next to the raw TCP socket and to ``PSClient`` doing the same.

Three ops, each one request and one reply, all on loopback and on connections kept alive:

``pull``
    a small request answered with 4 KB (``--sizes`` float32 elements; 1,000 by default);
``push``
    a 4 KB request answered with a few bytes;
``increment``
    a few bytes each way.

Systems, taking turns repetition by repetition (the order rotating, as in
:mod:`bench.transfer`):

* *raw socket* (the reference, :mod:`bench.rawsock`): the same bytes with an 8-byte length
  prefix, nothing parsed; what the kernel and two Python processes waking each other cost;
* *http, app*: the SDK's own HTTP/1.1 connection code (``client_sdk._http.pool.HTTPPool``,
  what ``PSClient`` sends through) against a server run as a shard runs (uvicorn on uvloop,
  the shard's protocol class :class:`server.httptools_protocol.ShardHttpProtocol`, no access
  log) whose ASGI app is a trivial handler: it reads the body and answers fixed bytes. The
  floor for a request that goes through an ASGI request cycle (a push, an increment);
* *http, in protocol*: the same server and connection code, the request answered inside the
  protocol's parser callbacks (:data:`server.httptools_protocol.IMMEDIATE`, as a shard answers
  a small pull): the floor for a request answered without a request cycle;
* *paramshard*: ``PSClient`` against one shard: ``ps.pull([name])`` of a 4 KB float32
  variable after a push made its cached version stale (so all 4 KB come), ``ps.push({name:
  zeros})`` through the ``Add`` optimizer (returns once applied), ``ps.increment(counter)``.

The server is ``python -m bench.floor`` (prints ``port <P>``, serves until stdin closes).
The gap from the raw socket to *http* is what HTTP in Python costs here (both ends parsing a
head, the event loop); from *http* to *paramshard* is the SDK's and the shard's own work
(``python -m bench.smallcost`` takes it apart).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import processes
from .context import Context
from .rawsock import RawClient
from .timing import Stopwatch, reps_for, summarize
from .transfer import RAW, SDK, rotated

__all__ = [
    "APP",
    "DEFAULT_SIZES",
    "DESCRIPTION",
    "IN_PROTOCOL",
    "OPS",
    "FloorClient",
    "floor_server",
    "run",
    "serve",
]

DESCRIPTION = (
    "one small round trip (4 KB pull, 4 KB push, increment): PSClient vs the shard's HTTP "
    "stack with a trivial handler vs a raw TCP socket"
)
DEFAULT_SIZES = (1_000,)
OPS = ("pull", "push", "increment")
#: The trivial server through an ASGI request cycle, and answered inside the protocol.
APP, IN_PROTOCOL = "http, app", "http, in protocol"
#: Bytes of a push's and an increment's reply, and of an increment's request.
SMALL = 8
_CTYPE = "application/octet-stream"


# -- the trivial server -------------------------------------------------------------------


def _paths(prefix: str) -> dict[str, bytes]:
    return {op: f"/{prefix}/{op}".encode() for op in OPS}


class _Trivial:
    """An ASGI app that reads a ``POST``'s body and answers ``n`` bytes, ``n`` given by the
    ``x-reply-bytes`` header (at most 1 MiB); and the same as answerers for the protocol
    (:data:`server.httptools_protocol.IMMEDIATE`) under ``/now/``."""

    def __init__(self) -> None:
        from server.httptools_protocol import Immediate

        self._replies: dict[int, bytes] = {}

        def answer(headers: dict[bytes, bytes], body: bytes) -> Immediate:
            reply = self._reply(headers.get(b"x-reply-bytes"))
            return Immediate(
                [(b"content-type", _CTYPE.encode()), (b"content-length", b"%d" % len(reply))],
                [reply],
                len(reply),
            )

        self.immediate = {path: answer for path in _paths("now").values()}

    def _reply(self, asked: bytes | None) -> bytes:
        n = int(asked) if asked is not None and asked.isdigit() else SMALL
        n = min(n, 1 << 20)
        reply = self._replies.get(n)
        if reply is None:
            reply = self._replies[n] = bytes(n)
        return reply

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return  # no lifespan: served with lifespan="off"
        while (await receive()).get("more_body"):
            pass
        asked = next((v for k, v in scope["headers"] if k == b"x-reply-bytes"), None)
        reply = self._reply(asked)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", _CTYPE.encode()),
                    (b"content-length", b"%d" % len(reply)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": reply})


def serve(host: str = "127.0.0.1") -> None:
    """Serve :class:`_Trivial` as a shard serves its app, on a free port; print ``port <P>``
    once listening; serve until stdin reaches EOF. Blocks."""
    import importlib.util
    import socket
    import threading

    import uvicorn

    from server.httptools_protocol import protocol_class

    sock = socket.create_server((host, 0))
    config = uvicorn.Config(
        _Trivial(),
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http=protocol_class(),
        lifespan="off",
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    threading.Thread(
        target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)), daemon=True
    ).start()
    print(f"port {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


class FloorServer(NamedTuple):
    host: str
    port: int
    pid: int


@contextlib.contextmanager
def floor_server(logdir: Path) -> Iterator[FloorServer]:
    """Start ``python -m bench.floor`` and yield its address and pid; stop it on exit."""
    log = logdir / "floor.log"
    proc = processes.spawn([sys.executable, "-m", "bench.floor"], log, pipes=True)
    try:
        words = processes.LineReader(proc, log, "floor server").readline(60.0).split()
        if len(words) != 2 or words[0] != "port":
            raise RuntimeError(f"floor server did not start:\n{processes.tail(log)}")
        yield FloorServer("127.0.0.1", int(words[1]), proc.pid)
    finally:
        processes.stop(proc, grace=5.0)


class FloorClient:
    """Requests to the trivial server through the SDK's own blocking connection pool (one
    connection, kept alive). Not thread-safe."""

    def __init__(self, host: str, port: int, in_protocol: bool) -> None:
        from client_sdk._http.http11 import Origin
        from client_sdk._http.pool import HTTPPool

        self._pool = HTTPPool(max_idle=1, connect_timeout=5.0, timeout=30.0, max_reply=1 << 21)
        self._origin = Origin(f"http://{host}:{port}")
        self._paths = {op: p.decode() for op, p in _paths("now" if in_protocol else "app").items()}

    def call(self, op: str, body: bytes, reply_bytes: int) -> int:
        """POST ``body`` to ``op``'s path, asking for ``reply_bytes``; the reply's size."""
        response = self._pool.request(
            self._origin,
            "POST",
            self._paths[op],
            {
                "content-type": _CTYPE,
                "content-length": str(len(body)),
                "x-reply-bytes": str(reply_bytes),
            },
            (body,) if body else (),
        )
        if response.status != 200:
            raise RuntimeError(f"floor server answered {response.status} to {op}")
        return len(response.content)

    def close(self) -> None:
        self._pool.close()


# -- the case -----------------------------------------------------------------------------


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient

    fleet = ctx.fleet(1)
    raw_server = ctx.raw()
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        trivial = stack.enter_context(floor_server(ctx.logdir))
        ps = stack.enter_context(PSClient(fleet.urls, worker_id="bench-floor"))
        raw = stack.enter_context(RawClient(raw_server.host, raw_server.port))
        app = FloorClient(trivial.host, trivial.port, in_protocol=False)
        stack.callback(app.close)
        now = FloorClient(trivial.host, trivial.port, in_protocol=True)
        stack.callback(now.close)
        for n in ctx.sizes_for(DEFAULT_SIZES):
            rows += _one_size(ctx, n, ps, raw, {APP: app, IN_PROTOCOL: now})
    order = {s: k for k, s in enumerate((RAW, IN_PROTOCOL, APP, SDK))}
    rows.sort(key=lambda r: (OPS.index(r["op"]), r["size"], order[r["system"]]))
    return rows


def _one_size(
    ctx: Context, n: int, ps: Any, raw: RawClient, http: dict[str, FloorClient]
) -> list[dict]:
    from client_sdk.optimizers import Add

    name, counter = f"bench/floor/f32-{n}", f"bench/floor/counter-{n}"
    value = np.random.default_rng(n).random(n, dtype=np.float32)
    grad = np.zeros(n, dtype=np.float32)
    nbytes = value.nbytes
    body = bytes(nbytes)
    ps.init({name: value}, optimizer=Add())
    systems = [RAW, IN_PROTOCOL, APP, SDK]
    watches = {(op, s): Stopwatch() for op in OPS for s in systems}
    small = np.zeros(SMALL, np.uint8)
    seen: list[int] = []

    def sdk_turn() -> None:
        with watches["push", SDK]:
            ps.push({name: grad})
        with watches["pull", SDK]:
            pulled = ps.pull([name])[name]
        with watches["increment", SDK]:
            seen.append(int(ps.increment(counter, 1)))
        if pulled.shape != (n,):
            raise RuntimeError(f"{name}: pulled {pulled.shape}, expected ({n},)")

    def raw_turn() -> None:
        with watches["push", RAW]:
            raw.push(grad)
        with watches["pull", RAW]:
            raw.pull(nbytes)
        with watches["increment", RAW]:
            raw.push(small)

    def http_turn(system: str) -> None:
        client = http[system]
        with watches["push", system]:
            got = client.call("push", body, SMALL)
        with watches["pull", system]:
            got += client.call("pull", b"", nbytes)
        with watches["increment", system]:
            got += client.call("increment", bytes(SMALL), SMALL)
        if got != nbytes + 2 * SMALL:
            raise RuntimeError(f"{system}: replies of {got} bytes, not {nbytes + 2 * SMALL}")

    turns = [sdk_turn, raw_turn, *(functools.partial(http_turn, s) for s in http)]
    reps = reps_for(nbytes, ctx.reps, ctx.min_reps)
    for i in range(ctx.warmup + reps):
        if i == ctx.warmup:
            for w in watches.values():
                w.samples.clear()
        for turn in rotated(turns, i):
            turn()
    if seen != sorted(set(seen)) or not np.array_equal(ps.pull([name])[name], value):
        raise RuntimeError("increments repeated a value, or pushing zeros changed the value")
    return [
        {
            "case": "floor",
            "op": op,
            "size": n,
            "system": system,
            "reference": system == RAW,
            **summarize(w.samples, nbytes if op != "increment" else SMALL),
        }
        for (op, system), w in watches.items()
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.splitlines()[0])
    p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        serve()


if __name__ == "__main__":
    main()
