"""The shard against hostile HTTP: header values it parses, huge and unfinished heads, bodies
that stall, long-poll bodies, and the memory a burst of big pushes leaves behind.

Shards are real processes (tests/conftest.py); the hostile side is raw sockets or raw httpx2
calls, so these tests pin what the shard does at its edge (docs/PROTOCOL.md, "Limits"), not
what the SDK sends. Nothing here asserts a timing: a deadline is checked by its effect (the
connection is closed, the next request is answered), with bounds many times the deadline.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx2
import msgpack
import numpy as np
import pytest

from client_sdk import wire
from tests.helpers.eventually import eventually

# -- helpers --------------------------------------------------------------------------------


def error_of(r: httpx2.Response, family: str) -> dict:
    """The error of a refusal, checking it is in ``family`` (``msgpack`` or ``json``)."""
    ctype = r.headers.get("content-type", "")
    if family == "msgpack":
        assert ctype.startswith(wire.MSGPACK), (r.status_code, ctype, r.content[:200])
        return msgpack.unpackb(r.content)["error"]
    assert ctype.startswith(wire.JSON), (r.status_code, ctype, r.content[:200])
    return json.loads(r.content)["error"]


# -- header values the shard parses ---------------------------------------------------------

ROUTES = [
    ("GET", "/healthz", "json"),
    ("GET", "/readyz", "json"),
    ("GET", "/v1/cluster", "json"),
    ("GET", "/v1/variables", "json"),
    ("GET", "/v1/variables/x", "json"),
    ("GET", "/v1/workers", "json"),
    ("GET", "/metrics", "json"),
    ("GET", "/", "json"),
    ("GET", "/nowhere", "json"),
    ("POST", "/v1/pull", "msgpack"),
    ("POST", "/v1/push", "msgpack"),
    ("POST", "/v1/init", "msgpack"),
    ("POST", "/v1/wait", "msgpack"),
    ("POST", "/v1/increment", "msgpack"),
    ("POST", "/v1/pause", "msgpack"),
    ("POST", "/v1/nowhere", "msgpack"),
]


@pytest.mark.parametrize(
    "value", ["1" * 5000 + "/2", "0/" + "9" * 5000, "0/" + "1" * 10, "\u00b2/2", "0/\u00b9"]
)
def test_a_fleet_header_of_any_length_or_digits_is_a_400_on_every_route(fleet2, value):
    """A fleet header whose numbers are too long for Python's ``int`` (4,300 digits), or
    digits that ``int`` does not take (superscripts pass ``str.isdigit``), is 400
    ``bad_request`` in the route's family, never a plain-text 500."""
    url = fleet2.urls[0]
    body = msgpack.packb({"names": []})
    with httpx2.Client(timeout=10.0) as http:
        for method, path, family in ROUTES:
            r = http.request(
                method,
                url + path,
                content=body if method == "POST" else None,
                headers={
                    "x-paramshard-fleet": value.encode("latin-1"),
                    "content-type": wire.MSGPACK,
                },
            )
            assert r.status_code == 400, (method, path, r.status_code, r.content[:200])
            err = error_of(r, family)
            assert err["code"] == "bad_request" and "x-paramshard-fleet" in err["message"]
            assert len(err["message"]) < 400  # the value is not echoed whole
        r = http.get(url + "/healthz")
        assert r.status_code == 200


# -- heads: their size and their deadline ---------------------------------------------------


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def closed_by_peer(sock: socket.socket, within: float) -> tuple[bool, bytes]:
    """Read until the shard closes ``sock`` (True, what it sent) or ``within`` seconds pass
    (False)."""
    sock.settimeout(0.5)
    got = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, got
        if not data:
            return True, got
        got += data
    return False, got


@pytest.fixture(params=["httptools", "h11", "stock"])
def edge_shard(request, fleet_factory):
    """One shard with short head and body deadlines, on either of uvicorn's protocols (h11:
    httptools hidden), and served the stock way (server/upstream.py)."""
    prelude = "import sys; sys.modules['httptools'] = None" if request.param == "h11" else ""
    env = {"PARAMSHARD_HTTP": "stock"} if request.param == "stock" else {}
    return fleet_factory(
        1,
        "--head-timeout",
        "1",
        "--body-timeout",
        "1",
        "--max-request-bytes",
        "64MiB",
        "--max-queued-bytes",
        "128MiB",
        env=env,
        prelude=prelude,
    )


