"""The SDK against a server that answers slowly or hugely on purpose: a reply trickled a byte at a
time, a reply declaring (or streaming) gigabytes.

A real 2-shard fleet behind proxies (tests/helpers/dropproxy.py) whose ``deliver`` sends the
replies to pulls in the hostile way and every other reply as the shard wrote it, so the fleet
check and init go through and the pull meets the hostile reply. Each client kind is tried: the
native connections (one shard: ``_http/pool.py``; both shards in one call:
``_http/fanout.py``), httpx2 (an injected transport), asyncio (``_http/asyncpool.py``) and
asyncio over httpx2 (an injected async transport).

* ``timeout`` bounds a whole exchange and ``retry_deadline`` a whole call: a pull whose reply
  comes at one byte per second (its head included) ends with ShardUnavailableError soon after
  the retry deadline, where a timeout per read would let it run for minutes.
* A compressed reply (the SDK asks for identity) is refused before it is decoded.
* A reply is never bigger than what the request can need: the sizes of the variables the client
  knows, or ``max_reply_bytes`` for those it does not. A reply declaring 8 GiB (or sending a
  chunked body without end) is a ProtocolError at once, and the worker's memory stays flat
  (measured in a worker process of its own: its peak RSS, VmHWM, against its RSS before the
  pull).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx2
import numpy as np
import pytest

from client_sdk import AsyncPSClient, ProtocolError, PSClient
from client_sdk.placement import shard_for
from tests.conftest import ROOT
from tests.helpers.dropproxy import DroppingProxy

SIZE = 64
#: one variable on each shard
NAMES = [
    next(f"hostile-{s}-{k}" for k in range(100) if shard_for(f"hostile-{s}-{k}", 2) == s)
    for s in range(2)
]
#: what the proxies send of an 8 GiB body before they give up (the bad case's memory)
SENT_AT_MOST = 320 << 20


@pytest.fixture(scope="module")
def proxies(fleet2):
    with PSClient(fleet2.urls) as ps:
        ps.init({n: np.zeros(SIZE, np.float32) for n in NAMES})
    relays = [DroppingProxy(("127.0.0.1", port)) for port in fleet2.ports]
    yield relays
    for relay in relays:
        relay.close()


def hostile(relays, pulls):
    """Let ``pulls(sock, reply)`` send the replies to pulls (others go as they are)."""

    def deliver(sock: socket.socket, method: str, path: str, reply: bytes) -> bool:
        if path != "/v1/pull":
            sock.sendall(reply)
            return True
        return pulls(sock, reply)

    for relay in relays:
        relay.deliver = deliver


def quiet(relays):
    for relay in relays:
        relay.deliver = None


# -- a trickled reply ---------------------------------------------------------------------------


TRICKLE = r"""
import asyncio, sys, time, httpx2
from client_sdk import AsyncPSClient, PSClient, PSError
kind, urls, names = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
options = dict(worker_id="trickled", timeout=2.0, retry_deadline=3.0)
started = time.monotonic()
try:
    if kind.startswith("async"):
        async def main():
            transport = httpx2.AsyncHTTPTransport() if kind == "async-httpx2" else None
            async with AsyncPSClient(urls, transport=transport, **options) as ps:
                await ps.wait_ready(names, timeout=10)
                started_pull = time.monotonic()
                try:
                    await ps.pull(names)
                finally:
                    print("pull", time.monotonic() - started_pull, flush=True)
        asyncio.run(main())
    else:
        transport = httpx2.HTTPTransport() if kind == "httpx2" else None
        with PSClient(urls, transport=transport, **options) as ps:
            ps.wait_ready(names, timeout=10)
            started_pull = time.monotonic()
            try:
                ps.pull(names)
            finally:
                print("pull", time.monotonic() - started_pull, flush=True)
    print("result")
except PSError as exc:
    print(type(exc).__name__, exc)
