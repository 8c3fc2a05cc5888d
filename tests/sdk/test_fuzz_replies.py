"""Damaged replies to the SDK: whatever a shard (or anything between it and the worker) answers,
a worker sees a ``PSError`` or a result, never another exception, never a hang.

A real shard behind a proxy (tests/helpers/dropproxy.py) that damages one reply per example: the
status line, a header (content type, the shard's place in the fleet, its incarnation), a value
anywhere in the msgpack header (a near miss or anything), or the body's bytes (cut,
overwritten, extended). Hypothesis picks which verb's reply and how; the worker (a
``PSClient`` over the SDK's own pools, or over an httpx2 transport, or an ``AsyncPSClient``)
runs the usual calls: the fleet check, init, pull of a step's same-shaped variables (a packed
table reply), push, increment, wait_ready and the variables listing. The SDK's documented
promise is that worker code catches ``PSError`` and nothing else.
"""

from __future__ import annotations

import queue
import re
import struct
import threading
import uuid

import httpx2
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_sdk import AsyncPSClient, PSClient, PSError, wire
from tests.conftest import OnLoop, examples
from tests.helpers.dropproxy import DroppingProxy
from tests.shard.test_fuzz_requests import damage, damage_bytes

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")

NAMES = [f"replies-{i}" for i in range(3)]
SIZE = 50
PATHS = [
    "/v1/cluster",
    "/v1/init",
    "/v1/pull",
    "/v1/push",
    "/v1/increment",
    "/v1/wait",
    "/v1/variables",
]
_HEAD = struct.Struct("<4sI")


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    from tests.conftest import Fleet

    fleet = Fleet(1, tmp_path_factory.mktemp("replies"))
    port = fleet.ports[0]
    with PSClient(fleet.urls) as ps:
        ps.init({n: np.zeros(SIZE, np.float32) for n in NAMES})
    with DroppingProxy(("127.0.0.1", port)) as relay:
        yield relay
    fleet.close()


