"""Where the time of one big pull and push goes: ``python -m bench.breakdown [--size 2.5e7]``.

Not a case of ``make bench``: a diagnostic for whoever makes the SDK or the shard faster. It
starts one shard and the raw-socket server, then times, for one float32 variable (medians of
``--reps``), the pieces a transfer is made of:

pull
    * ``PSClient.pull`` as a user sees it;
    * the same request through bare ``httpx2``: time to the response headers (the shard
      decodes the request, exports the value, encodes the reply), then the body read chunk by
      chunk into one preallocated buffer (what the SDK does over httpx2, for
      ``https://`` shards; ``http://`` ones it reads through its own connection pool), and the body
      read by httpx2's own ``Response.read()`` (which joins the chunks);
    * the same request over a bare socket, the body ``recv_into`` one buffer (no client
      library: what the shard's side costs);
    * the raw socket moving the same bytes.
push
    * ``PSClient.push`` (includes the shard's apply and, after a pull, its copy-on-write);
    * the same framed body through bare ``httpx2`` and over a bare socket to a variable that
      does not exist: the shard reads the whole body before it looks at the names, so this is
      the transfer and the body read without any apply (the answer is a 404);
    * the raw socket.
local
    * memory costs on this machine for the same byte count: zero-filling a new ``bytearray``,
      copying into fresh memory, copying into memory already touched, ``value += grad``.

Blocking; runs in well under a minute at the default size.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
import msgpack
import numpy as np

from . import processes
from .rawsock import RawClient

__all__ = ["main"]


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


def _read_into(response: httpx2.Response) -> np.ndarray:
    buf = np.empty(int(response.headers["content-length"]), dtype=np.uint8)
    pos = 0
    for chunk in response.iter_raw():
        buf[pos : pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        pos += len(chunk)
    assert pos == buf.nbytes
    return buf


class _SocketHTTP:
    """HTTP/1.1 over a bare socket: the request written with ``sendall`` from the caller's
    buffers, the response body read with ``recv_into`` into one buffer. Takes the HTTP client
    library out of the measurement, leaving the shard's side."""

    def __init__(self, host: str, port: int) -> None:
        import socket

        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, path: str, chunks: list, ctype: str, accept: str) -> tuple[int, np.ndarray]:
        size = sum(memoryview(c).nbytes for c in chunks)
        head = (
            f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: {ctype}\r\n"
            f"accept: {accept}\r\ncontent-length: {size}\r\n\r\n"
        ).encode()
        self._sock.sendall(head)
        for c in chunks:
            self._sock.sendall(c)
        raw = b""
        while b"\r\n\r\n" not in raw:
            more = self._sock.recv(65536)
            if not more:
                raise ConnectionError("shard closed the connection")
            raw += more
        head_bytes, rest = raw.split(b"\r\n\r\n", 1)
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(
            int(v)
            for k, _, v in (ln.partition(":") for ln in lines[1:])
            if k.strip().lower() == "content-length"
        )
        body = np.empty(length, dtype=np.uint8)
        body[: len(rest)] = np.frombuffer(rest, dtype=np.uint8)
        view, pos = memoryview(body), len(rest)
        while pos < length:
            k = self._sock.recv_into(view[pos:])
            if k == 0:
                raise ConnectionError("shard closed the connection mid-body")
            pos += k
        return status, body

    def close(self) -> None:
        self._sock.close()