def test_a_huge_head_is_refused_early_and_costs_no_memory(edge_shard):
    """A header value of 64 MiB (four connections at once) is refused with 400 and its
    connection closed once the bound is passed; the shard's memory stays where it was."""
    url = edge_shard.urls[0]
    pid = edge_shard.procs[0].pid
    port = edge_shard.ports[0]
    before = rss_mib(pid)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    for s in socks:
        s.sendall(b"POST /v1/pull HTTP/1.1\r\nHost: x\r\nx-big: ")
    piece = b"a" * (1 << 20)
    refused = [False] * 4
    for _ in range(64):
        for k, s in enumerate(socks):
            if refused[k]:
                continue
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                refused[k] = True
        if all(refused):
            break
    assert rss_mib(pid) < before + 200
    for s in socks:
        closed, got = closed_by_peer(s, 20.0)
        s.close()
        assert closed
        if got:  # the refusal, unless the shard's close reset the connection first
            assert got.startswith(b"HTTP/1.1 400"), got[:200]
    assert all(refused) or rss_mib(pid) < before + 200
    with httpx2.Client(timeout=10.0) as http:
        big = "b" * (80 * 1024)
        r = http.get(url + "/healthz", headers={"x-big": big})
        assert r.status_code == 400 and error_of(r, "json")["code"] == "bad_request"
        r = http.post(
            url + "/v1/pull", content=b"\x80", headers={"x-big": big, "content-type": wire.MSGPACK}
        )
        assert r.status_code == 400
        r = http.get(url + "/healthz", headers={"x-fine": "c" * 4096})
        assert r.status_code == 200


def test_unfinished_heads_are_closed_after_the_head_timeout(edge_shard):
    """Slowloris: connections that never finish their head (or send nothing at all) are
    closed by the shard after --head-timeout; a normal request is served meanwhile."""
    port = edge_shard.ports[0]
    socks = []
    for k in range(60):
        s = socket.create_connection(("127.0.0.1", port))
        if k % 3 == 1:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        elif k % 3 == 2:
            s.sendall(b"POST /v1/pull HTTP/1.1\r\nx-slow: aaaa")
        socks.append(s)
    with httpx2.Client(timeout=10.0) as http:
        assert http.get(edge_shard.urls[0] + "/healthz").status_code == 200
    for s in socks:
        try:
            s.sendall(b"a")  # still trickling: the deadline runs from the head's start
        except OSError:
            pass
    for s in socks:
        closed, _ = closed_by_peer(s, 30.0)
        s.close()
        assert closed


# -- bodies that stall, and admission -------------------------------------------------------


def admission(url: str) -> dict:
    with httpx2.Client(timeout=10.0) as http:
        return http.get(url + "/v1/cluster").json()["admission"]


