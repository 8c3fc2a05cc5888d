"""Damaged requests against a real shard: never a 500, never a change of state, never a crash.

Hypothesis takes well-formed requests of every body form a shard reads (a push as a packed
uniform table, as a table with dtype and shape columns, as framed tensor maps, as msgpack; a
pull as a table with versions; an assign; an init; an increment, a wait; a checkpoint's
pause, snapshot and resume), damages each one (a value anywhere in the
header replaced by anything msgpack can carry, a key dropped, a list cut or grown, the frame's
bytes cut short, overwritten or extended) and sends it to a shard process over HTTP. Whatever
the damage, the shard answers a status below 500 (a refusal in the protocol's error form, or
200 where the damage left a valid request), a refused write leaves every variable's version
as it was, and the shard stays healthy. The refusals a user meets most are tested one by one,
with their codes and messages, in tests/shard/test_server_http.py.
"""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_sdk import wire
from client_sdk.optimizers import SGD
from tests.conftest import examples
from tests.helpers.damage import bytes_damages, header_damages

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")

ROWS, SIZE = 3, 20  # the victims: ROWS float32 variables of SIZE elements, made by one init
_HEAD = struct.Struct("<4sI")


@pytest.fixture(scope="module")
def shard(module_fleet_factory, http):
    url = module_fleet_factory(1, data=True).urls[0]  # checkpoints need a disk
    names = [f"fuzz-{uuid.uuid4().hex[:8]}-{i}" for i in range(ROWS)]
    body = wire.encode(
        {
            "variables": {
                n: {"value": np.full(SIZE, i, np.float32), "optimizer": SGD(lr=0.5).to_wire()}
                for i, n in enumerate(names)
            }
        }
    ).join()
    r = http.post(f"{url}/v1/init", content=body, headers={"content-type": wire.MSGPACK})
    assert r.status_code == 200, r.text
    return url, names, http


def _grads(names: list[str]) -> list[np.ndarray]:
    return [np.full(SIZE, 0.5 * (i + 1), np.float32) for i in range(len(names))]


def requests(names: list[str]) -> dict[str, tuple[str, dict, list[np.ndarray] | None, str]]:
    """Well-formed requests: id -> (verb, message, table arrays or None, encoding)."""
    push = {"worker_id": "fuzz-" + uuid.uuid4().hex[:8], "seq": 1}
    grads = _grads(names)
    return {
        "push-packed": (
            "push",
            {**push, "layout": "table", "grads": {"names": names}},
            grads,
            "packed",
        ),
        "push-table": (
            "push",
            {**push, "layout": "table", "grads": {"names": names}, "versions": {names[0]: 0}},
            grads,
            "table",
        ),
        "push-framed": ("push", {**push, "grads": dict(zip(names, grads))}, None, "frame"),
        "push-msgpack": ("push", {**push, "grads": dict(zip(names, grads))}, None, "msgpack"),
        "pull-table": (
            "pull",
            {
                "names": names,
                "layout": "table",
                "uniform": True,
                "packed": True,
                "versions": [0, None, 5],
            },
            None,
            "msgpack",
        ),
        "assign": (
            "assign",
            {**push, "values": {names[1]: np.zeros(SIZE, np.float32)}},
            None,
            "frame",
        ),
        "init": (
            "init",
            {
                "variables": {
                    names[2]: {
                        "value": np.zeros(SIZE, np.float32),
                        "optimizer": {"type": "sgd", "lr": 0.1},
                    }
                }
            },
            None,
            "msgpack",
        ),
        "init-sync": (
            "init",
            {
                "variables": {
                    names[2] + "-sync": {
                        "value": np.zeros(SIZE, np.float32),
                        "sync": {"replicas": 2, "timeout": 5.0},
                    }
                }
            },
            None,
            "msgpack",
        ),
        "init-bounded": (
            "init",
            {
                "variables": {
                    names[2] + "-bounded": {
                        "value": np.zeros(SIZE, np.float32),
                        "max_staleness": 3,
                        "staleness_policy": "scale",
                    }
                }
            },
            None,
            "msgpack",
        ),
        "increment": (
            "increment",
            {**push, "name": names[0] + "-steps", "delta": 2},
            None,
            "msgpack",
        ),
        "wait": ("wait", {"names": names, "timeout": 0.01}, None, "msgpack"),
        "pause": ("pause", {"checkpoint": "fuzz-ck", "lease": 5.0}, None, "msgpack"),
        "snapshot": ("snapshot", {"checkpoint": "fuzz-ck"}, None, "msgpack"),
        "resume": ("resume", {"checkpoint": "fuzz-ck"}, None, "msgpack"),
    }


def encode(msg: dict, arrays: list[np.ndarray] | None, how: str) -> tuple[dict, bytes, str]:
    """(the header as sent, decoded again; the body; its content type)."""
    if arrays is not None:
        table = msg["grads"]
        enc = wire.encode_table(msg, table, arrays, uniform=how == "packed", packed=how == "packed")
    else:
        enc = wire.encode(msg, frame=how == "frame")
    body = enc.join()
    if enc.content_type == wire.MSGPACK:
        return msgpack.unpackb(body, raw=False, strict_map_key=False), body, wire.MSGPACK
    _, size = _HEAD.unpack_from(body)
    return msgpack.unpackb(body[8 : 8 + size], raw=False, strict_map_key=False), body, wire.FRAME