"""


def trickle(stop: threading.Event):
    def pulls(sock: socket.socket, reply: bytes) -> bool:
        for i in range(len(reply)):  # head and body, one byte per second
            if stop.wait(1.0):
                return False
            sock.sendall(reply[i : i + 1])
        return True

    return pulls


@pytest.mark.parametrize(
    "kind,shards", [("native", 1), ("native", 2), ("httpx2", 2), ("async", 2), ("async-httpx2", 2)]
)
def test_a_trickled_reply_ends_at_the_deadline(proxies, kind, shards):
    """Each call of the worker (a process of its own, so that a hang fails the test instead
    of holding it) must end with ShardUnavailableError well before 15 s: with timeout=2 and
    retry_deadline=3 it takes about 3 s, where a reply of some hundred bytes at one byte per
    second would take minutes under a timeout that bounds each read."""
    stop = threading.Event()
    hostile(proxies, trickle(stop))
    urls = ",".join(p.url for p in proxies)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", TRICKLE, kind, urls, ",".join(NAMES[:shards])],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=15 + 10)  # + the worker's start and fleet check
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(
                f"the {kind} pull of a trickled reply was still running after 15 s: {out}{err}"
            )
    finally:
        stop.set()
        quiet(proxies)
    lines = out.splitlines()
    assert proc.returncode == 0, out + err
    assert lines[-1].startswith("ShardUnavailableError") and "in time" in lines[-1], out + err
    took = float(lines[-2].split()[1])
    assert took < 15, f"the pull took {took:.1f} s"


# -- a huge reply ---------------------------------------------------------------------------


HUGE = r"""
import asyncio, json, sys, httpx2, numpy as np
from client_sdk import AsyncPSClient, PSClient, PSError
kind, urls, names, knows = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), \
    sys.argv[4]
options = dict(worker_id="flooded", timeout=20.0, retry_deadline=20.0)
if knows == "capped":
    options["max_reply_bytes"] = 16 << 20

def status(key):  # VmHWM: the peak RSS of this process's own memory (not its parent's)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

def rss():
    return status("VmRSS")

out = {}
def before(ps_init):
    if knows == "knows":  # the same shapes as the shards hold: the client knows their sizes
        ps_init({n: np.zeros(64, np.float32) for n in names})
    out["rss_before_kib"] = rss()

try:
    if kind.startswith("async"):
        async def main():
            transport = httpx2.AsyncHTTPTransport() if kind == "async-httpx2" else None
            async with AsyncPSClient(urls, transport=transport, **options) as ps:
                if knows == "knows":
                    await ps.init({n: np.zeros(64, np.float32) for n in names})
                out["rss_before_kib"] = rss()
                await ps.pull(names)
        asyncio.run(main())
    else:
        transport = httpx2.HTTPTransport() if kind == "httpx2" else None
        with PSClient(urls, transport=transport, **options) as ps:
            before(ps.init)
            ps.pull(names)
    out["error"] = None
except PSError as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)
out["peak_kib"] = status("VmHWM")
print(json.dumps(out))
"""


def declared(sock: socket.socket, reply: bytes) -> bool:
    """Content-Length: 8 GiB, then zeros as fast as the worker takes them (up to a point)."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\n"
        b"content-length: 8589934592\r\n\r\n"
    )
    return _flood(sock, head, lambda block: block)


