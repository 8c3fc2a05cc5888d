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

import struct
import uuid
from typing import Any

import httpx2
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_sdk import wire
from client_sdk.optimizers import SGD
from tests.conftest import examples

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")

ROWS, SIZE = 3, 20  # the victims: ROWS float32 variables of SIZE elements, made by one init
_HEAD = struct.Struct("<4sI")


@pytest.fixture(scope="module")
def shard(fleet_module):
    url = fleet_module.urls[0]
    names = [f"fuzz-{uuid.uuid4().hex[:8]}-{i}" for i in range(ROWS)]
    with httpx2.Client(timeout=30.0) as http:
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
        yield url, names, http


@pytest.fixture(scope="module")
def fleet_module(tmp_path_factory):
    from tests.conftest import Fleet

    fleet = Fleet(1, tmp_path_factory.mktemp("fuzz"), data=True)  # checkpoints need a disk
    yield fleet
    fleet.close()


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


def paths(obj: Any, here: tuple = ()) -> list[tuple]:
    """Every place in a decoded header: map keys and list indices, nested."""
    out = [here]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*here, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*here, i))
    return out


ANYTHING = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.binary(max_size=16),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
#: Dtype strings: valid ones of other sizes and byte orders, and ones a shard must refuse.
DTYPE_STRINGS = [
    "<f4",
    ">f4",
    "<f8",
    ">f8",
    "<f2",
    "|u1",
    "<i4",
    ">i8",
    "<u8",
    "<c8",
    "|b1",
    "f4",
    "<f3",
    "<f16",
    "|f4",
    "",
    "<",
]
#: Ints at the edges: of sizes, offsets, counts and seqs.
EDGE_INTS = [
    -(2**63),
    -1,
    0,
    1,
    3,
    63,
    64,
    65,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**64 - 1,
]


def near(value: Any) -> st.SearchStrategy:
    """Values a careless or hostile sender might put in place of ``value``: near misses of
    its own type first, anything at all now and then."""
    if isinstance(value, bool):
        options = st.sampled_from([not value, 0, 1, None, "true"])
    elif isinstance(value, int):
        options = st.sampled_from([value - 1, value + 1, -value, *EDGE_INTS]) | st.floats(
            allow_nan=True, allow_infinity=True
        )
    elif isinstance(value, float):
        options = st.sampled_from([-value, 0.0, float("nan"), float("inf"), 1e308]) | st.integers(
            -2, 2
        )
    elif isinstance(value, str):
        options = st.sampled_from(
            [*DTYPE_STRINGS, value + "x", value[:-1], value.upper(), "table", "uniform"]
        ) | st.text(max_size=6)
    elif isinstance(value, bytes):
        options = st.sampled_from([value[:-1], value + b"\0", b"", value * 2])
    elif isinstance(value, list):
        options = st.sampled_from(
            [value[:-1], value + value[:1], [], [value], value[::-1], [*value, *value]]
        ) | st.lists(st.sampled_from(EDGE_INTS), max_size=4)
    elif isinstance(value, dict):
        options = st.sampled_from([{}, dict(list(value.items())[:1]), [value]])
    else:
        options = st.nothing()
    return st.one_of(options, options, options, ANYTHING)


@st.composite
def damage(draw, header: Any):
    """A copy of ``header`` with one thing changed."""
    header = msgpack.unpackb(
        msgpack.packb(header, use_bin_type=True), raw=False, strict_map_key=False
    )
    places = paths(header)  # (by index: a reply's structure may vary between runs)
    where = places[draw(st.integers(0, 1 << 16)) % len(places)]
    if not where:
        return draw(near(header))
    parent = header
    for key in where[:-1]:
        parent = parent[key]
    key = where[-1]
    how = draw(st.sampled_from(["replace", "replace", "replace", "drop"]))
    if how == "drop":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    else:
        parent[key] = draw(near(parent[key]))
    return header


def state(shard) -> list[tuple[str, int, int]]:
    """Every variable on the shard: name, version, updates."""
    url, _, http = shard
    r = http.get(f"{url}/v1/variables")
    assert r.status_code == 200, r.text
    return [(v["name"], v["version"], v["updates"]) for v in r.json()["variables"]]


#: What the SDK sends with every data-plane request to shard 0 of 1 (its replies may come
#: framed, and small table pulls are then answered by the shard's protocol itself).
SDK_HEADERS = {"x-paramshard-fleet": "0/1", "accept": f"{wire.FRAME}, {wire.MSGPACK}"}


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


def damage_bytes(data, body: bytes) -> bytes:
    """``body`` cut short, overwritten somewhere or extended (positions as fractions of its
    length, so that a body whose length varies between runs replays the same way)."""
    if not body:
        return data.draw(st.binary(min_size=1, max_size=16))
    what = data.draw(st.sampled_from(["cut", "overwrite", "extend"]))
    at = min(data.draw(st.integers(0, 1 << 16)) * len(body) >> 16, len(body) - 1)
    if what == "cut":
        return body[:at]
    if what == "overwrite":
        junk = data.draw(st.binary(min_size=1, max_size=8))
        return body[:at] + junk + body[at + len(junk) :]
    return body + data.draw(st.binary(min_size=1, max_size=100))


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
        damaged = data.draw(damage(header))
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
            body = damage_bytes(data, body)
    else:
        extra = {
            data.draw(st.sampled_from(["x-paramshard-fleet", "content-type", "accept"])): data.draw(
                HTTP_VALUES
            )
        }
    check(shard, verb, body, content_type, extra)