def reframe(header: Any, body: bytes) -> bytes:
    """``body`` (a frame) with ``header`` in place of its own; the tensors' bytes stay where
    they were when the new header fits in front of them (offsets in tensor maps are
    absolute), else they move to the next multiple of 64."""
    _, size = _HEAD.unpack_from(body)
    start = -(-(8 + size) // 64) * 64
    head = msgpack.packb(header, use_bin_type=True)
    at = max(start, -(-(8 + len(head)) // 64) * 64)
    return _HEAD.pack(wire.FRAME_MAGIC, len(head)) + head + bytes(at - 8 - len(head)) + body[start:]


def state(shard) -> list[tuple[str, int, int]]:
    """Every variable on the shard: name, version, updates."""
    url, _, http = shard
    r = http.get(f"{url}/v1/variables")
    assert r.status_code == 200, r.text
    return [(v["name"], v["version"], v["updates"]) for v in r.json()["variables"]]


#: What the SDK sends with every data-plane request to shard 0 of 1 (its replies may come
#: framed, and small table pulls are then answered by the shard's protocol itself).
SDK_HEADERS = {"x-paramshard-fleet": "0/1", "accept": f"{wire.FRAME}, {wire.MSGPACK}"}


def asks_for_json(headers: dict[str, str]) -> bool:
    """Whether a request with these headers (names lower-case) asks for its errors in JSON: a
    JSON body, or an Accept naming JSON and neither msgpack nor the frame type."""
    ctype = headers.get("content-type", "")[:64].split(";")[0].strip().lower()
    accept = headers.get("accept", "")[:512].lower()
    return ctype == wire.JSON or (
        "json" in accept and "msgpack" not in accept and "paramshard" not in accept
    )


def check(
    shard, verb: str, body: bytes, content_type: str, headers: dict[str, str] | None = None
) -> None:
    url, _names, http = shard
    before = state(shard)
    r = http.post(
        f"{url}/v1/{verb}",
        content=body,
        headers={**SDK_HEADERS, "content-type": content_type, **(headers or {})},
    )
    assert r.status_code < 500, (r.status_code, r.content[:300])
    if r.status_code >= 400:
        sent = {k.lower(): v for k, v in {**SDK_HEADERS, **(headers or {})}.items()}
        sent.setdefault("content-type", content_type)
        if asks_for_json(sent):  # the error comes as JSON then (docs/PROTOCOL.md §2 Errors)
            assert r.headers["content-type"].startswith(wire.JSON), r.headers
            error = json.loads(r.content)["error"]
        else:
            assert r.headers["content-type"].startswith(wire.MSGPACK), r.headers
            error = msgpack.unpackb(r.content)["error"]
        assert error["code"] and error["message"], error
        assert state(shard) == before, f"a refused {verb} changed state: {error}"
    assert http.get(f"{url}/healthz").status_code == 200
    paused = http.get(f"{url}/v1/cluster").json()["admission"]["paused_for"]
    if paused is not None:  # a damaged pause that was still a valid one: end it
        r = http.post(
            f"{url}/v1/resume",
            content=msgpack.packb({"checkpoint": paused}),
            headers={"content-type": wire.MSGPACK},
        )
        assert r.status_code == 200, r.content


CASES = list(requests(["a", "b", "c"]))
FUZZ = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


HTTP_VALUES = st.sampled_from(
    [
        "0/2",
        "1/1",
        "0/0",
        "-1/1",
        "1/0",
        "0/1/2",
        "x",
        "",
        "0/18446744073709551616",
        "0 /1",
        wire.MSGPACK,
        wire.FRAME,
        wire.JSON,
        "text/plain",
        f"{wire.FRAME}; charset=utf-8",
        "application/msgpack, */*",
        "*/*",
        wire.MSGPACK.upper(),
    ]
) | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(str.strip)


@pytest.mark.parametrize("part", ["message", "bytes", "http-headers"])
@pytest.mark.parametrize("case", CASES)
@FUZZ
@given(data=st.data())
def test_a_damaged_request_is_refused_whole_or_taken_whole(shard, case, part, data):
    """One thing damaged: a value of the message (in a msgpack body or a frame's header),
    the body's bytes (or a frame's header length), or an HTTP header the shard reads (the
    fleet check, content type, accept)."""
    verb, msg, arrays, how = requests(shard[1])[case]
    header, body, content_type = encode(msg, arrays, how)
    extra = None
    if part == "message":
        damaged = data.draw(header_damages()).apply(header)
        body = (
            msgpack.packb(damaged, use_bin_type=True)
            if content_type == wire.MSGPACK
            else reframe(damaged, body)
        )
    elif part == "bytes":
        if content_type == wire.FRAME and data.draw(st.booleans()):  # another header length
            size = data.draw(st.sampled_from([0, 1, 7, 2**31, 2**32 - 1]) | st.integers(0, 400))
            body = _HEAD.pack(wire.FRAME_MAGIC, size) + body[8:]
        else:
            body = data.draw(bytes_damages()).apply(body)
    else:
        extra = {
            data.draw(st.sampled_from(["x-paramshard-fleet", "content-type", "accept"])): data.draw(
                HTTP_VALUES
            )
        }
    check(shard, verb, body, content_type, extra)
