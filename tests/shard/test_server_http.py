"""The shard over real HTTP: every verb, every refusal, the inspection endpoints, the headers.

Shards are real processes (tests/conftest.py); requests are raw httpx2 calls with bodies made by
``client_sdk.wire``, so these tests pin the protocol (docs/PROTOCOL.md), not the SDK.
"""

from __future__ import annotations

import io
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import httpx2
import msgpack
import numpy as np
import pytest

from client_sdk import wire
from client_sdk.placement import shard_for
from tests.conftest import HTTP_MODES, start_fleet2
from tests.helpers.eventually import eventually


@pytest.fixture(scope="module", params=HTTP_MODES)
def fleet2(request, tmp_path_factory):
    """This module's 2-shard fleet, once for each way a shard serves (server/upstream.py)."""
    fleet = start_fleet2(tmp_path_factory, request.param)
    yield fleet
    fleet.close()


ACCEPT_FRAME = f"{wire.FRAME}, {wire.MSGPACK}"


# -- helpers --------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: httpx2.Headers
    msg: Any
    body: bytearray

    def tensor(self, t: Any) -> np.ndarray:
        return wire.decode_tensor(t, self.body)

    @property
    def code(self) -> str:
        return self.msg["error"]["code"]


def worker() -> str:
    """A fresh worker id: the shards apply each (worker_id, seq) once, and fleet2 is shared by
    the whole module."""
    return "w-" + uuid.uuid4().hex[:10]


def owned(shard: int, num_shards: int = 2, prefix: str | None = None) -> str:
    """A fresh variable name that places on ``shard``."""
    prefix = prefix or uuid.uuid4().hex[:10]
    k = 0
    while shard_for(f"{prefix}-{k}", num_shards) != shard:
        k += 1
    return f"{prefix}-{k}"


def decode_reply(r: httpx2.Response) -> Reply:
    body = bytearray(r.content)
    ctype = r.headers.get("content-type", "")
    msg = (
        wire.unpack(body, ctype)
        if ctype.startswith(("application/msgpack", wire.FRAME))
        else r.json()
    )
    return Reply(r.status_code, r.headers, msg, body)


def post(
    http,
    url: str,
    verb: str,
    msg: Any,
    *,
    frame: bool = False,
    accept_frame: bool = False,
    headers: dict[str, str] | None = None,
) -> Reply:
    enc = wire.encode(msg, frame=frame)
    h = {"content-type": enc.content_type, **(headers or {})}
    if accept_frame:
        h["accept"] = ACCEPT_FRAME
    return decode_reply(http.post(f"{url}/v1/{verb}", content=enc.join(), headers=h))


def post_raw(http, url: str, verb: str, content: bytes, content_type: str = wire.MSGPACK) -> Reply:
    return decode_reply(
        http.post(f"{url}/v1/{verb}", content=content, headers={"content-type": content_type})
    )


def inspect(http, url: str, name: str) -> dict[str, Any]:
    r = http.get(f"{url}/v1/variables/{name}", params={"values": "true"})
    assert r.status_code == 200, r.text
    return r.json()


def init(http, url: str, name: str, value: np.ndarray, optimizer: dict | None = None) -> None:
    entry: dict[str, Any] = {"value": value}
    if optimizer is not None:
        entry["optimizer"] = optimizer
    rep = post(http, url, "init", {"variables": {name: entry}})
    assert rep.status == 200, rep.msg
    assert rep.msg["variables"][name]["created"] is True


