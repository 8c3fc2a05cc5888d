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

import re
import struct
import threading
import uuid
from dataclasses import dataclass

import httpx2
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_sdk import AsyncPSClient, PSClient, PSError, wire
from tests.conftest import OnLoop, examples
from tests.helpers.damage import BytesDamage, HeaderDamage, bytes_damages, header_damages
from tests.helpers.dropproxy import DroppingProxy

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
def proxy(fleet1):
    with PSClient(fleet1.urls) as ps:
        ps.init({n: np.zeros(SIZE, np.float32) for n in NAMES})
    with DroppingProxy(("127.0.0.1", fleet1.ports[0])) as relay:
        yield relay


def split(reply: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, [tuple(line.split(b":", 1)) for line in lines], body


def join(status: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    headers = [(k, v) for k, v in headers if k.strip().lower() != b"content-length"]
    headers.append((b"content-length", b" %d" % len(body)))
    return status + b"\r\n" + b"".join(k + b":" + v + b"\r\n" for k, v in headers) + b"\r\n" + body


STATUSES = [
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
HEADERS = [
    b"content-type",
    wire.HEADER_SHARD.encode(),
    wire.HEADER_INCARNATION.encode(),
    wire.HEADER_PROTOCOL.encode(),
    wire.HEADER_STATE_VERSION.encode(),
    b"retry-after",
]
HEADER_VALUES = [
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


@dataclass(frozen=True)
class ReplyDamage:
    """What to do to one reply, drawn before the reply exists (tests/helpers/damage.py says
    why): its status line, one header, or its body (a value of the msgpack header of a msgpack
    or framed body, or the body's bytes; a JSON body's bytes either way)."""

    what: str  # "status", "header" or "body"
    status: bytes
    header: bytes
    value: bytes
    in_message: bool  # damage the body's msgpack header rather than its bytes
    message: HeaderDamage
    bytes: BytesDamage

    def apply(self, reply: bytes) -> bytes:
        status, headers, body = split(reply)
        if self.what == "status":
            status = b"HTTP/1.1 " + self.status
        elif self.what == "header":
            headers = [(k, v) for k, v in headers if k.strip().lower() != self.header]
            headers.append((self.header, b" " + self.value))
        else:
            ctype = next((v for k, v in headers if k.strip().lower() == b"content-type"), b"")
            body = self.damage_body(body, ctype)
        return join(status, headers, body)

    def damage_body(self, body: bytes, content_type: bytes) -> bytes:
        if self.in_message:
            framed = content_type.strip().startswith(wire.FRAME.encode())
            try:
                if framed:
                    _, size = _HEAD.unpack_from(body)
                    header, rest = msgpack.unpackb(body[8 : 8 + size], raw=False), body[8 + size :]
                else:
                    header, rest = msgpack.unpackb(body, raw=False), b""
            except Exception:  # a JSON body: damage its bytes instead
                pass
            else:
                head = msgpack.packb(self.message.apply(header), use_bin_type=True)
                return _HEAD.pack(wire.FRAME_MAGIC, len(head)) + head + rest if framed else head
        return self.bytes.apply(body)


REPLY_DAMAGES = st.builds(
    ReplyDamage,
    what=st.sampled_from(["status", "header", "body", "body", "body"]),
    status=st.sampled_from(STATUSES),
    header=st.sampled_from(HEADERS),
    value=st.sampled_from(HEADER_VALUES),
    in_message=st.booleans(),
    message=header_damages(),
    bytes=bytes_damages(),
)


def calls(ps, first: list[str]) -> list:
    """The worker's usual calls, each a thunk (run one after another; each may fail); its
    first pull is of ``first`` (the damaged reply to a pull is that one's)."""
    grads = {n: np.full(SIZE, 0.5, np.float32) for n in NAMES}
    return [
        lambda: ps.init({n: np.zeros(SIZE, np.float32) for n in NAMES}),
        lambda: ps.pull(first),
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
@given(damage=REPLY_DAMAGES, path=st.sampled_from(PATHS), one=st.booleans())
def test_a_damaged_reply_is_a_ps_error_or_a_result(proxy, kind, damage, path, one):
    """The worker's calls run in a thread of their own; the proxy damages the first reply to
    ``path`` as ``damage`` says, whatever that reply is (it depends on what earlier examples
    left on the shard, so nothing is drawn after it is seen). With ``one``, the first pull
    is of one name (a reply of one row, which the SDK takes by a path of its own)."""
    taken, lock, listening = [], threading.Lock(), [True]
    failures: list[BaseException] = []

    def alter(method: str, at: str, reply: bytes) -> bytes:
        with lock:
            if taken or not listening[0] or not re.fullmatch(re.escape(path) + r"(\?.*)?", at):
                return reply
            taken.append(at)
        try:
            return damage.apply(reply)
        except BaseException as exc:  # the test's own bug: fail with it, not with a hang
            failures.append(exc)
            return reply

    def worker() -> None:
        ps = client(kind, proxy.url)
        try:
            for call in calls(ps, NAMES[:1] if one else NAMES):
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
        thread.join(120)
        assert not thread.is_alive(), f"the worker's calls did not end (damage: {damage})"
    finally:
        with lock:
            listening[0] = False  # a reply the worker no longer waits for goes by as it is
        proxy.alter = None
    assert taken or path in ("/v1/variables",), f"no reply to {path} went by"
    if failures:
        raise failures[0]