def test_idle_senders_do_not_lock_out_other_clients(edge_shard):
    """Heads of pulls with a chunked body and with a Content-Length of the largest request
    (two of them: all of --max-queued-bytes), then nothing more: a worker's init, push and
    pull still succeed, and the shard closes the idle connections after --body-timeout,
    releasing what they held."""
    from client_sdk import PSClient

    url, port = edge_shard.urls[0], edge_shard.ports[0]
    heads = [
        b"POST /v1/pull HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    ]
    heads += [
        b"POST /v1/pull HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
        b"Content-Length: %d\r\n\r\n" % (64 << 20)
    ] * 2
    socks = []
    for head in heads:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head)
        socks.append(s)

    # the three heads are in, and the two with a Content-Length hold all of --max-queued-bytes
    # (until --body-timeout cuts them off)
    def held() -> tuple[int, int]:
        state = admission(url)
        return state["requests_in_flight"], state["bytes_in_flight"]

    eventually(lambda: held() == (3, 2 * (64 << 20)), "the idle heads are in and hold the room")
    with PSClient([url], worker_id="w-edge", retry_deadline=15.0) as ps:
        ps.init({"w": np.zeros(4, np.float32)})
        ps.push({"w": np.ones(4, np.float32)})
        assert ps.pull(["w"])["w"].shape == (4,)
    for s in socks:
        closed, _ = closed_by_peer(s, 20.0)
        s.close()
        assert closed
    deadline = time.monotonic() + 10
    while (state := admission(url))["bytes_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state["bytes_in_flight"] == 0 and state["requests_in_flight"] == 0, state


def test_a_trickling_body_is_cut_off(edge_shard):
    """A body that keeps coming, a byte at a time, is below the minimum rate: cut off."""
    port = edge_shard.ports[0]
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/push HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    cut = False
    for _ in range(200):  # 20 s at most; --body-timeout is 1 s, windows at most 2 s
        try:
            s.sendall(b"\x00")
        except OSError:
            cut = True
            break
        s.settimeout(0.1)
        try:
            if s.recv(1024) == b"":
                cut = True
                break
        except TimeoutError:
            pass
        except OSError:
            cut = True
            break
    s.close()
    assert cut
    assert admission(edge_shard.urls[0])["requests_in_flight"] == 0


# -- long-poll bodies count -----------------------------------------------------------------


def test_wait_bodies_are_bounded_and_counted_in_admission(fleet_factory):
    """``/v1/wait`` bodies above their bound are 413 unread (eight 120 MiB ones: no memory),
    and a wait's body counts in the bytes admitted (not in the requests) while it is read."""
    fleet = fleet_factory(1, "--max-request-bytes", "128MiB", "--max-queued-bytes", "128MiB")
    url, port, pid = fleet.urls[0], fleet.ports[0], fleet.procs[0].pid
    before = rss_mib(pid)
    head = (
        b"POST /v1/wait HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
        b"Content-Length: %d\r\n\r\n"
    )
    socks = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head % (120 << 20) + b"\x00" * (1 << 20))
        socks.append(s)
    for s in socks:
        s.settimeout(10.0)
        reply = s.recv(65536)
        s.close()
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"application/msgpack" in reply
    assert rss_mib(pid) < before + 200
    held = socket.create_connection(("127.0.0.1", port))
    held.sendall(head % (8 << 20) + b"\x00" * (1 << 20))
    deadline = time.monotonic() + 10
    while (state := admission(url))["bytes_in_flight"] < (8 << 20) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state["bytes_in_flight"] == 8 << 20 and state["requests_in_flight"] == 0, state
    held.close()
    deadline = time.monotonic() + 10
    while (state := admission(url))["bytes_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state["bytes_in_flight"] == 0, state
    with httpx2.Client(timeout=10.0) as http:  # a chunked wait body past its bound: 413 too

        def chunks():
            for _ in range(20):
                yield msgpack.packb("x" * 1024) * 1024

        r = http.post(url + "/v1/wait", content=chunks(), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 413 and error_of(r, "msgpack")["code"] == "too_large"
        r = http.post(
            url + "/v1/wait",
            content=msgpack.packb({"names": [], "timeout": 0}),
            headers={"content-type": wire.MSGPACK},
        )
        assert r.status_code == 200


# -- memory after a burst of big pushes -----------------------------------------------------


def test_the_memory_of_a_burst_of_big_pushes_is_given_back(fleet_factory):
    """Sixteen concurrent 16 MiB pushes take the shard's heap up by what admission lets in
    (256 MiB); once the shard is idle it gives that back, rather than keeping its peak for
    good."""
    from client_sdk import PSClient
    from client_sdk.optimizers import SGD

    fleet = fleet_factory(1, "--max-request-bytes", "32MiB", "--max-queued-bytes", "256MiB")
    url, pid = fleet.urls[0], fleet.procs[0].pid
    size = 4 << 20  # float32: 16 MiB
    with PSClient([url], worker_id="w-init") as ps:
        ps.init({"big": np.zeros(size, np.float32)}, optimizer=SGD(lr=0.1))
    base = rss_mib(pid)
    grad = np.ones(size, np.float32)
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib(pid))
            time.sleep(0.01)

    def push(k: int) -> None:
        with PSClient([url], worker_id=f"w-{k}", retry_deadline=60.0) as ps:
            ps.push({"big": grad})

    watcher = threading.Thread(target=watch)
    watcher.start()
    for _ in range(2):
        workers = [threading.Thread(target=push, args=(k,)) for k in range(16)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    done.set()
    watcher.join()
    assert peak[0] > base + 100  # the burst did take memory
    deadline = time.monotonic() + 20.0
    while (now := rss_mib(pid)) > base + 64 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert now <= base + 64, (base, peak[0], now)
    with PSClient([url], worker_id="w-after") as ps:
        assert np.isclose(ps.pull(["big"])["big"][0], -0.1 * 32, rtol=1e-4)