def assert_healthy(http, url: str) -> None:
    r = http.get(url + "/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def assert_refused(rep: Reply, status: int, code: str) -> None:
    assert rep.status == status, (rep.status, rep.msg)
    assert rep.headers["content-type"].startswith(wire.MSGPACK)
    err = rep.msg["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["details"], dict)


def frame_bytes(msg: Any) -> bytes:
    return wire.encode(msg, frame=True).join()


# -- the verbs, happy paths -----------------------------------------------------------------


def test_init_pull_push_assign_msgpack(fleet2, http):
    url = fleet2.urls[0]
    name = owned(0)
    w0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    rep = post(
        http,
        url,
        "init",
        {"variables": {name: {"value": w0, "optimizer": {"type": "sgd", "lr": 0.5}}}},
    )
    assert rep.status == 200
    assert rep.headers["content-type"] == wire.MSGPACK
    assert rep.msg == {"variables": {name: {"version": 0, "created": True}}}

    rep = post(http, url, "pull", {"names": [name]})
    assert rep.msg["variables"][name]["version"] == 0
    np.testing.assert_array_equal(rep.tensor(rep.msg["variables"][name]["value"]), w0)

    g = np.ones((2, 3), np.float32)
    wid = worker()
    rep = post(
        http, url, "push", {"worker_id": wid, "seq": 0, "grads": {name: g}, "versions": {name: 0}}
    )
    assert rep.status == 200
    assert rep.msg["variables"][name] == {"status": "applied", "version": 1, "staleness": 0}
    rep = post(http, url, "pull", {"names": [name]})
    np.testing.assert_allclose(rep.tensor(rep.msg["variables"][name]["value"]), w0 - 0.5)

    rep = post(http, url, "assign", {"values": {name: np.full((2, 3), 7, np.int32)}})
    assert rep.msg == {"variables": {name: {"status": "applied", "version": 2}}}
    state = inspect(http, url, name)
    assert state["values"] == [[7.0] * 3] * 2 and state["dtype"] == "<f4"
    assert state["version"] == 2 and state["updates"] == 1 and state["last_writer"] == wid


def test_framed_request_and_framed_response(fleet2, http):
    url = fleet2.urls[1]
    name = owned(1)
    big = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)  # 128 KiB
    rep = post(
        http,
        url,
        "init",
        {"variables": {name: {"value": big, "optimizer": {"type": "add"}}}},
        frame=True,
    )
    assert rep.status == 200 and rep.msg["variables"][name]["created"] is True

    rep = post(http, url, "pull", {"names": [name]}, accept_frame=True)
    assert rep.headers["content-type"] == wire.FRAME
    assert int(rep.headers["content-length"]) == len(rep.body)
    got = rep.tensor(rep.msg["variables"][name]["value"])
    np.testing.assert_array_equal(got, big)

    delta = np.full_like(big, 0.25)
    rep = post(
        http,
        url,
        "push",
        {"worker_id": worker(), "seq": 3, "grads": {name: delta}},
        frame=True,
        accept_frame=True,
    )
    assert rep.status == 200
    assert rep.msg["variables"][name]["version"] == 1

    # the same pull without Accept: frame gets msgpack, even for a big tensor
    rep = post(http, url, "pull", {"names": [name]})
    assert rep.headers["content-type"] == wire.MSGPACK
    np.testing.assert_array_equal(rep.tensor(rep.msg["variables"][name]["value"]), big + delta)

    rep = post(http, url, "assign", {"values": {name: -big}}, frame=True, accept_frame=True)
    assert rep.status == 200 and rep.msg == {
        "variables": {name: {"status": "applied", "version": 2}}
    }
    rep = post(http, url, "pull", {"names": [name]}, accept_frame=True)
    np.testing.assert_array_equal(rep.tensor(rep.msg["variables"][name]["value"]), -big)


def test_small_pull_stays_msgpack_even_when_frames_are_accepted(fleet2, http):
    url = fleet2.urls[0]
    name = owned(0)
    init(http, url, name, np.zeros(4, np.float32))
    rep = post(http, url, "pull", {"names": [name]}, accept_frame=True)
    assert rep.status == 200 and rep.headers["content-type"] == wire.MSGPACK


def test_pull_with_versions_leaves_out_unchanged_values(fleet2, http):
    url = fleet2.urls[0]
    a, b = owned(0), owned(0)
    init(http, url, a, np.zeros(3, np.float32))
    init(http, url, b, np.zeros(3, np.float32))
    post(http, url, "push", {"worker_id": worker(), "seq": 0, "grads": {b: np.ones(3, np.float32)}})
    rep = post(http, url, "pull", {"names": [a, b], "versions": {a: 0, b: 0}})
    assert rep.msg["variables"][a] == {"version": 0}
    assert rep.msg["variables"][b]["version"] == 1 and "value" in rep.msg["variables"][b]


def test_pull_in_the_table_layout(fleet2, http):
    """`"layout": "table"` with a framed Accept: one tensor table, rows in request order, the
    held version's value left out; without a framed Accept the same pull answers in the map
    layout; refusals are those of any pull."""
    url = fleet2.urls[0]
    a, b, c, d = (owned(0) for _ in range(4))
    values = {
        a: np.arange(6, dtype=np.float32).reshape(2, 3),
        b: np.arange(5, dtype=np.int64),
        c: np.array(2.5),
        d: np.zeros(0, np.float32),
    }
    for name, value in values.items():
        init(http, url, name, value, {"type": "add"})
    post(
        http,
        url,
        "push",
        {"worker_id": worker(), "seq": 0, "grads": {a: np.ones((2, 3), np.float32)}},
    )
    values[a] = values[a] + 1
    ask = {"names": [d, a, b, c], "layout": "table", "versions": {b: 0, a: 0}}

    # versions as a map, or as the table layout's list parallel to names: the same answer
    for held in ({b: 0, a: 0}, [None, 0, 0, None]):
        rep = post(http, url, "pull", {**ask, "versions": held}, accept_frame=True)
        assert rep.status == 200 and rep.headers["content-type"] == wire.FRAME
        table = rep.msg["table"]
        assert set(rep.msg) == {"table"}
        assert set(table) == {"versions", "dtype", "shape"}  # rows: the names asked, in order
        assert table["versions"] == [0, 1, 0, 0]
        assert table["dtype"] == ["<f4", "<f4", None, "<f8"]
        assert table["shape"] == [[0], [2, 3], None, []]
        names, rows = wire.table_rows(table, rep.body, names=ask["names"])
        for name, row in zip(names, rows):
            if name == b:
                assert row is None  # the puller holds version 0 already
            else:
                np.testing.assert_array_equal(row, values[name])
    rep = post(http, url, "pull", {**ask, "versions": [0, 1, 0, 0]}, accept_frame=True)
    assert rep.msg["table"]["versions"] == [0, 1, 0, 0]  # every row held: no values
    assert rep.msg["table"]["dtype"] == [None] * 4
    for bad in (
        [0, 0],
        [None, -1, 0, None],
        [None, "1", 0, None],
        [0, -1, 0, 0],
        [0, True, 0, 0],
        [0, 1.0, 0, 0],
    ):
        assert_refused(
            post(http, url, "pull", {**ask, "versions": bad}, accept_frame=True), 400, "bad_request"
        )

    rep = post(http, url, "pull", ask)  # no framed Accept: the map layout
    assert rep.headers["content-type"] == wire.MSGPACK and set(rep.msg) == {"variables"}
    assert rep.msg["variables"][b] == {"version": 0}
    rep = post(http, url, "pull", {**ask, "versions": [None, 0, 0, None]})  # list form too
    assert rep.msg["variables"][b] == {"version": 0} and "value" in rep.msg["variables"][a]
    np.testing.assert_array_equal(rep.tensor(rep.msg["variables"][a]["value"]), values[a])

    missing = owned(0)
    assert_refused(
        post(http, url, "pull", {**ask, "names": [a, missing]}, accept_frame=True), 404, "not_found"
    )
    assert_refused(
        post(http, url, "pull", {**ask, "names": [a, owned(1)]}, accept_frame=True),
        421,
        "not_owner",
    )
    assert_refused(
        post(http, url, "pull", {**ask, "names": [a, "bad name"]}, accept_frame=True),
        400,
        "bad_request",
    )


def test_a_table_pull_may_ask_for_one_dtype_and_shape_once(fleet2, http):
    """`"uniform": true`: when every row holds a tensor of one dtype and shape, the table
    carries them once (`uniform`) instead of two columns; otherwise the columns, as without
    it (nil: as if absent). A `uniform` that is not a bool is refused."""
    url = fleet2.urls[0]
    a, b, c = (owned(0) for _ in range(3))
    values = {
        a: np.arange(6, dtype=np.float32).reshape(2, 3),
        b: np.ones((2, 3), np.float32),
        c: np.arange(3, dtype=np.float32),
    }
    for name, value in values.items():
        init(http, url, name, value, {"type": "add"})
    ask = {"names": [a, b], "layout": "table", "uniform": True}
    rep = post(http, url, "pull", ask, accept_frame=True)
    assert rep.status == 200 and rep.msg["table"] == {
        "versions": [0, 0],
        "uniform": {"dtype": "<f4", "shape": [2, 3]},
    }
    _, rows = wire.table_rows(rep.msg["table"], rep.body, names=[a, b])
    for name, row in zip([a, b], rows):
        np.testing.assert_array_equal(row, values[name])
    for other in (
        {**ask, "names": [a, c]},  # two shapes
        {**ask, "versions": [None, 0]},  # a row held: no tensor
        {**ask, "names": [a]},  # one row
        {**ask, "uniform": False},
        {**ask, "uniform": None},
    ):
        table = post(http, url, "pull", other, accept_frame=True).msg["table"]
        assert "uniform" not in table and len(table["dtype"]) == len(other["names"])
    for bad in (1, "yes", [True]):
        assert_refused(
            post(http, url, "pull", {**ask, "uniform": bad}, accept_frame=True), 400, "bad_request"
        )
        assert_refused(
            post(http, url, "pull", {**ask, "packed": bad}, accept_frame=True), 400, "bad_request"
        )


def test_a_uniform_pull_may_ask_for_its_rows_packed(fleet2, http):
    """`"packed": true` with `"uniform": true`: a uniform table's rows follow one another
    with no padding (`"packed": true` in its `uniform` map); without `uniform`, or where the
    table is not uniform, as if absent. The values are the same either way."""
    url = fleet2.urls[0]
    a, b, c = (owned(0) for _ in range(3))
    values = {
        a: np.arange(6, dtype=np.float32).reshape(2, 3),  # 24 bytes: padded to 64
        b: np.ones((2, 3), np.float32),
        c: np.arange(3, dtype=np.float32),
    }
    for name, value in values.items():
        init(http, url, name, value, {"type": "add"})
    ask = {"names": [a, b], "layout": "table", "uniform": True, "packed": True}
    padded = post(http, url, "pull", {**ask, "packed": False}, accept_frame=True)
    rep = post(http, url, "pull", ask, accept_frame=True)
    assert rep.status == 200 and rep.msg["table"] == {
        "versions": [0, 0],
        "uniform": {"dtype": "<f4", "shape": [2, 3], "packed": True},
    }
    assert len(rep.body) == len(padded.body) - 40  # the padding after the first row
    assert bytes(rep.body[-48:]) == values[a].tobytes() + values[b].tobytes()
    _, rows = wire.table_rows(rep.msg["table"], rep.body, names=[a, b])
    for name, row in zip([a, b], rows):
        np.testing.assert_array_equal(row, values[name])
    for other in ({**ask, "names": [a, c]}, {**ask, "uniform": False}, {**ask, "packed": None}):
        table = post(http, url, "pull", other, accept_frame=True).msg["table"]
        assert "packed" not in table.get("uniform", {})


def post_table(
    http,
    url: str,
    verb: str,
    msg: dict,
    key: str,
    names: list[str],
    arrays: list,
    *,
    content_type: str = wire.FRAME,
    packed: bool = False,
) -> Reply:
    """POST ``msg`` whose field ``key`` is a tensor table of ``arrays`` (``"layout": "table"``;
    ``packed``: a packed uniform table where the arrays have one dtype and shape)."""
    table = msg[key] = {"names": names}
    enc = wire.encode_table(
        {**msg, "layout": "table"}, table, arrays, uniform=packed, packed=packed
    )
    return decode_reply(
        http.post(f"{url}/v1/{verb}", content=enc.join(), headers={"content-type": content_type})
    )


@pytest.mark.parametrize("count", [3, 120])  # a small body, and one of 480 KB (read into
def test_push_with_a_packed_uniform_gradient_table(fleet2, http, count):  # np.empty)
    """A shard listing "packed" takes gradients as a uniform table whose rows follow one
    another with no padding (docs/PROTOCOL.md §2): applied as the columns would be; a NaN in
    one row, or rows running past the body's end, refuse the whole push and change nothing."""
    url = fleet2.urls[0]
    names = [owned(0) for _ in range(count)]
    for name in names:
        init(http, url, name, np.zeros(1000, np.float32), {"type": "sgd", "lr": 0.5})
    wid = worker()
    grads = [np.full(1000, i, np.float32) for i in range(count)]
    rep = post_table(
        http, url, "push", {"worker_id": wid, "seq": 1}, "grads", names, grads, packed=True
    )
    assert rep.status == 200 and {v["status"] for v in rep.msg["variables"].values()} == {"applied"}
    bad = [g.copy() for g in grads]
    bad[-1][999] = np.nan
    assert_refused(
        post_table(
            http, url, "push", {"worker_id": wid, "seq": 2}, "grads", names, bad, packed=True
        ),
        422,
        "bad_tensor",
    )
    t = {}
    msg = {"worker_id": wid, "seq": 3, "layout": "table", "grads": (t := {"names": names})}
    body = wire.encode_table(msg, t, grads, uniform=True, packed=True).join()
    rep = decode_reply(
        http.post(f"{url}/v1/push", content=body[:-4], headers={"content-type": wire.FRAME})
    )
    assert rep.status in (400, 422)
    values = post(http, url, "pull", {"names": names})
    for i, name in enumerate(names):
        entry = values.msg["variables"][name]
        assert entry["version"] == 1
        np.testing.assert_array_equal(values.tensor(entry["value"]), np.full(1000, -0.5 * i))


def test_push_with_a_gradient_table(fleet2, http):
    """`"layout": "table"`: `grads` is one tensor table; refused whole, changing nothing, when
    it is not framed, names a variable twice, has a row without a tensor, or a bad row."""
    url = fleet2.urls[0]
    a, b = owned(0), owned(0)
    init(http, url, a, np.zeros((2, 3), np.float32), {"type": "add"})
    init(http, url, b, np.zeros(4, np.float64), {"type": "add"})
    wid = worker()
    ga, gb = np.ones((2, 3), np.float32), np.arange(4.0)
    rep = post_table(
        http,
        url,
        "push",
        {"worker_id": wid, "seq": 1, "versions": {a: 0}},
        "grads",
        [a, b],
        [ga, gb],
    )
    assert rep.status == 200, rep.msg
    assert rep.msg["variables"] == {
        a: {"status": "applied", "version": 1, "staleness": 0},
        b: {"status": "applied", "version": 1, "staleness": None},
    }
    bad = [
        ({"names": [a, a]}, [ga, ga], wire.FRAME, 400, "bad_request"),
        ({"names": [a, b]}, [ga, None], wire.FRAME, 400, "bad_request"),
        ({"names": [a, b]}, [ga, gb], wire.MSGPACK, 400, "bad_request"),
        ({"names": [a, b]}, [ga, np.full(4, np.nan)], wire.FRAME, 422, "bad_tensor"),
        ({"names": [a, b]}, [ga, np.ones(5)], wire.FRAME, 422, "bad_tensor"),
        ({"names": [a, owned(0)]}, [ga, gb], wire.FRAME, 404, "not_found"),
    ]
    for seq, (table, arrays, ctype, status, code) in enumerate(bad, start=2):
        rep = post_table(
            http,
            url,
            "push",
            {"worker_id": wid, "seq": seq},
            "grads",
            table["names"],
            arrays,
            content_type=ctype,
        )
        assert_refused(rep, status, code)
    rep = post(http, url, "pull", {"names": [a, b]})
    assert {n: v["version"] for n, v in rep.msg["variables"].items()} == {a: 1, b: 1}
    np.testing.assert_array_equal(rep.tensor(rep.msg["variables"][a]["value"]), ga)
    np.testing.assert_array_equal(rep.tensor(rep.msg["variables"][b]["value"]), gb)
    assert_refused(
        post(http, url, "push", {"worker_id": wid, "seq": 99, "layout": "rows", "grads": {a: ga}}),
        400,
        "bad_request",
    )
    # Malformed tables, big enough that the shard scans them as they arrive: 4xx, no trace.
    big = np.ones(300_000, np.float32)
    init(http, url, c := owned(0), np.zeros(300_000, np.float32), {"type": "add"})
    good = wire.encode_table(
        {"worker_id": wid, "seq": 100, "layout": "table", "grads": (t := {"names": [c]})}, t, [big]
    ).join()
    head_len = struct.unpack_from("<I", good, 4)[0]
    header = msgpack.unpackb(good[8 : 8 + head_len])

    def with_grads(grads) -> bytes:
        h = msgpack.packb({**header, "grads": grads})
        return (
            struct.pack("<4sI", wire.FRAME_MAGIC, len(h))
            + h
            + bytes(-(8 + len(h)) % 64)
            + big.tobytes()
        )

    for body, status in [
        (with_grads([1, 2]), 400),
        (with_grads({"names": c, "dtype": ["<f4"], "shape": [[300_000]]}), 400),
        (with_grads({"names": [c], "dtype": ["<f4", "<f4"], "shape": [[300_000]]}), 400),
        (with_grads({"names": [c], "dtype": ["<c8"], "shape": [[300_000]]}), 422),
        (with_grads({"names": [c], "dtype": ["<f4"], "shape": [[300_001]]}), 422),
        (good[:-4], 422),
        (good[:8] + b"\xc1" + good[9:], 400),
    ]:
        rep = post_raw(http, url, "push", body, wire.FRAME)
        assert rep.status == status, (rep.status, rep.msg)
    assert post(http, url, "pull", {"names": [c]}).msg["variables"][c]["version"] == 0
    assert http.get(f"{url}/v1/cluster").json()["features"] == [
        wire.FEATURE_TABLES,
        wire.FEATURE_PACKED,
        wire.FEATURE_COUNTER_KIND,
        wire.FEATURE_POLL,
        wire.FEATURE_SET_OPTIMIZER,
        wire.FEATURE_DELETE,
        wire.FEATURE_EMBEDDING_TABLES,
        wire.FEATURE_WIRE_DTYPE,
        wire.FEATURE_ROWS_WIRE_DTYPE,
        wire.FEATURE_GROUPS,
    ]


def test_init_is_idempotent_and_conflicts_create_nothing(fleet2, http):
    url = fleet2.urls[0]
    name, fresh = owned(0), owned(0)
    w0 = np.ones((2, 2), np.float32)
    init(http, url, name, w0)
    post(http, url, "push", {"worker_id": worker(), "seq": 0, "grads": {name: w0}})

    # same shape and dtype (even in the other byte order): the existing variable, unchanged
    rep = post(http, url, "init", {"variables": {name: {"value": np.zeros((2, 2), ">f4")}}})
    assert rep.msg == {"variables": {name: {"version": 1, "created": False}}}

    for other in (np.ones((2, 3), np.float32), np.ones((2, 2), np.float64)):
        rep = post(
            http,
            url,
            "init",
            {"variables": {fresh: {"value": np.zeros(2, np.float32)}, name: {"value": other}}},
        )
        assert_refused(rep, 409, "conflict")
        assert name in rep.msg["error"]["details"]["conflicts"]
    assert_refused(post(http, url, "pull", {"names": [fresh]}), 404, "not_found")
    state = inspect(http, url, name)
    assert state["version"] == 1 and state["shape"] == [2, 2] and state["dtype"] == "<f4"


def test_increment_counts_atomically(fleet2, http):
    url = fleet2.urls[1]
    name = owned(1, prefix="global_step")
    results: list[int] = []

    def bump() -> None:
        with httpx2.Client(timeout=30.0) as c:
            for _ in range(5):
                rep = post(c, url, "increment", {"name": name})
                assert rep.status == 200, rep.msg
                results.append(rep.msg["value"])

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 21))
    state = inspect(http, url, name)
    assert state["dtype"] == "<i8" and state["shape"] == [] and state["values"] == 20
    rep = post(http, url, "increment", {"name": name, "delta": -20})
    assert rep.msg == {"value": 0, "version": 21, "status": "applied"}

    fname = owned(1)
    rep = post(http, url, "increment", {"name": fname, "delta": 0.5})
    assert rep.msg == {"value": 0.5, "version": 1, "status": "applied"}
    assert inspect(http, url, fname)["dtype"] == "<f8"


