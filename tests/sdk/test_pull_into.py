"""``pull(names, out={...})`` receives the values straight into the caller's buffers: nothing
parameter-sized is copied or allocated on the way (client_sdk/_into.py), against a real 2-shard
fleet, sync (one shard, and both in one call: the fan-out) and asyncio, plain and partitioned
variables, ``wire_dtype``.

"Nothing copied" is counted the way ``bench/frameworks.py`` counts it: the bytes
``np.copyto`` writes during the pull, and the peak of numpy's allocations (``tracemalloc``),
both a fraction of one value's size. The version cache keeps no copy of a value it lent to a
buffer (``_cache.lent``), so a buffer changed by its owner is written again by the next pull,
and the versions, later plain pulls and polls still see the right values.

Replies the SDK cannot receive that way are read whole and written as before: a chunked body
(through a proxy that re-frames it), a value made again with another shape (refused, every
buffer left as it was), a table that claims more bytes than the body has (refused). A reply cut
off mid-body ends the pull with an error within the retry deadline, and the next pull writes
every buffer.

The sink alone (no network): however a body's bytes arrive, every row ends where it belongs
(into its buffer if big enough, else into the sink's own buffer), and a buffer of another
shape has the body received whole. ``wire.table_spans`` lays tables out as ``table_rows``
reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadTensorError,
    ProtocolError,
    PSClient,
    ShardUnavailableError,
    wire,
)
from client_sdk._into import DIRECT_BYTES, Sink
from client_sdk.optimizers import SGD
from client_sdk.placement import shard_for
from client_sdk.wire import halves
from tests.helpers.dropproxy import DroppingProxy
from tests.helpers.names import fresh
from tests.helpers.sinks import drive

#: float32 elements of each test variable (8 MiB): far above what is received apart.
N = 1 << 21
NBYTES = 4 * N
#: What a pull into buffers may copy or allocate for values of NBYTES each: headers, the
#: sink's small buffers, the cache's stand-ins, and msgpack's packing buffer (256 KiB; 1 MiB
#: in the oldest msgpack the SDK takes).
SMALL = 2 * 1024 * 1024


def on_both(prefix: str) -> list[str]:
    names: dict[int, str] = {}
    while len(names) < 2:
        name = fresh(prefix)
        names.setdefault(shard_for(name, 2), name)
    return [names[0], names[1]]


@contextlib.contextmanager
def counted() -> Iterator[dict[str, int]]:
    """The bytes ``np.copyto`` writes and numpy's allocation peak while it is open."""
    seen = {"copied": 0, "peak": 0}
    copyto = np.copyto

    def counting(dst, src, *args, **kwargs):
        seen["copied"] += np.asarray(dst).nbytes
        copyto(dst, src, *args, **kwargs)

    np.copyto = counting
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    try:
        yield seen
    finally:
        seen["peak"] = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        np.copyto = copyto


def values_of(names: list[str], k: float) -> dict[str, np.ndarray]:
    return {n: np.full(N, k + i, np.float32) for i, n in enumerate(names)}