def chunked(sock: socket.socket, reply: bytes) -> bool:
    """A chunked body of 1 MiB chunks without end (up to a point)."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    return _flood(sock, head, lambda block: b"%x\r\n" % len(block) + block + b"\r\n")


def _flood(sock: socket.socket, head: bytes, frame) -> bool:
    block = bytes(1 << 20)
    try:
        sock.sendall(head)
        for _ in range(SENT_AT_MOST >> 20):
            sock.sendall(frame(block))
    except OSError:
        pass  # the worker closed the connection: what it should do
    return False


CASES = [
    (how, kind, shards, knows)
    for how, unknown in (("declared", "unknown"), ("chunked", "capped"))
    for kind, shards, knows in (
        ("native", 1, "knows"),
        ("native", 2, "knows"),
        ("native", 1, unknown),
        ("httpx2", 2, "knows"),
        ("httpx2", 1, unknown),
        ("async", 2, "knows"),
        ("async", 1, unknown),
        ("async-httpx2", 2, "knows"),
        ("async-httpx2", 1, unknown),
    )
]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
@pytest.mark.parametrize("how,kind,shards,knows", CASES)
def test_a_huge_reply_is_refused_before_it_is_read(proxies, how, kind, shards, knows):
    """The pull raises ProtocolError naming the size and the bound, and the worker's peak RSS
    stays within 100 MiB of what it was before the pull; the proxies send up to 320 MiB of
    the body, which a client that takes what is declared would hold. ``knows``: the client
    init'ed the variables, so it knows their sizes (the bound is some KiB); ``unknown``: it
    does not (the bound is max_reply_bytes, 1 GiB by default: 8 GiB declared is refused at
    once); ``capped``: neither, with max_reply_bytes=16 MiB (a chunked body is refused once
    that much came)."""
    hostile(proxies, declared if how == "declared" else chunked)
    urls = ",".join(p.url for p in proxies)
    try:
        result = subprocess.run(
            [sys.executable, "-c", HUGE, kind, urls, ",".join(NAMES[:shards]), knows],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        quiet(proxies)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    grew = (out["peak_kib"] - out["rss_before_kib"]) / 1024
    assert out["error"] == "ProtocolError", out
    if how == "declared":
        assert "declared a reply body of 8589934592 bytes" in out["message"], out
    else:
        assert "sent a reply body of more than" in out["message"], out
    assert "max_reply_bytes" in out["message"], out
    assert grew < 100, f"the worker's RSS grew by {grew:.0f} MiB: {out}"


def test_a_reply_within_the_bound_is_taken(proxies):
    """The bound is no tighter than real replies: pulls of known and unknown sizes through the
    proxies, as they are, give the values."""
    quiet(proxies)
    urls = [p.url for p in proxies]
    with PSClient(urls, worker_id="bounded-" + uuid.uuid4().hex[:6]) as ps:
        first = ps.pull(NAMES)  # sizes unknown: max_reply_bytes
        again = ps.pull(NAMES)  # known from the first pull
    for values in (first, again):
        assert [v.shape for v in values.values()] == [(SIZE,)] * len(NAMES)
    with PSClient(urls, max_reply_bytes=1) as ps:  # the headroom alone holds small values
        assert ps.pull(NAMES)[NAMES[0]].shape == (SIZE,)


def compressed(sock: socket.socket, reply: bytes) -> bool:
    """The reply with its body gzip-compressed (as a compressing proxy would send it)."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = [
        line for line in head.split(b"\r\n") if not line.lower().startswith(b"content-length:")
    ]
    packed = gzip.compress(body)
    lines += [b"content-encoding: gzip", b"content-length: %d" % len(packed)]
    sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + packed)
    return True


@pytest.mark.parametrize("kind", ["native", "httpx2", "async", "async-httpx2"])
def test_a_compressed_reply_is_refused_unread(proxies, kind):
    """The SDK asks for identity; a compressed body (which could expand far past the bound
    before anything checked it) is a ProtocolError on every path, before it is decoded."""
    hostile(proxies, compressed)
    urls = [p.url for p in proxies]
    options = dict(worker_id="gzipped-" + uuid.uuid4().hex[:6], retry_deadline=5.0)
    try:
        if kind.startswith("async"):

            async def main() -> None:
                transport = httpx2.AsyncHTTPTransport() if kind == "async-httpx2" else None
                async with AsyncPSClient(urls, transport=transport, **options) as ps:
                    with pytest.raises(ProtocolError, match="Content-Encoding 'gzip'"):
                        await ps.pull(NAMES)

            asyncio.run(main())
        else:
            transport = httpx2.HTTPTransport() if kind == "httpx2" else None
            with PSClient(urls, transport=transport, **options) as ps:
                with pytest.raises(ProtocolError, match="Content-Encoding 'gzip'"):
                    ps.pull(NAMES)
    finally:
        quiet(proxies)
