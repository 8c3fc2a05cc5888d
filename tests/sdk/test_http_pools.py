"""The SDK's own HTTP/1.1 connections (``client_sdk/_http/``: ``pool.py``, ``asyncpool.py``,
``fanout.py``, ``direct.py`` over ``connection.py``) and how their
failures surface.

Well-behaved exchanges are covered by every test that talks to a real shard. Here a scripted
TCP server stands in for a shard that misbehaves on cue (closes idle connections, hangs up
mid-request, never answers, sends chunked or malformed responses): a real shard cannot be made
to do that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client_sdk import AsyncPSClient, PSClient, ShardUnavailableError
from client_sdk._abort import Abort
from client_sdk._core import Core
from client_sdk._http import connection, direct, fanout
from client_sdk._http.asyncpool import AsyncHTTPPool
from client_sdk._http.fanout import exchange_all
from client_sdk._http.http11 import MAX_IOV, SEND_SLICE, Exchange, Origin, advance, next_send
from client_sdk._http.httpx_senders import AsyncHTTPXSender
from client_sdk._http.pool import HTTPPool
from client_sdk._settings import load_settings
from client_sdk.placement import shard_for


def read_request(conn: socket.socket, buf: bytearray) -> tuple[str, str] | None:
    """One request (head and Content-Length body) off ``conn``; (method, path), or None at EOF."""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(rest) < length:
        data = conn.recv(65536)
        if not data:
            return None
        rest += data
    buf[:] = rest[length:]
    method, path, _ = lines[0].split(" ", 2)
    return method, path


def response(status: int, body: bytes, ctype: str = "application/json", extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
        f"{extra}\r\n"
    ).encode() + body


def cluster(index: int, count: int) -> bytes:
    return json.dumps({"shard_index": index, "num_shards": count, "protocol_version": 1}).encode()


Handler = Callable[[socket.socket, str, str], bool]


class ScriptedServer:
    """Serves each connection in a thread: for every request, ``handler(conn, method, path)``
    answers (or not) and returns whether to keep the connection open. ``GET /v1/cluster``
    answers as shard ``index`` of ``count``. Counts connections and requests."""

    def __init__(self, handler: Handler, index: int = 0, count: int = 1) -> None:
        self.handler = handler
        self.cluster = cluster(index, count)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests: list[tuple[str, str]] = []
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        with conn:
            while True:
                try:
                    request = read_request(conn, buf)
                except OSError:
                    return
                if request is None:
                    return
                self.requests.append(request)
                if request == ("GET", "/v1/cluster"):
                    conn.sendall(response(200, self.cluster))
                    continue
                if not self.handler(conn, *request):
                    return

    def close(self) -> None:
        self.listener.close()
        for conn in self._open:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def make(handler: Handler, index: int = 0, count: int = 1) -> ScriptedServer:
        servers.append(ScriptedServer(handler, index, count))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def ok(conn: socket.socket, method: str, path: str) -> bool:
    conn.sendall(response(200, b'{"status": "ok"}'))
    return True


def pool(**kw) -> HTTPPool:
    args = {"max_idle": 2, "connect_timeout": 5.0, "timeout": 5.0, "max_reply": 1 << 30}
    return HTTPPool(**{**args, **kw})


# -- keep-alive ---------------------------------------------------------------------------------


def test_one_connection_carries_sequential_requests(scripted):
    server = scripted(ok)
    p, origin = pool(), Origin(server.url)
    for _ in range(3):
        assert p.request(origin, "GET", "/x", None).status == 200
    assert server.connections == 1
    assert p.idle_count(origin) == 1
    p.close()


def test_concurrent_requests_get_their_own_connections_and_at_most_max_idle_stay(scripted):
    gate = threading.Barrier(4)

    def slow(conn: socket.socket, method: str, path: str) -> bool:
        gate.wait(5)  # all four requests are in flight at once
        return ok(conn, method, path)

    server = scripted(slow)
    p, origin = pool(max_idle=2), Origin(server.url)
    threads = [
        threading.Thread(target=p.request, args=(origin, "GET", "/x", None)) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.connections == 4
    assert p.idle_count(origin) == 2
    p.close()


def test_a_connection_the_server_closed_while_idle_is_not_reused(scripted):
    closed = threading.Semaphore(0)

    def once(conn: socket.socket, method: str, path: str) -> bool:
        ok(conn, method, path)
        conn.close()  # as a server does when its keep-alive timeout runs out
        closed.release()
        return False

    server = scripted(once)
    p, origin = pool(), Origin(server.url)
    for _ in range(3):
        assert p.request(origin, "GET", "/x", None).status == 200
        assert closed.acquire(timeout=5)  # closed before the next request goes out
    assert server.connections == 3


def test_idle_connections_expire(scripted, monkeypatch):
    monkeypatch.setattr(connection, "IDLE_EXPIRY", -1.0)
    server = scripted(ok)
    p, origin = pool(), Origin(server.url)
    p.request(origin, "GET", "/x", None)
    p.request(origin, "GET", "/x", None)
    assert server.connections == 2


def test_a_connection_is_not_reused_after_connection_close(scripted):
    def closing(conn: socket.socket, method: str, path: str) -> bool:
        conn.sendall(response(200, b"{}", extra="connection: close\r\n"))
        return False

    server = scripted(closing)
    p, origin = pool(), Origin(server.url)
    p.request(origin, "GET", "/x", None)
    assert p.idle_count(origin) == 0


# -- response framing ---------------------------------------------------------------------------


def test_chunked_and_close_delimited_bodies(scripted):
    def chunked(conn: socket.socket, method: str, path: str) -> bool:
        if path == "/chunked":
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5;ext=1\r\nhello\r\n1\r\n \r\n"
            )
            conn.sendall(b"5\r\nworld\r\n0\r\ntrailer: x\r\n\r\n")
            return True
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        return False

    server = scripted(chunked)
    p, origin = pool(), Origin(server.url)
    r = p.request(origin, "GET", "/chunked", None)
    assert (r.status, bytes(r.content)) == (200, b"hello world")
    assert p.idle_count(origin) == 1
    r = p.request(origin, "GET", "/close", None)
    assert bytes(r.content) == b"until the end"
    assert p.idle_count(origin) == 0


def test_a_big_body_is_read_into_one_buffer(scripted):
    payload = np.arange(300_000, dtype=np.uint8).tobytes()

    def big(conn: socket.socket, method: str, path: str) -> bool:
        conn.sendall(response(200, payload, "application/octet-stream"))
        return True

    server = scripted(big)
    r = pool().request(Origin(server.url), "GET", "/big", None)
    assert isinstance(r.content, memoryview) and r.content == payload


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nxx",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\n content-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length : 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n: 0\r\ncontent-length: 0\r\n\r\n",
    ],
)
def test_malformed_responses_are_protocol_errors(scripted, raw):
    def bad(conn: socket.socket, method: str, path: str) -> bool:
        conn.sendall(raw)
        return False

    server = scripted(bad)
    with pytest.raises(httpx2.RemoteProtocolError):
        pool().request(Origin(server.url), "GET", "/x", None)


# -- failures through PSClient and AsyncPSClient -------------------------------------------------


def hang_up(conn: socket.socket, method: str, path: str) -> bool:
    return False  # the request arrived; no answer


def test_a_lost_connection_is_retried_then_reported(scripted):
    server = scripted(hang_up)
    with PSClient([server.url], retry_deadline=0.5) as ps:
        with pytest.raises(ShardUnavailableError, match="applied at most once") as info:
            ps.push({"w": np.ones(3, np.float32)})  # retried with the same seq
        assert isinstance(info.value.__cause__, httpx2.RemoteProtocolError)
        assert server.requests.count(("POST", "/v1/push")) > 1
        with pytest.raises(ShardUnavailableError, match="lost the connection"):
            ps.pull(["w"])
        assert server.requests.count(("POST", "/v1/pull")) > 1


def test_a_shard_that_never_answers_is_a_timeout(scripted):
    release = threading.Event()

    def silent(conn: socket.socket, method: str, path: str) -> bool:
        release.wait(10)
        return False

    server = scripted(silent)
    try:
        with PSClient([server.url], timeout=0.3, retry_deadline=0.1) as ps:
            with pytest.raises(ShardUnavailableError, match="in time") as info:
                ps.increment("c")
        assert isinstance(info.value.__cause__, httpx2.ReadTimeout)
    finally:
        release.set()


def test_async_client_failures_are_translated_alike(scripted):
    server = scripted(hang_up)

    async def main() -> None:
        async with AsyncPSClient([server.url], retry_deadline=0.5) as ps:
            with pytest.raises(ShardUnavailableError, match="applied at most once") as info:
                await ps.push({"w": np.ones(3, np.float32)})
            assert isinstance(info.value.__cause__, httpx2.RemoteProtocolError)
            with pytest.raises(ShardUnavailableError, match="lost the connection"):
                await ps.pull(["w"])

    asyncio.run(main())
    assert server.requests.count(("POST", "/v1/push")) > 1
    assert server.requests.count(("POST", "/v1/pull")) > 1


# -- several exchanges from one thread (fanout.py) -----------------------------------------------


def submit(fn, *args):
    future = concurrent.futures.Future()
    future.set_result(fn(*args))  # new connections open on the calling thread: fine here
    return future


@pytest.fixture(params=["poll", "selector"])
def waits_with(request, monkeypatch):
    """exchange_all waiting on select.poll, and on a selector as where there is no poll."""
    if request.param == "selector":
        monkeypatch.setattr(fanout, "_POLL", None)
    return request.param


def test_exchanges_run_at_once_from_one_thread_and_reuse_their_connections(scripted, waits_with):
    gate = threading.Barrier(2)
    payload = np.arange(2_000_000, dtype=np.uint8).tobytes()

    def together(conn: socket.socket, method: str, path: str) -> bool:
        gate.wait(5)  # both requests are in flight at once, or neither is answered
        conn.sendall(response(200, payload, "application/octet-stream"))
        return True

    servers = [scripted(together), scripted(together)]
    p = pool()
    origins = [Origin(s.url) for s in servers]
    body = [b"x" * 100, memoryview(np.ones(6_000_000, np.uint8))]  # more than a socket takes
    for _ in range(2):
        out = exchange_all(
            p,
            [Exchange(o, "POST", "/x", {"content-length": "6000100"}, body) for o in origins],
            submit,
        )
        assert [r.status for r in out] == [200, 200]
        assert all(bytes(r.content) == payload for r in out)
    assert [s.connections for s in servers] == [1, 1]
    assert [p.idle_count(o) for o in origins] == [1, 1]
    assert [s.requests for s in servers] == [[("POST", "/x")] * 2] * 2


def test_one_exchange_failing_ends_it_alone(scripted, waits_with):
    release = threading.Event()

    def silent(conn: socket.socket, method: str, path: str) -> bool:
        release.wait(10)
        return False

    hung_up, mute, fine = scripted(hang_up), scripted(silent), scripted(ok)
    unlistened = _bound_not_listening()
    refused = f"http://127.0.0.1:{unlistened.getsockname()[1]}"
    reader = socket.create_server(("127.0.0.1", 0))  # accepts, never reads
    stuck = f"http://127.0.0.1:{reader.getsockname()[1]}"
    p = pool()
    big = [memoryview(np.ones(64_000_000, np.uint8))]
    soon = time.monotonic() + 0.3
    try:
        out = exchange_all(
            p,
            [
                Exchange(Origin(hung_up.url), "GET", "/x", None),
                Exchange(Origin(mute.url), "GET", "/x", None, deadline=soon),
                Exchange(Origin(refused), "GET", "/x", None),
                Exchange(
                    Origin(stuck), "POST", "/x", {"content-length": "64000000"}, big, deadline=soon
                ),
                Exchange(Origin(fine.url), "GET", "/x", None),
            ],
            submit,
        )
    finally:
        release.set()
        reader.close()
        unlistened.close()
    assert [type(r) for r in out[:4]] == [
        httpx2.RemoteProtocolError,
        httpx2.ReadTimeout,
        httpx2.ConnectError,
        httpx2.WriteTimeout,
    ]
    assert out[4].status == 200
    assert [p.idle_count(Origin(u)) for u in (hung_up.url, mute.url, fine.url)] == [0, 0, 1]


def _post(origin: Origin, body: bytes) -> tuple:
    head = f"POST /x HTTP/1.1\r\nhost: {origin.host_header}\r\ncontent-length: {len(body)}\r\n\r\n"
    return (origin, [head.encode(), body], time.monotonic() + 5, 1 << 20, None)


def test_direct_exchanges_send_every_request_before_reading_a_reply(scripted):
    gate = threading.Barrier(2)

    def together(conn: socket.socket, method: str, path: str) -> bool:
        if method == "POST":
            gate.wait(5)  # both requests are in flight at once, or neither is answered
        conn.sendall(response(200, path.encode(), "application/octet-stream"))
        return True

    servers = [scripted(together), scripted(together)]
    p = pool()
    origins = [Origin(s.url) for s in servers]
    body = np.ones(300_000, np.uint8).tobytes()
    assert direct.exchange_all(p, [_post(o, body) for o in origins]) is None  # none idle
    assert [s.requests for s in servers] == [[], []]  # nothing sent
    for o in origins:
        assert p.request(o, "GET", "/open", None).status == 200  # now idle, one each
    too_big = b"x" * (direct.MAX_SENT_AT_ONCE + 1)
    assert direct.exchange_all(p, [_post(origins[0], body), _post(origins[1], too_big)]) is None
    for _ in range(2):
        out = direct.exchange_all(p, [_post(o, body) for o in origins])
        assert [(r.status, bytes(r.content)) for r in out] == [(200, b"/x")] * 2
    assert [s.connections for s in servers] == [1, 1]
    assert [p.idle_count(o) for o in origins] == [1, 1]
    assert [s.requests for s in servers] == [[("GET", "/open"), ("POST", "/x"), ("POST", "/x")]] * 2


def test_a_direct_reply_head_seen_last_on_its_connection_is_not_parsed_again(scripted, monkeypatch):
    """The same head bytes as the connection's last: that head's status and headers (the same
    dict); any other head is parsed, and kept in its place."""
    version = {"n": 1}

    def answer(conn: socket.socket, method: str, path: str) -> bool:
        extra = f"x-paramshard-state-version: {version['n']}\r\n"
        conn.sendall(response(200, path.encode(), "application/octet-stream", extra))
        return True

    server = scripted(answer)
    parsed = []
    parse = direct._parse_head

    def counted(raw: bytes):
        parsed.append(raw)
        return parse(raw)

    monkeypatch.setattr(direct, "_parse_head", counted)
    p, origin = pool(), Origin(server.url)
    assert p.request(origin, "GET", "/open", None).status == 200  # a connection, now idle

    def call() -> tuple[int, dict[str, str], bytes]:
        r = direct.exchange(p, origin, _post(origin, b"abc")[1], time.monotonic() + 5, 1 << 20)
        return r.status, r.headers, bytes(r.content)

    first, again = call(), call()
    assert len(parsed) == 1 and again[1] is first[1]
    assert first == again == (200, {**first[1]}, b"/x")
    assert first[1]["x-paramshard-state-version"] == "1"
    version["n"] = 2
    changed = call()
    assert len(parsed) == 2 and changed[1]["x-paramshard-state-version"] == "2"
    assert call()[1] is changed[1] and len(parsed) == 2
    assert server.connections == 1


def test_one_direct_exchange_failing_ends_it_alone(scripted):
    def hang_up_on_post(conn: socket.socket, method: str, path: str) -> bool:
        return method != "POST" and ok(conn, method, path)

    hung_up, fine = scripted(hang_up_on_post), scripted(ok)
    p = pool()
    origins = [Origin(hung_up.url), Origin(fine.url)]
    for o in origins:
        assert p.request(o, "GET", "/open", None).status == 200
    out = direct.exchange_all(p, [_post(o, b"abc") for o in origins])
    assert type(out[0]) is httpx2.RemoteProtocolError
    assert out[1].status == 200
    assert [p.idle_count(o) for o in origins] == [0, 1]


def test_requests_to_several_shards_are_each_retried(scripted):
    servers = [scripted(hang_up, 0, 2), scripted(hang_up, 1, 2)]
    names = {shard_for(f"w{k}", 2): f"w{k}" for k in range(20)}
    grads = {names[i]: np.ones(3, np.float32) for i in (0, 1)}
    with PSClient([s.url for s in servers], retry_deadline=0.5) as ps:
        with pytest.raises(ShardUnavailableError, match="applied at most once"):
            ps.push(grads)
    assert all(s.requests.count(("POST", "/v1/push")) > 1 for s in servers)


# -- the asyncio pool ---------------------------------------------------------------------------


def test_async_pool_reuses_connections_and_closes_a_cancelled_one(scripted):
    release = threading.Event()

    def answer_or_hang(conn: socket.socket, method: str, path: str) -> bool:
        if path == "/hang":
            release.wait(10)
            return False
        return ok(conn, method, path)

    server = scripted(answer_or_hang)
    origin = Origin(server.url)

    async def main() -> None:
        p = AsyncHTTPPool(max_idle=2, connect_timeout=5.0, timeout=5.0, max_reply=1 << 30)
        for _ in range(3):
            assert (await p.request(origin, "GET", "/x", None)).status == 200
        assert server.connections == 1 and p.idle_count(origin) == 1
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(p.request(origin, "GET", "/hang", None), 0.2)
        assert p.idle_count(origin) == 0  # the idle one was taken, and closed when cancelled
        with pytest.raises(httpx2.ReadTimeout):
            await p.request(origin, "GET", "/hang", None, deadline=time.monotonic() + 0.2)
        await p.close()

    try:
        asyncio.run(main())
    finally:
        release.set()


def test_async_pool_connect_errors(scripted):
    unlistened = _bound_not_listening()
    port = unlistened.getsockname()[1]

    async def main() -> None:
        p = AsyncHTTPPool(max_idle=2, connect_timeout=5.0, timeout=5.0, max_reply=1 << 30)
        with pytest.raises(httpx2.ConnectError):
            await p.request(Origin(f"http://127.0.0.1:{port}"), "GET", "/x", None)

    try:
        asyncio.run(main())
    finally:
        unlistened.close()


def _bound_not_listening() -> socket.socket:
    """A socket bound to a loopback port and never listening: a connection to that port is
    refused for as long as the socket is open. (A port freed by closing a listener could be
    taken again at once, e.g. by the next server this test makes, and then answer.)"""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(0, 3 * SEND_SLICE), min_size=1, max_size=6), st.randoms())
def test_bodies_go_out_whole_and_in_order_a_slice_per_sendmsg(sizes, rnd):
    """next_send/advance, against a socket that takes any number of the bytes offered: every
    byte goes out once, in order, and no call is offered more than SEND_SLICE bytes (or more
    than MAX_IOV buffers)."""
    pieces = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    views = [b"HEAD", *(memoryview(p) for p in pieces)]
    out = bytearray()
    first = 0
    while first < len(views):
        offered = next_send(views, first)
        size = sum(len(v) for v in offered)
        assert offered and len(offered) <= MAX_IOV and size <= SEND_SLICE
        sent = rnd.randint(1, size) if size else 0  # a socket takes any part of it
        joined = b"".join(bytes(v) for v in offered)
        out += joined[:sent]
        first = advance(views, first, sent)
    assert bytes(out) == b"HEAD" + b"".join(pieces)


def test_header_lines_seen_before_parse_as_the_first_time_and_bad_ones_never_pass():
    """Response heads reuse the header lines they parsed before (http11._lines): the same
    headers however often a head comes, repeats joined, a bad line refused every time, and
    the lines kept bounded."""
    from client_sdk._http import http11

    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nx-a:  1 \r\nX-A: 2\r\n"
        b"content-length: 3\r\nCONTENT-LENGTH: 3"
    )
    first = http11._parse_head(head)
    assert first == (
        200,
        "HTTP/1.1",
        {"content-type": "application/msgpack", "x-a": "1, 2", "content-length": "3"},
    )
    assert http11._parse_head(head) == first
    for bad in (b"HTTP/1.1 200 OK\r\n x-a: 1", b"HTTP/1.1 200 OK\r\nno colon"):
        for _ in range(2):
            with pytest.raises(httpx2.RemoteProtocolError, match="malformed"):
                http11._parse_head(bad)
    with pytest.raises(httpx2.RemoteProtocolError, match="conflicting"):
        http11._parse_head(head + b"\r\ncontent-length: 4")
    for i in range(http11._LINES_KEPT * 2):
        http11._parse_head(b"HTTP/1.1 200 OK\r\nx-n: %d" % i)
    assert len(http11._lines) <= http11._LINES_KEPT


# -- cutting an exchange short (its Abort: a race's loser, a primary left for another) ---------


def test_an_exchange_cut_by_its_abort_ends_at_once_on_every_layer(scripted):
    """A fired :class:`~client_sdk._abort.Abort` ends an exchange with a shard that never
    answers as a lost connection, long before its deadline: in the blocking pool, in the
    fan-out (the other exchanges answered), in the asyncio pool and over httpx2 (asyncio)."""
    release = threading.Event()

    def silent(conn: socket.socket, method: str, path: str) -> bool:
        release.wait(30)
        return False

    mute, fine = scripted(silent), scripted(ok)

    def far() -> float:
        return time.monotonic() + 30  # a timeout would say ReadTimeout, after 30 s

    def cut_soon() -> Abort:
        abort = Abort()
        threading.Timer(0.2, abort.fire).start()
        return abort

    def lost(outcome: object) -> bool:
        return isinstance(outcome, httpx2.TransportError) and not isinstance(
            outcome, httpx2.TimeoutException
        )

    try:
        p = pool()
        with pytest.raises(httpx2.TransportError) as info:
            p.request(Origin(mute.url), "GET", "/x", None, deadline=far(), abort=cut_soon())
        assert lost(info.value)
        out = exchange_all(
            p,
            [
                Exchange(Origin(mute.url), "GET", "/x", None, deadline=far(), abort=cut_soon()),
                Exchange(Origin(fine.url), "GET", "/x", None, deadline=far()),
            ],
            submit,
        )
        assert lost(out[0]) and out[1].status == 200

        async def main() -> None:
            ap = AsyncHTTPPool(max_idle=2, connect_timeout=5.0, timeout=5.0, max_reply=1 << 30)
            exchange = Exchange(
                Origin(mute.url), "GET", "/x", None, deadline=far(), abort=cut_soon()
            )
            with pytest.raises(httpx2.TransportError) as info:
                await ap.exchange(exchange)
            assert lost(info.value)
            await ap.close()
            settings = load_settings([mute.url], "w")
            sender = AsyncHTTPXSender(settings, httpx2.AsyncHTTPTransport())
            request = Core(settings).get(0, "/x", far(), "x")
            with pytest.raises(httpx2.TransportError) as info:
                await sender.once(dataclasses.replace(request, abort=cut_soon()), far())
            assert lost(info.value)
            await sender.close()

        asyncio.run(main())
    finally:
        release.set()