def run(n: int, reps: int) -> list[tuple[str, str, float]]:
    from client_sdk import PSClient, wire
    from client_sdk.optimizers import Add

    rows: list[tuple[str, str, float]] = []
    nbytes = 4 * n

    def add(group: str, what: str, ms: float) -> None:
        rows.append((group, what, ms))
        print(f"{group:<6}{what:<62}{ms:>9.1f} ms", flush=True)

    with (
        tempfile.TemporaryDirectory(prefix="paramshard-breakdown-") as tmp,
        processes.shards(1, Path(tmp), "--log-level", "warning") as fleet,
        processes.raw_server(Path(tmp)) as raw_server,
        PSClient(fleet.urls, worker_id="breakdown") as ps,
        RawClient(raw_server.host, raw_server.port) as raw,
        httpx2.Client(base_url=fleet.urls[0], timeout=120) as http,
    ):
        value = np.random.default_rng(0).random(n, dtype=np.float32)
        grad = np.zeros(n, dtype=np.float32)
        ps.init({"x": value}, optimizer=Add())

        def bump() -> None:  # a new version, so that the next pull has to transfer
            ps.push({"x": grad})

        add("pull", "PSClient.pull", _median_ms(lambda: ps.pull(["x"]), reps, bump))
        pull_body = msgpack.packb({"names": ["x"]})
        headers = {"content-type": wire.MSGPACK, "accept": f"{wire.FRAME}, {wire.MSGPACK}"}
        marks: dict[str, list[float]] = {"head": [], "body": []}

        def bare_pull(read: Callable[[httpx2.Response], object]) -> Callable[[], None]:
            def go() -> None:
                t0 = time.perf_counter()
                with http.stream("POST", "/v1/pull", content=pull_body, headers=headers) as r:
                    t1 = time.perf_counter()
                    read(r)
                    marks["head"].append(t1 - t0)
                    marks["body"].append(time.perf_counter() - t1)

            return go

        add(
            "pull",
            "httpx2, body into one preallocated buffer: total",
            _median_ms(bare_pull(_read_into), reps),
        )
        add(
            "pull",
            "  of which: until response headers (shard work)",
            float(np.median(marks["head"][1:])) * 1e3,
        )
        add("pull", "  of which: body read", float(np.median(marks["body"][1:])) * 1e3)
        add(
            "pull",
            "httpx2, Response.read() (joins the chunks)",
            _median_ms(bare_pull(lambda r: r.read()), reps),
        )
        host_port = fleet.urls[0].removeprefix("http://").split(":")
        bare = _SocketHTTP(host_port[0], int(host_port[1]))
        add(
            "pull",
            "HTTP over a bare socket (recv_into; no client library)",
            _median_ms(
                lambda: bare.post("/v1/pull", [pull_body], wire.MSGPACK, wire.FRAME), reps, bump
            ),
        )
        add("pull", "raw socket, same bytes", _median_ms(lambda: raw.pull(nbytes), reps))

        add(
            "push",
            "PSClient.push (after a pull: includes copy-on-write)",
            _median_ms(lambda: ps.push({"x": grad}), reps, lambda: ps.pull(["x"])),
        )
        add(
            "push",
            "PSClient.push (no pull between pushes)",
            _median_ms(lambda: ps.push({"x": grad}), reps),
        )
        encoded = wire.encode({"worker_id": "b", "seq": 0, "grads": {"nope": grad}}, frame=True)
        add(
            "push",
            "wire.encode (framed; no copy of the tensor)",
            _median_ms(lambda: wire.encode({"grads": {"nope": grad}}, frame=True), reps),
        )

        def bare_push() -> None:
            r = http.post(
                "/v1/push",
                content=iter(encoded.chunks),
                headers={"content-type": wire.FRAME, "content-length": str(encoded.nbytes)},
            )
            assert r.status_code == 404, r.status_code

        add(
            "push",
            "httpx2, same body to an unknown name (transfer + read, no apply)",
            _median_ms(bare_push, reps),
        )
        add(
            "push",
            "HTTP over a bare socket, same body to an unknown name",
            _median_ms(lambda: bare.post("/v1/push", encoded.chunks, wire.FRAME, wire.FRAME), reps),
        )
        add("push", "raw socket, same bytes", _median_ms(lambda: raw.push(grad), reps))
        bare.close()

        touched = np.ones(nbytes, dtype=np.uint8)
        src = value.view(np.uint8)
        add(
            "local",
            "bytearray(n): allocate and zero-fill",
            _median_ms(lambda: bytearray(nbytes), reps),
        )
        add("local", "copy into fresh memory (value.copy())", _median_ms(value.copy, reps))
        add(
            "local",
            "copy into memory already touched",
            _median_ms(lambda: np.copyto(touched, src), reps),
        )
        v2 = value.copy()
        add(
            "local",
            "value += grad (the Add optimizer)",
            _median_ms(lambda: np.add(v2, grad, out=v2), reps),
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.breakdown", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size", type=float, default=2.5e7, help="float32 elements (default 2.5e7)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions of each step (default 7)")
    args = p.parse_args(argv)
    n = int(args.size)
    print(f"one float32 variable of {n:,} elements ({4 * n / 1e6:.1f} MB), medians of {args.reps}")
    run(n, args.reps)


if __name__ == "__main__":
    main()