def test_wait_returns_missing_at_timeout_and_ready_on_init(fleet2, http):
    url = fleet2.urls[0]
    present, later = owned(0), owned(0)
    init(http, url, present, np.zeros(1, np.float32))
    rep = post(http, url, "wait", {"names": [present, later], "timeout": 0.05})
    assert rep.msg == {"ready": [present], "missing": [later]}

    box: dict[str, Reply] = {}

    def waiter() -> None:
        with httpx2.Client(timeout=60.0) as c:
            box["rep"] = post(c, url, "wait", {"names": [present, later], "timeout": 30})

    def long_poll_bytes() -> int:
        return http.get(url + "/v1/cluster").json()["admission"]["bytes_in_flight"]

    idle = long_poll_bytes()
    t = threading.Thread(target=waiter)
    t.start()
    # a long poll counts its body in bytes_in_flight until it answers: it waits for `later`
    eventually(lambda: long_poll_bytes() > idle, "the long poll is in (bytes_in_flight)")
    assert t.is_alive()
    init(http, url, later, np.zeros(1, np.float32))
    # woken by the init (an answer at the poll's 30 s timeout would also say "ready")
    t.join(20)
    assert not t.is_alive(), "the long poll was not woken by the init"
    assert box["rep"].msg == {"ready": [present, later], "missing": []}