def test_a_pull_into_buffers_copies_and_allocates_nothing_parameter_sized(fleet2):
    names = on_both("into")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init(values_of(names, 1.0), optimizer=SGD(lr=1.0))
        bufs = {n: np.zeros(N, np.float32) for n in names}
        ps.pull(names, out=bufs)  # connections open
        for one in ([names[0]], [names[1]], names):  # one shard (pool), both (fan-out)
            for buf in bufs.values():
                buf[:] = 0
            with counted() as seen:
                got = ps.pull(one, out={n: bufs[n] for n in one})
            assert seen["copied"] < SMALL and seen["peak"] < SMALL, (one, seen)
            for n in one:
                assert got[n] is bufs[n]
                assert (bufs[n] == 1.0 + names.index(n)).all()
        # the cache lends, never keeps: the buffers changed by their owner are written again
        # (the values were sent again, not taken from a copy), and versions still go with a push
        bufs[names[0]][:] = 7
        ps.pull(names, out=bufs)
        assert (bufs[names[0]] == 1.0).all()
        assert ps.versions(names) == {n: 0 for n in names}
        ps.push({n: np.ones(N, np.float32) for n in names})
        with counted() as seen:
            ps.pull(names, out=bufs)
        assert seen["copied"] < SMALL and seen["peak"] < SMALL, seen
        assert (bufs[names[0]] == 0.0).all() and (bufs[names[1]] == 1.0).all()
        # a plain pull after it gets the values, not the cache's stand-ins
        plain = ps.pull(names)
        assert (plain[names[0]] == 0.0).all() and (plain[names[1]] == 1.0).all()
        # a poll for news of what was pulled into buffers waits: nothing changed
        assert ps.pull(names, out=bufs) and ps.pull(names, newer_than="cached", timeout=0.5) == {}


def test_the_async_client_receives_into_buffers_too(fleet2):
    names = on_both("ainto")

    async def run() -> dict[str, int]:
        async with AsyncPSClient(fleet2.urls, worker_id=fresh("w")) as ps:
            await ps.init(values_of(names, 3.0))
            bufs = {n: np.zeros(N, np.float32) for n in names}
            await ps.pull(names, out=bufs)  # connections open
            for buf in bufs.values():
                buf[:] = 0
            with counted() as seen:
                got = await ps.pull(names, out=bufs)
            assert all(got[n] is bufs[n] for n in names)
            assert (bufs[names[0]] == 3.0).all() and (bufs[names[1]] == 4.0).all()
            return seen

    seen = asyncio.run(run())
    assert seen["copied"] < SMALL and seen["peak"] < SMALL, seen


def test_partitioned_variables_and_small_ones_are_received_into_their_buffers(fleet2):
    big, small = fresh("parts"), fresh("small")
    value = np.arange(N, dtype=np.float32).reshape(64, -1)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({big: value, small: np.arange(10, dtype=np.float32)}, partitions={big: 3})
        buf, tiny = np.zeros_like(value), np.zeros(10, np.float32)
        ps.pull([big, small], out={big: buf, small: tiny})
        buf[:] = 0
        with counted() as seen:
            ps.pull([big, small], out={big: buf, small: tiny})
        # the parts went into the buffer's rows; the small value was copied (40 bytes)
        assert seen["copied"] < SMALL and seen["peak"] < SMALL, seen
        assert np.array_equal(buf, value) and np.array_equal(tiny, np.arange(10))


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_a_narrowed_reply_is_widened_into_the_buffer(fleet2, wire_dtype):
    pytest.importorskip("ml_dtypes")
    name = fresh("half")
    value = (np.arange(N, dtype=np.float32) % 64) / 8  # exact in both half dtypes
    with (
        PSClient(fleet2.urls, worker_id=fresh("w")) as writer,
        PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype) as ps,
    ):
        writer.init({name: value})
        buf = np.zeros(N, np.float32)
        ps.pull([name], out={name: buf})
        writer.assign({name: value * 2})  # a new value travels
        with counted() as seen:
            ps.pull([name], out={name: buf})
        assert np.array_equal(buf, value * 2)
        # the cast into the buffer is the one copy; the narrowed bytes were received apart
        assert seen["copied"] <= NBYTES and seen["peak"] < NBYTES // 2 + SMALL, seen


def test_a_narrowed_reply_without_buffers_is_widened_as_it_arrives(fleet2):
    name = fresh("half")
    value = (np.arange(N, dtype=np.float32) % 64) / 8  # exact in float16
    with (
        PSClient(fleet2.urls, worker_id=fresh("w")) as writer,
        PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16") as ps,
    ):
        writer.init({name: value})
        ps.pull([name])
        writer.assign({name: value * 2})
        with counted() as seen:
            got = ps.pull([name])[name]
        assert np.array_equal(got, value * 2) and not got.flags.writeable
        # the value is the one parameter-sized allocation: no narrowed body held whole
        assert seen["copied"] < SMALL and seen["peak"] < NBYTES + SMALL, seen