def split(reply: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, [tuple(line.split(b":", 1)) for line in lines], body


def join(status: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    headers = [(k, v) for k, v in headers if k.strip().lower() != b"content-length"]
    headers.append((b"content-length", b" %d" % len(body)))
    return status + b"\r\n" + b"".join(k + b":" + v + b"\r\n" for k, v in headers) + b"\r\n" + body


def damage_body(data, body: bytes, content_type: bytes) -> bytes:
    """A near miss in the msgpack header (of a msgpack or framed body), or damaged bytes."""
    how = data.draw(st.sampled_from(["header", "bytes"]))
    framed = content_type.strip().startswith(wire.FRAME.encode())
    if how == "header":
        try:
            if framed:
                _, size = _HEAD.unpack_from(body)
                header, rest = msgpack.unpackb(body[8 : 8 + size], raw=False), body[8 + size :]
            else:
                header, rest = msgpack.unpackb(body, raw=False), b""
        except Exception:  # a JSON body: damage its bytes instead
            how = "bytes"
        else:
            header = data.draw(damage(header))
            head = msgpack.packb(header, use_bin_type=True)
            return _HEAD.pack(wire.FRAME_MAGIC, len(head)) + head + rest if framed else head
    return damage_bytes(data, body)


def damage_reply(data, reply: bytes) -> bytes:
    status, headers, body = split(reply)
    what = data.draw(st.sampled_from(["status", "header", "body", "body", "body"]))
    if what == "status":
        code = data.draw(
            st.sampled_from(
                [
                    b"200 OK",
                    b"201 Created",
                    b"204 No Content",
                    b"400 Bad Request",
                    b"404 Not Found",
                    b"409 Conflict",
                    b"421 Misdirected Request",
                    b"422 Unprocessable",
                    b"429 Too Many Requests",
                    b"500 Internal Server Error",
                    b"503 Service Unavailable",
                    b"418 I'm a teapot",
                ]
            )
        )
        status = b"HTTP/1.1 " + code
    elif what == "header":
        name = data.draw(
            st.sampled_from(
                [
                    b"content-type",
                    wire.HEADER_SHARD.encode(),
                    wire.HEADER_INCARNATION.encode(),
                    wire.HEADER_PROTOCOL.encode(),
                    wire.HEADER_STATE_VERSION.encode(),
                    b"retry-after",
                ]
            )
        )
        value = data.draw(
            st.sampled_from(
                [
                    b"",
                    b"0/1",
                    b"1/1",
                    b"0/2",
                    b"x",
                    b"-1",
                    b"2",
                    b"0",
                    b"99999999999999999999",
                    wire.MSGPACK.encode(),
                    wire.FRAME.encode(),
                    wire.JSON.encode(),
                    b"text/html",
                    b"deadbeef",
                    b"1e9",
                    b"nan",
                ]
            )
        )
        headers = [(k, v) for k, v in headers if k.strip().lower() != name]
        headers.append((name, b" " + value))
    else:
        ctype = next((v for k, v in headers if k.strip().lower() == b"content-type"), b"")
        body = damage_body(data, body, ctype)
    return join(status, headers, body)


def calls(ps) -> list:
    """The worker's usual calls, each a thunk (run one after another; each may fail)."""
    grads = {n: np.full(SIZE, 0.5, np.float32) for n in NAMES}
    return [
        lambda: ps.init({n: np.zeros(SIZE, np.float32) for n in NAMES}),
        lambda: ps.pull(NAMES),
        lambda: ps.push(grads),
        lambda: ps.pull(NAMES),
        lambda: ps.increment("replies-steps", 1),
        lambda: ps.wait_ready(NAMES, timeout=0.5),
        lambda: ps.variables(),
    ]


def client(kind: str, url: str):
    options = dict(worker_id="replies-" + uuid.uuid4().hex[:8], timeout=5.0, retry_deadline=0.3)
    if kind == "native":
        return PSClient([url], **options)
    if kind == "httpx2":
        return PSClient([url], transport=httpx2.HTTPTransport(), **options)
    return OnLoop(AsyncPSClient([url], **options))


@pytest.mark.parametrize("kind", ["native", "httpx2", "async"])
@settings(
    max_examples=examples(80),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), path=st.sampled_from(PATHS))
def test_a_damaged_reply_is_a_ps_error_or_a_result(proxy, kind, data, path):
    """The worker's calls run in a thread of their own; the proxy hands the first reply to
    ``path`` to this thread, which damages it (Hypothesis draws only here) and hands it back."""
    to_test, to_proxy = queue.Queue(), queue.Queue()
    taken, lock, listening = [], threading.Lock(), [True]

    def alter(method: str, at: str, reply: bytes) -> bytes:
        with lock:
            if taken or not listening or not re.fullmatch(re.escape(path) + r"(\?.*)?", at):
                return reply
            taken.append(at)
        to_test.put(reply)
        damaged = to_proxy.get(timeout=30)
        return reply if damaged is None else damaged  # None: the worker was done by then

    failures: list[BaseException] = []

    def worker() -> None:
        ps = client(kind, proxy.url)
        try:
            for call in calls(ps):
                try:
                    call()
                except PSError:
                    pass
        except BaseException as exc:  # not a PSError: the test fails with it
            failures.append(exc)
        finally:
            try:
                ps.close()
            except PSError:
                pass
            except BaseException as exc:
                failures.append(exc)

    proxy.alter = alter
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        while thread.is_alive():
            try:
                reply = to_test.get(timeout=0.01)
            except queue.Empty:
                continue
            to_proxy.put(damage_reply(data, reply))
        thread.join()
    finally:
        with lock:
            listening[0] = False
        to_proxy.put(None)  # a reply the worker no longer waited for (a wait it gave up on)
        proxy.alter = None
    assert taken or path in ("/v1/variables",), f"no reply to {path} went by"
    if failures:
        raise failures[0]