def test_push_reports_staleness(fleet2, http):
    url = fleet2.urls[0]
    name = owned(0)
    init(http, url, name, np.zeros(2, np.float32), {"type": "add"})
    g = np.ones(2, np.float32)
    a = worker()
    for seq in range(3):
        post(http, url, "push", {"worker_id": a, "seq": seq, "grads": {name: g}})
    rep = post(
        http,
        url,
        "push",
        {"worker_id": worker(), "seq": 0, "grads": {name: g}, "versions": {name: 1}},
    )
    assert rep.msg["variables"][name] == {"status": "applied", "version": 4, "staleness": 2}


def test_a_pull_in_flight_never_sees_later_pushes(fleet2, http):
    """A big framed pull of two variables whose reader stalls mid-body while pushes change
    both: the bytes that arrive are still exactly the versions the pull answered with (the
    shard writes the second tensor only after the first drained, so it must not write a
    buffer that the pushes updated in place)."""
    url = fleet2.urls[0]
    names = [owned(0), owned(0)]
    zeros = np.zeros(4 << 20, np.float32)  # 16 MiB each: far more than socket buffers hold
    for name in names:
        init(http, url, name, zeros, {"type": "add"})
    req = wire.encode({"names": names})
    with httpx2.Client(timeout=60.0) as slow:
        with slow.stream(
            "POST",
            f"{url}/v1/pull",
            content=req.join(),
            headers={"content-type": req.content_type, "accept": ACCEPT_FRAME},
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"] == wire.FRAME
            chunks = r.iter_raw()
            received = bytearray(next(chunks))
            for seq in range(3):  # while the rest of the response waits in the shard
                rep = post(
                    http,
                    url,
                    "push",
                    {
                        "worker_id": worker(),
                        "seq": seq,
                        "grads": {n: np.ones_like(zeros) for n in names},
                    },
                    frame=True,
                )
                assert rep.status == 200
            for chunk in chunks:
                received += chunk
    msg = wire.unpack(received, wire.FRAME)
    for name in names:
        assert msg["variables"][name]["version"] == 0
        got = wire.decode_tensor(msg["variables"][name]["value"], received)
        assert not got.any(), f"{name}: the pull's bytes changed after it answered"
    rep = post(http, url, "pull", {"names": names}, accept_frame=True)
    for name in names:
        assert rep.msg["variables"][name]["version"] == 3
        assert (rep.tensor(rep.msg["variables"][name]["value"]) == 3).all()


# -- optimizer math -------------------------------------------------------------------------


def _reference(opt: dict, w: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    w = w.astype(np.float64)
    acc = np.full_like(w, opt.get("initial_accumulator_value", 0.0))
    for g in grads:
        g = g.astype(np.float64)
        if opt["type"] == "add":
            w = w + g
        elif opt["type"] == "sgd":
            w = w - opt["lr"] * (g + opt.get("weight_decay", 0.0) * w)
        else:
            g = g + opt.get("weight_decay", 0.0) * w
            acc = acc + g * g
            w = w - opt["lr"] * g / (np.sqrt(acc) + opt.get("epsilon", 1e-10))
    return w


@pytest.mark.parametrize(
    "opt",
    [
        {"type": "sgd", "lr": 0.1},
        {"type": "sgd", "lr": 0.05, "weight_decay": 0.1},
        {"type": "adagrad", "lr": 0.3},
        {
            "type": "adagrad",
            "lr": 0.2,
            "initial_accumulator_value": 0.5,
            "epsilon": 1e-3,
            "weight_decay": 0.01,
        },
        {"type": "add"},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize(
    "shape,frame", [((3, 4), False), ((128, 160), True)], ids=["small-msgpack", "big-framed"]
)
def test_optimizer_math_matches_numpy(fleet2, http, opt, shape, frame):
    url = fleet2.urls[1]
    name = owned(1)
    rng = np.random.default_rng(42)
    w0 = rng.standard_normal(shape).astype(np.float32)
    init(http, url, name, w0, opt)
    # gradients in several encodings: native f4, big-endian f8 and f2 are cast to the variable's
    grads = [rng.standard_normal(shape).astype(dt) for dt in ("<f4", ">f8", "<f2", ">f4")]
    for seq, g in enumerate(grads):
        rep = post(
            http, url, "push", {"worker_id": worker(), "seq": seq, "grads": {name: g}}, frame=frame
        )
        assert rep.status == 200, rep.msg
    expected = _reference(opt, w0, [g.astype(np.float32) for g in grads])
    rep = post(http, url, "pull", {"names": [name]}, accept_frame=True)
    got = rep.tensor(rep.msg["variables"][name]["value"])
    assert got.dtype == np.float32 and rep.msg["variables"][name]["version"] == len(grads)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# -- refusals: the right code, nothing changed, never a 500 ---------------------------------


@pytest.fixture
def victim(fleet2, http):
    """A variable on shard 0 that a refused request must leave exactly as it was."""
    url = fleet2.urls[0]
    name = owned(0)
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    init(http, url, name, value)
    post(
        http,
        url,
        "push",
        {"worker_id": worker(), "seq": 0, "grads": {name: np.ones((2, 3), np.float32)}},
    )
    before = inspect(http, url, name)
    yield url, name
    after = inspect(http, url, name)
    assert (after["version"], after["values"], after["updates"]) == (
        before["version"],
        before["values"],
        before["updates"],
    ), "a refused request changed state"
    assert_healthy(http, url)


def _bad_requests(name: str, other: str) -> list[tuple[str, str, Any, int, str]]:
    """(id, verb, body, status, code); ``body`` is a message or raw ``bytes`` (msgpack)."""
    g = np.ones((2, 3), np.float32)
    push = {"worker_id": worker(), "seq": 1}
    return [
        ("garbage-bytes", "push", b"\xc1\xff\x00not msgpack", 400, "bad_request"),
        ("empty-body", "pull", b"", 400, "bad_request"),
        ("non-map-msgpack", "push", msgpack.packb([1, 2, 3]), 400, "bad_request"),
        ("msgpack-string", "pull", msgpack.packb("names"), 400, "bad_request"),
        ("missing-grads", "push", {**push}, 400, "bad_request"),
        ("missing-worker-id", "push", {"seq": 1, "grads": {name: g}}, 400, "bad_request"),
        ("missing-names", "pull", {}, 400, "bad_request"),
        ("names-not-list", "pull", {"names": name}, 400, "bad_request"),
        ("names-not-strings", "pull", {"names": [1, 2]}, 400, "bad_request"),
        ("pull-unknown-layout", "pull", {"names": [name], "layout": "columns"}, 400, "bad_request"),
        ("seq-negative", "push", {**push, "seq": -1, "grads": {name: g}}, 400, "bad_request"),
        ("seq-string", "push", {**push, "seq": "1", "grads": {name: g}}, 400, "bad_request"),
        ("seq-bool", "push", {**push, "seq": True, "grads": {name: g}}, 400, "bad_request"),
        ("worker-id-int", "push", {**push, "worker_id": 5, "grads": {name: g}}, 400, "bad_request"),
        (
            "versions-past-int64",
            "push",
            {**push, "grads": {name: g}, "versions": {name: 2**64 - 1}},
            400,
            "bad_request",
        ),
        (
            "pull-versions-past-int64",
            "pull",
            {"names": [name], "layout": "table", "versions": [2**63]},
            400,
            "bad_request",
        ),
        (
            "versions-not-ints",
            "push",
            {**push, "grads": {name: g}, "versions": {name: "x"}},
            400,
            "bad_request",
        ),
        ("grads-not-map", "push", {**push, "grads": [g]}, 400, "bad_request"),
        ("grad-not-tensor", "push", {**push, "grads": {name: 3}}, 422, "bad_tensor"),
        ("bad-name", "push", {**push, "grads": {"bad name!": g}}, 400, "bad_request"),
        (
            "bad-dtype",
            "push",
            {**push, "grads": {name: {"dtype": "<c8", "shape": [2, 3], "data": bytes(48)}}},
            422,
            "bad_tensor",
        ),
        (
            "data-size-mismatch",
            "push",
            {**push, "grads": {name: {"dtype": "<f4", "shape": [2, 3], "data": bytes(20)}}},
            422,
            "bad_tensor",
        ),
        ("unknown-name", "push", {**push, "grads": {name: g, other: g}}, 404, "not_found"),
        (
            "wrong-shape",
            "push",
            {**push, "grads": {name: np.ones((3, 2), np.float32)}},
            422,
            "bad_tensor",
        ),
        (
            "int-gradient",
            "push",
            {**push, "grads": {name: np.ones((2, 3), np.int32)}},
            422,
            "bad_tensor",
        ),
        (
            "nan-gradient",
            "push",
            {**push, "grads": {name: np.full((2, 3), np.nan, np.float32)}},
            422,
            "bad_tensor",
        ),
        (
            "inf-gradient",
            "push",
            {**push, "grads": {name: np.array([[1, 2, np.inf]] * 2)}},
            422,
            "bad_tensor",
        ),
        (
            "overflows-f4",
            "push",
            {**push, "grads": {name: np.full((2, 3), 1e300)}},
            422,
            "bad_tensor",
        ),
        (
            "assign-wrong-shape",
            "assign",
            {"values": {name: np.ones(6, np.float32)}},
            422,
            "bad_tensor",
        ),
        (
            "assign-nan",
            "assign",
            {"values": {name: np.full((2, 3), np.nan, np.float32)}},
            422,
            "bad_tensor",
        ),
        (
            "init-conflict",
            "init",
            {"variables": {name: {"value": np.ones(3, np.float32)}}},
            409,
            "conflict",
        ),
        (
            "init-bad-optimizer",
            "init",
            {"variables": {other: {"value": g, "optimizer": {"type": "adamax"}}}},
            400,
            "bad_request",
        ),
        (
            "init-negative-lr",
            "init",
            {"variables": {other: {"value": g, "optimizer": {"type": "sgd", "lr": -1.0}}}},
            400,
            "bad_request",
        ),
        (
            "init-nan",
            "init",
            {"variables": {other: {"value": np.full(3, np.nan)}}},
            422,
            "bad_tensor",
        ),
        ("init-entry-not-map", "init", {"variables": {other: g}}, 400, "bad_request"),
        ("increment-non-scalar", "increment", {"name": name}, 422, "bad_tensor"),
        ("increment-delta-string", "increment", {"name": other, "delta": "1"}, 400, "bad_request"),
        ("wait-bad-timeout", "wait", {"names": [name], "timeout": "soon"}, 400, "bad_request"),
        ("wait-negative-timeout", "wait", {"names": [name], "timeout": -1}, 400, "bad_request"),
    ]


_CASE_IDS = [c[0] for c in _bad_requests("x", "y")]


@pytest.mark.parametrize("case", _CASE_IDS)
def test_bad_request_is_refused_and_changes_nothing(victim, http, case):
    url, name = victim
    other = owned(0)
    _, verb, body, status, code = next(c for c in _bad_requests(name, other) if c[0] == case)
    rep = (
        post_raw(http, url, verb, body) if isinstance(body, bytes) else post(http, url, verb, body)
    )
    assert_refused(rep, status, code)
    # nothing named in the request was created either
    assert_refused(post(http, url, "pull", {"names": [other]}), 404, "not_found")


def test_a_bad_gradient_refuses_the_whole_push(fleet2, http, victim):
    url, name = victim
    good = owned(0)
    init(http, url, good, np.zeros(3, np.float32))
    rep = post(
        http,
        url,
        "push",
        {
            "worker_id": worker(),
            "seq": 9,
            "grads": {good: np.ones(3, np.float32), name: np.full((2, 3), np.nan, np.float32)},
        },
    )
    assert_refused(rep, 422, "bad_tensor")
    assert rep.msg["error"]["details"]["variable"] == name
    assert inspect(http, url, good)["version"] == 0


def test_push_to_an_integer_variable_is_refused(fleet2, http):
    url = fleet2.urls[0]
    name = owned(0)
    init(http, url, name, np.arange(4, dtype=np.int64))
    rep = post(
        http,
        url,
        "push",
        {"worker_id": worker(), "seq": 0, "grads": {name: np.ones(4, np.float32)}},
    )
    assert_refused(rep, 422, "bad_tensor")
    state = inspect(http, url, name)
    assert state["version"] == 0 and state["values"] == [0, 1, 2, 3]


def test_increment_refusals_leave_the_counter(fleet2, http):
    url = fleet2.urls[0]
    name = owned(0)
    assert post(http, url, "increment", {"name": name, "delta": 3}).msg["value"] == 3
    assert_refused(post(http, url, "increment", {"name": name, "delta": 1.5}), 422, "bad_tensor")
    assert_refused(post(http, url, "increment", {"name": name, "delta": 2**63}), 422, "bad_tensor")
    state = inspect(http, url, name)
    assert (state["values"], state["version"]) == (3, 1)


@pytest.mark.parametrize(
    "case",
    [
        "truncated-frame",
        "short-prefix",
        "bad-magic",
        "offset-out-of-range",
        "negative-offset",
        "nbytes-mismatch",
    ],
)
def test_bad_frames_are_refused(victim, http, case):
    url, name = victim
    g = np.ones((64, 64), np.float32)
    other = owned(0)
    good = frame_bytes(
        {"worker_id": worker(), "seq": 1, "grads": {name: np.ones((2, 3), np.float32), other: g}}
    )
    (hlen,) = struct.unpack_from("<I", good, 4)
    header = msgpack.unpackb(good[8 : 8 + hlen])

    def reframe(msg: Any) -> bytes:
        head = msgpack.packb(msg)
        return struct.pack("<4sI", wire.FRAME_MAGIC, len(head)) + head + bytes(good[8 + hlen :])

    t = header["grads"][name]
    if case == "truncated-frame":
        body, status, code = good[: 8 + hlen // 2], 400, "bad_request"
    elif case == "short-prefix":
        body, status, code = good[:5], 400, "bad_request"
    elif case == "bad-magic":
        body, status, code = b"XXXX" + good[4:], 400, "bad_request"
    elif case == "offset-out-of-range":
        t["offset"] = len(good) + 64
        body, status, code = reframe(header), 422, "bad_tensor"
    elif case == "negative-offset":
        t["offset"] = -64
        body, status, code = reframe(header), 422, "bad_tensor"
    else:
        t["nbytes"] = 4
        body, status, code = reframe(header), 422, "bad_tensor"
    assert_refused(post_raw(http, url, "push", body, wire.FRAME), status, code)


def test_wrong_content_type_is_415(victim, http):
    url, name = victim
    body = wire.encode({"names": [name]}).join()
    for ctype in ("text/plain", "application/jsonx", ""):
        rep = post_raw(http, url, "pull", body, ctype)
        assert_refused(rep, 415, "unsupported_media_type")
    rep = post_raw(http, url, "pull", body, wire.JSON)  # a JSON body gets its error in JSON
    assert rep.status == 415 and rep.headers["content-type"].startswith(wire.JSON)
    assert rep.msg["error"]["code"] == "unsupported_media_type"


def test_not_owner_is_421_with_owners(fleet2, http):
    mine, theirs = owned(0), owned(1)
    url = fleet2.urls[0]
    init(http, url, mine, np.zeros(2, np.float32))
    for verb, msg in [
        (
            "init",
            {
                "variables": {
                    theirs: {"value": np.zeros(2, np.float32)},
                    mine: {"value": np.zeros(2, np.float32)},
                }
            },
        ),
        ("pull", {"names": [mine, theirs]}),
        (
            "push",
            {
                "worker_id": worker(),
                "seq": 0,
                "grads": {mine: np.ones(2, np.float32), theirs: np.ones(2, np.float32)},
            },
        ),
        ("assign", {"values": {theirs: np.ones(2, np.float32)}}),
        ("increment", {"name": theirs}),
        ("wait", {"names": [theirs]}),
    ]:
        rep = post(http, url, verb, msg)
        assert_refused(rep, 421, "not_owner")
        assert rep.msg["error"]["details"]["owners"] == {theirs: 1}, verb
    assert inspect(http, url, mine)["version"] == 0
    r = http.get(f"{fleet2.urls[1]}/v1/variables/{theirs}")
    assert r.status_code == 404  # the push above did not reach or create anything


def test_fleet_header_mismatch_is_421(fleet2, http):
    url = fleet2.urls[0]
    name = owned(0)
    init(http, url, name, np.zeros(1, np.float32))
    ok = post(http, url, "pull", {"names": [name]}, headers={"x-paramshard-fleet": "0/2"})
    assert ok.status == 200
    for claimed in ("1/2", "0/3"):
        rep = post(http, url, "pull", {"names": [name]}, headers={"x-paramshard-fleet": claimed})
        assert_refused(rep, 421, "fleet_mismatch")
        assert rep.msg["error"]["details"]["actual"] == "0/2"
    rep = post(http, url, "pull", {"names": [name]}, headers={"x-paramshard-fleet": "zero"})
    assert_refused(rep, 400, "bad_request")
    r = http.get(url + "/v1/cluster", headers={"x-paramshard-fleet": "1/2"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "fleet_mismatch"


def test_unknown_routes_and_methods(fleet2, http):
    url = fleet2.urls[0]
    rep = post_raw(http, url, "frobnicate", msgpack.packb({}))
    assert_refused(rep, 404, "not_found")
    r = http.get(url + "/v1/push")  # a data-plane path answers in msgpack, whatever the method
    assert r.status_code == 405 and r.headers["content-type"].startswith(wire.MSGPACK)
    assert msgpack.unpackb(r.content)["error"]["code"] == "method_not_allowed"
    r = http.get(url + "/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_too_large_body_is_413(fleet_factory, http):
    fleet = fleet_factory(1, "--max-request-bytes", "4096")
    url = fleet.urls[0]
    name = owned(0, 1)
    init(http, url, name, np.zeros(8, np.float32))
    big = {"worker_id": worker(), "seq": 0, "grads": {name: np.zeros(2048, np.float32)}}
    assert_refused(post(http, url, "push", big), 413, "too_large")
    assert_refused(post(http, url, "push", big, frame=True), 413, "too_large")

    body = wire.encode(big).join()

    def chunks():  # no Content-Length: the shard counts as it reads
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    rep = decode_reply(
        http.post(f"{url}/v1/push", content=chunks(), headers={"content-type": wire.MSGPACK})
    )
    assert_refused(rep, 413, "too_large")
    # a small body still works, and nothing was applied
    assert post(http, url, "pull", {"names": [name]}).status == 200
    assert inspect(http, url, name)["version"] == 0
    assert_healthy(http, url)


# -- inspection -----------------------------------------------------------------------------


def test_inspection_endpoints(fleet2, http):
    url = fleet2.urls[1]
    name = owned(1, prefix="layer1/kernel")  # a slash in the name: the route takes a path
    value = np.array([[3.0, -4.0], [0.0, 1.0]], np.float32)
    init(http, url, name, value, {"type": "adagrad", "lr": 0.1})

    r = http.get(f"{url}/v1/variables/{name}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    info = r.json()
    assert info["name"] == name and info["shape"] == [2, 2] and info["dtype"] == "<f4"
    assert info["version"] == 0 and info["optimizer"]["type"] == "adagrad"
    assert info["l2_norm"] == pytest.approx(np.sqrt(26.0))
    assert (info["min"], info["max"], info["mean"]) == (-4.0, 3.0, 0.0)
    assert "values" not in info
    assert inspect(http, url, name)["values"] == value.tolist()

    r = http.get(f"{url}/v1/variables/{name}", params={"format": "npy"})
    assert r.status_code == 200
    np.testing.assert_array_equal(np.load(io.BytesIO(r.content), allow_pickle=False), value)

    listed = http.get(f"{url}/v1/variables").json()["variables"]
    assert name in [v["name"] for v in listed]
    names = [v["name"] for v in listed]
    assert names == sorted(names)

    cluster = http.get(f"{url}/v1/cluster").json()
    assert (cluster["shard_index"], cluster["num_shards"]) == (1, 2)
    assert cluster["protocol_version"] == wire.PROTOCOL_VERSION
    assert cluster["variables"] >= 1 and cluster["bytes"] >= value.nbytes
    assert {"incarnation", "version", "started_at"} <= set(cluster)


def test_inspection_refusals_are_json(fleet2, http):
    url = fleet2.urls[1]
    big = owned(1)
    init(http, url, big, np.zeros(65_537, np.float32), {"type": "add"})
    r = http.get(f"{url}/v1/variables/{big}", params={"values": "true"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert "format=npy" in r.json()["error"]["message"]
    assert http.get(f"{url}/v1/variables/{big}").status_code == 200  # stats are fine

    r = http.get(f"{url}/v1/variables/{owned(1)}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    theirs = owned(0)
    r = http.get(f"{url}/v1/variables/{theirs}")
    assert r.status_code == 421 and r.json()["error"]["details"]["owners"] == {theirs: 0}
    r = http.get(f"{url}/v1/variables/{big}", params={"format": "csv"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
    r = http.get(f"{url}/v1/variables/{big}", params={"values": "perhaps"})
    assert r.status_code == 400
    r = http.get(f"{url}/v1/variables/bad name")
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


def test_docs_and_openapi(fleet2, http):
    url = fleet2.urls[0]
    r = http.get(url + "/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
    spec = http.get(url + "/openapi.json").json()
    for path in ("/v1/push", "/v1/pull", "/v1/cluster", "/v1/variables/{name}", "/healthz"):
        assert path in spec["paths"], path


def test_every_response_carries_the_shard_headers(fleet2, http):
    for i, url in enumerate(fleet2.urls):
        incarnation = http.get(url + "/v1/cluster").json()["incarnation"]
        responses = [
            http.get(url + "/healthz"),
            http.get(url + "/docs"),
            http.get(url + "/nowhere"),
            http.get(url + "/v1/push"),
            http.post(url + "/v1/pull", content=b"\xc1", headers={"content-type": wire.MSGPACK}),
            http.post(
                url + "/v1/pull",
                content=wire.encode({"names": []}).join(),
                headers={"content-type": wire.MSGPACK},
            ),
            http.post(url + "/v1/pull", content=b"", headers={"x-paramshard-fleet": "9/9"}),
        ]
        for r in responses:
            assert r.headers[wire.HEADER_SHARD] == f"{i}/2", r.request.url
            assert r.headers[wire.HEADER_INCARNATION] == incarnation
            assert r.headers[wire.HEADER_PROTOCOL] == str(wire.PROTOCOL_VERSION)
    a, b = (http.get(u + "/healthz").headers[wire.HEADER_INCARNATION] for u in fleet2.urls)
    assert a != b