def test_a_value_of_another_shape_is_refused_and_leaves_its_shards_buffers_as_they_were(fleet2):
    name = fresh("remade")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps, PSClient(fleet2.urls) as other:
        ps.init({name: np.ones(N, np.float32)})
        buf = np.zeros(N, np.float32)
        ps.pull([name], out={name: buf})
        buf[:] = 5
        other.delete([name])
        other.init({name: np.ones(N + 16, np.float32)})  # made again, with another shape
        other.assign({name: np.ones(N + 16, np.float32)})  # (and version)
        with pytest.raises(BadTensorError, match=str(N + 16)):
            ps.pull([name], out={name: buf})
        assert (buf == 5).all()


# -- replies through a proxy --------------------------------------------------------------------


def _split(reply: bytes) -> tuple[bytes, bytes]:
    end = reply.index(b"\r\n\r\n") + 4
    return reply[:end], reply[end:]


def _without_length(head: bytes) -> bytes:
    lines = [ln for ln in head[:-4].split(b"\r\n") if not ln.lower().startswith(b"content-length")]
    return b"\r\n".join(lines)


def chunked(reply: bytes) -> bytes:
    """The reply with its body as chunks of 100 KB."""
    head, body = _split(reply)
    pieces = [body[i : i + 100_000] for i in range(0, len(body), 100_000)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return _without_length(head) + b"\r\ntransfer-encoding: chunked\r\n\r\n" + framed


def short_body(reply: bytes) -> bytes:
    """The reply with its body's last 1,000 bytes left out, and a Content-Length that says so:
    its table claims more bytes than the body has."""
    head, body = _split(reply)
    body = body[:-1000]
    return _without_length(head) + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body


@pytest.fixture
def proxied(fleet2):
    name = fresh("proxied")
    with PSClient(fleet2.urls) as ps:
        ps.init({name: np.full(N, 2.0, np.float32)})
    shard = shard_for(name, 2)
    with DroppingProxy(("127.0.0.1", fleet2.ports[shard])) as relay:
        urls = list(fleet2.urls)
        urls[shard] = relay.url
        yield name, relay, urls


def test_a_chunked_reply_is_written_into_the_buffers(proxied):
    name, relay, urls = proxied
    relay.alter = lambda method, path, reply: chunked(reply) if path == "/v1/pull" else reply
    with PSClient(urls, worker_id=fresh("w")) as ps:
        buf = np.zeros(N, np.float32)
        got = ps.pull([name], out={name: buf})
        assert got[name] is buf and (buf == 2.0).all()


def test_a_table_longer_than_its_body_is_refused_and_writes_nothing(proxied):
    name, relay, urls = proxied
    relay.alter = lambda method, path, reply: short_body(reply) if path == "/v1/pull" else reply
    with PSClient(urls, worker_id=fresh("w")) as ps:
        buf = np.full(N, 9.0, np.float32)
        with pytest.raises(ProtocolError, match="bad pull table"):
            ps.pull([name], out={name: buf})
        assert (buf == 9.0).all()


def test_a_reply_cut_off_mid_body_ends_the_pull_and_the_next_one_writes_it_all(proxied):
    name, relay, urls = proxied

    def cut(sock: socket.socket, method: str, path: str, reply: bytes) -> bool:
        if path != "/v1/pull":
            sock.sendall(reply)
            return True
        sock.sendall(reply[: len(reply) // 2])
        return False  # the connection closes half way through the body

    relay.deliver = cut
    with PSClient(urls, worker_id=fresh("w"), timeout=5.0, retry_deadline=1.0) as ps:
        buf = np.zeros(N, np.float32)
        started = time.monotonic()
        with pytest.raises(ShardUnavailableError, match="lost the connection"):
            ps.pull([name], out={name: buf})
        assert time.monotonic() - started < 30  # the retry deadline ends it, no hang
        relay.deliver = None
        buf[:] = 0
        ps.pull([name], out={name: buf})
        assert (buf == 2.0).all()


# -- the layout a sink reads --------------------------------------------------------------------


@pytest.mark.parametrize(
    "arrays, uniform, packed",
    [
        ([np.ones((3, 5), np.float32)] * 3, True, True),
        ([np.ones((3, 5), np.float32)] * 3, True, False),
        (
            [np.ones(7, np.float64), None, np.ones((2, 3), np.int16), np.zeros(0, np.float32)],
            False,
            False,
        ),
    ],
)
def test_table_spans_lays_a_table_out_as_table_rows_reads_it(arrays, uniform, packed):
    names = [f"v{i}" for i in range(len(arrays))]
    table: dict = {"names": names}
    encoded = wire.encode_table({"table": table}, table, arrays, uniform=uniform, packed=packed)
    body = encoded.join()
    start = wire.header_end(body)
    sent = msgpack.unpackb(body[8:start])["table"]
    got_names, rows = wire.table_rows(sent, body)
    spans_names, spans = wire.table_spans(sent, start, len(body))
    assert spans_names == got_names
    base = np.frombuffer(body, np.uint8).ctypes.data
    for row, span in zip(rows, spans):
        if row is None:
            assert span is None
            continue
        offset, dtype, shape = span
        assert (dtype, shape) == (row.dtype, row.shape)
        if row.nbytes:
            assert offset == row.ctypes.data - base
    with pytest.raises(wire.WireError):
        wire.table_spans(sent, start, len(body) - 1)


def test_widen_writes_into_a_given_buffer():
    value = halves.narrow_array(np.arange(8, dtype=np.float32), "float16")
    out = np.zeros(8, np.float32)
    assert halves.widen(value, out) is out and np.array_equal(out, np.arange(8))
    strided = np.zeros(16, np.float32)[::2]
    halves.widen(value, strided)
    assert np.array_equal(strided, np.arange(8))


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("first, step", [(0, 1 << 20), (100, 7), (5000, 4096), (70_000, 65_536)])
def test_a_sink_puts_every_row_where_it_belongs_however_the_bytes_come(uniform, first, step):
    rng = np.random.default_rng(first + step)
    if uniform:
        arrays = [rng.standard_normal(6000).astype(np.float32) for _ in range(4)]
    else:
        arrays = [
            rng.standard_normal(5000).astype(np.float32),  # 20 KB: into its buffer
            np.arange(10, dtype=np.float32),  # small: the sink's own buffer, then copied
            None,
            rng.standard_normal((100, 50)),  # 40 KB of float64
            np.arange(7, dtype=np.int16),
            rng.standard_normal(4500).astype(np.float32),  # 18 KB, right after the small ones
        ]
    names = [f"v{i}" for i in range(len(arrays))]
    table: dict = {"names": names}
    body = wire.encode_table({"table": table}, table, arrays, uniform=uniform).join()
    views = {n: np.zeros_like(a) for n, a in zip(names, arrays) if a is not None}
    sink = Sink(views, names, narrowed=False)
    content = drive(sink, body, min(first, len(body) - 1), step)
    assert sink.rows is not None and content == body[: wire.header_end(body)]
    got_names, rows = sink.rows
    assert got_names == names
    for name, array, row in zip(names, arrays, rows):
        if array is None:
            assert row is None
            continue
        assert np.array_equal(row, array), name
        assert (row is views[name]) == (array.nbytes >= DIRECT_BYTES), name
    # a buffer of another shape: the body is received whole, for the pull to refuse it
    views[names[0]] = np.zeros(arrays[0].size + 1, arrays[0].dtype)
    sink = Sink(views, names, narrowed=False)
    assert bytes(drive(sink, body, min(first, len(body) - 1), step)) == body
    assert sink.rows is None
