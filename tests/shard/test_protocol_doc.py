"""docs/PROTOCOL.md, point by point, against a real shard.

Each test states one rule of the page as a client written from it alone would read it, and
checks it over real HTTP with bodies made by ``client_sdk.wire`` (or by hand, where the point is
a body the SDK never sends). The shard is one process (a fleet of one owns every name).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import pytest

from client_sdk import wire
from tests.conftest import OnLoop
from tests.helpers.names import fresh

ACCEPT_FRAME = f"{wire.FRAME}, {wire.MSGPACK}"


@pytest.fixture(scope="module")
def url(fleet1):
    return fleet1.urls[0]


def send(
    http, url: str, verb: str, body: bytes, content_type: str, accept_frame: bool = False
) -> tuple[int, str, Any, bytearray]:
    headers = {"content-type": content_type}
    if accept_frame:
        headers["accept"] = ACCEPT_FRAME
    r = http.post(f"{url}/v1/{verb}", content=body, headers=headers)
    ctype = r.headers.get("content-type", "")
    content = bytearray(r.content)
    return r.status_code, ctype, wire.unpack(content, ctype), content


def post(
    http, url: str, verb: str, msg: Any, *, frame: bool | None = False, accept_frame: bool = False
) -> tuple[int, Any]:
    enc = wire.encode(msg, frame=frame)
    status, _, reply, _ = send(http, url, verb, enc.join(), enc.content_type, accept_frame)
    return status, reply


def ok(http, url: str, verb: str, msg: Any, **kwargs: Any) -> Any:
    status, reply = post(http, url, verb, msg, **kwargs)
    assert status == 200, reply
    return reply


def refused(http, url: str, verb: str, msg: Any, status: int, code: str, **kwargs: Any) -> dict:
    got, reply = post(http, url, verb, msg, **kwargs)
    assert (got, reply["error"]["code"]) == (status, code), reply
    return reply["error"]


def state(http, url: str, name: str) -> dict:
    r = http.get(f"{url}/v1/variables/{name}", params={"values": "true"})
    assert r.status_code == 200, r.text
    return r.json()


def init(http, url: str, name: str, value: np.ndarray, optimizer: dict | None = None) -> None:
    entry: dict[str, Any] = {"value": value}
    if optimizer is not None:
        entry["optimizer"] = optimizer
    assert ok(http, url, "init", {"variables": {name: entry}})["variables"][name]["created"]


# -- §3 push: which seqs below the highest are told apart ------------------------------------


def test_the_dedup_window_is_the_65536_seqs_ending_at_the_highest(http, url):
    name, worker = fresh(), fresh("w")
    init(http, url, name, np.zeros(2, np.float32))
    high = 1 << 20
    g = np.ones(2, np.float32)
    ok(http, url, "push", {"worker_id": worker, "seq": high, "grads": {name: g}})
    edge = high - 65535  # the lowest seq the window tells apart
    reply = ok(http, url, "push", {"worker_id": worker, "seq": edge, "grads": {name: g}})
    assert reply["variables"][name]["status"] == "applied"
    reply = ok(http, url, "push", {"worker_id": worker, "seq": edge, "grads": {name: g}})
    assert reply["variables"][name]["status"] == "duplicate"
    err = refused(
        http,
        url,
        "push",
        {"worker_id": worker, "seq": edge - 1, "grads": {name: g}},
        409,
        "seq_expired",
    )
    assert err["details"]["high_seq"] == high
    assert state(http, url, name)["version"] == 2


# -- §3 increment: the results a retry can get back ------------------------------------------


def test_a_retried_increment_gets_its_value_while_one_of_the_256_latest(http, url):
    name, worker = fresh("c"), fresh("w")
    for seq in range(257):
        assert (
            ok(http, url, "increment", {"name": name, "worker_id": worker, "seq": seq})["value"]
            == seq + 1
        )
    # seqs 1..256 are the worker's 256 latest increments: their results are kept
    assert ok(http, url, "increment", {"name": name, "worker_id": worker, "seq": 1}) == {
        "value": 2,
        "version": 2,
        "status": "duplicate",
    }
    err = refused(
        http, url, "increment", {"name": name, "worker_id": worker, "seq": 0}, 409, "seq_expired"
    )
    assert err["details"]["results_kept"] == 256
    assert "applied already" in err["message"] and "too far below" not in err["message"]
    assert state(http, url, name)["values"] == 257


# -- §3 push: where a push's versions go -----------------------------------------------------


def test_versions_as_a_column_of_a_push_table_is_refused(http, url):
    name = fresh()
    init(http, url, name, np.zeros(4, np.float32))
    table = {"names": [name], "versions": [0]}
    enc = wire.encode_table(
        {"worker_id": fresh("w"), "seq": 1, "layout": "table", "grads": table},
        table,
        [np.ones(4, np.float32)],
    )
    status, _, reply, _ = send(http, url, "push", enc.join(), enc.content_type)
    assert status == 400 and reply["error"]["code"] == "bad_request", reply
    assert reply["error"]["details"]["field"] == "grads.versions"
    assert "top level" in reply["error"]["message"]
    assert state(http, url, name)["version"] == 0


def test_staleness_is_nil_without_versions(http, url):
    name, worker = fresh(), fresh("w")
    init(http, url, name, np.zeros(2, np.float32))
    g = np.ones(2, np.float32)
    reply = ok(http, url, "push", {"worker_id": worker, "seq": 1, "grads": {name: g}})
    assert reply["variables"][name] == {"status": "applied", "version": 1, "staleness": None}
    reply = ok(
        http,
        url,
        "push",
        {"worker_id": worker, "seq": 2, "grads": {name: g}, "versions": {name: 0}},
    )
    assert reply["variables"][name]["staleness"] == 1


# -- §3 init: the optimizers' formulas and defaults ------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        None,
        {"type": "sgd"},
        {"type": "sgd", "weight_decay": 0.5},
        {"type": "adagrad"},
        {"type": "adagrad", "weight_decay": 0.5},
        {"type": "add"},
    ],
)
def test_optimizers_follow_the_formulas_and_defaults_of_the_doc(http, url, spec):
    name = fresh()
    w0 = np.array([1.0, -2.0, 0.5], np.float64)
    init(http, url, name, w0, spec)
    grads = [np.array([0.5, 1.0, -4.0]), np.array([-1.0, 0.25, 2.0])]
    for seq, g in enumerate(grads):
        ok(http, url, "push", {"worker_id": fresh("w"), "seq": seq, "grads": {name: g}})
    # The formulas and defaults as docs/PROTOCOL.md states them.
    kind = (spec or {}).get("type", "sgd")
    lr = 0.01 if spec is None or kind == "adagrad" else 0.001
    wd = (spec or {}).get("weight_decay", 0.0)
    w = w0.copy()
    acc = np.zeros(3)
    for g in grads:
        if kind == "add":
            w = w + g
        elif kind == "sgd":
            w = w - lr * (g + wd * w)
        else:
            g = g + wd * w
            acc = acc + g * g
            w = w - lr * g / (np.sqrt(acc) + 1e-10)
    np.testing.assert_allclose(state(http, url, name)["values"], w, rtol=1e-12)
    shown = state(http, url, name)["optimizer"]
    assert shown["type"] == kind
    if kind == "adagrad":
        assert (
            shown["lr"],
            shown["lr_decay"],
            shown["initial_accumulator_value"],
            shown["epsilon"],
            shown["clip_norm"],
            shown["schedule"],
        ) == (0.01, 0.0, 0.0, 1e-10, None, {"type": "constant"})
    if spec is None:
        assert (shown["lr"], shown["momentum"], shown["nesterov"]) == (0.01, 0.0, False)


# -- §3 assign, increment: worker_id and seq come together -----------------------------------


@pytest.mark.parametrize("verb", ["assign", "increment"])
@pytest.mark.parametrize("given", ["seq", "worker_id"])
def test_seq_and_worker_id_are_optional_together(http, url, verb, given):
    name = fresh()
    init(http, url, name, np.zeros((), np.float64))
    msg: dict[str, Any] = (
        {"values": {name: np.ones((), np.float64)}} if verb == "assign" else {"name": name}
    )
    msg[given] = 7 if given == "seq" else fresh("w")
    err = refused(http, url, verb, msg, 400, "bad_request")
    other = "worker_id" if given == "seq" else "seq"
    assert err["details"]["field"] == other
    assert "neither" in err["message"]
    assert state(http, url, name)["version"] == 0
    assert ok(http, url, verb, {**msg, other: 7 if other == "seq" else fresh("w")})


# -- §2 tensors: byte order -------------------------------------------------------------------


def test_big_endian_values_are_stored_little_endian_as_the_same_dtype(http, url):
    name = fresh()
    value = np.arange(6, dtype=">f4").reshape(2, 3)
    init(http, url, name, value)
    reply = ok(http, url, "pull", {"names": [name]})
    t = reply["variables"][name]["value"]
    assert t["dtype"] == "<f4"
    np.testing.assert_array_equal(wire.decode_tensor(t), value)
    again = ok(http, url, "init", {"variables": {name: {"value": value.astype("<f4")}}})
    assert again["variables"][name] == {"version": 0, "created": False}
    ok(
        http,
        url,
        "push",
        {"worker_id": fresh("w"), "seq": 1, "grads": {name: np.ones((2, 3), ">f4")}},
    )
    assert state(http, url, name)["dtype"] == "<f4"


# -- §3 wait: at most 30 seconds ----------------------------------------------------------------


def test_a_wait_longer_than_30_seconds_is_refused(http, url):
    name = fresh()
    init(http, url, name, np.zeros(1, np.float32))
    for timeout in (30.5, 31, float("inf"), float("nan"), -1):
        err = refused(http, url, "wait", {"names": [name], "timeout": timeout}, 400, "bad_request")
        assert err["details"]["field"] == "timeout"
    assert ok(http, url, "wait", {"names": [name], "timeout": 30}) == {
        "ready": [name],
        "missing": [],
    }


# -- §2 errors: a data-plane path answers in msgpack, whatever the method -------------------------


@pytest.mark.parametrize("verb", ["push", "pull", "pause"])
def test_another_method_on_a_data_plane_path_is_405_in_msgpack(http, url, verb):
    r = http.get(f"{url}/v1/{verb}")
    assert r.status_code == 405
    assert r.headers["content-type"].startswith(wire.MSGPACK)
    err = msgpack.unpackb(r.content)["error"]
    assert err["code"] == "method_not_allowed" and "POST" in r.headers["allow"]
    r = http.get(f"{url}/v1/variables")  # inspection stays JSON
    assert r.status_code == 200 and r.headers["content-type"].startswith(wire.JSON)


# -- §2 bodies: when a reply is framed -------------------------------------------------------


def test_a_reply_is_framed_from_64_kib_of_tensors_when_the_client_accepts_it(http, url):
    small, big = fresh(), fresh()
    init(http, url, small, np.zeros(16383, np.float32))  # 65,532 bytes
    init(http, url, big, np.zeros(16384, np.float32))  # 65,536 bytes
    enc = wire.encode({"names": [small]})
    _, ctype, _, _ = send(http, url, "pull", enc.join(), enc.content_type, accept_frame=True)
    assert ctype.startswith(wire.MSGPACK)
    enc = wire.encode({"names": [big]})
    _, ctype, _, _ = send(http, url, "pull", enc.join(), enc.content_type, accept_frame=True)
    assert ctype.startswith(wire.FRAME)
    _, ctype, _, _ = send(http, url, "pull", enc.join(), enc.content_type, accept_frame=False)
    assert ctype.startswith(wire.MSGPACK)


# -- §2 bodies: a framed body's layout -------------------------------------------------------


def _push_frame(name: str, g: np.ndarray, offset: int) -> bytes:
    """A framed push of ``g`` whose header says it lies at ``offset``, and the body ending
    where it ends."""
    header = {
        "worker_id": fresh("w"),
        "seq": 1,
        "grads": {
            name: {
                "dtype": g.dtype.str,
                "shape": list(g.shape),
                "offset": offset,
                "nbytes": g.nbytes,
            }
        },
    }
    head = msgpack.packb(header)
    prefix = struct.pack("<4sI", wire.FRAME_MAGIC, len(head)) + head
    assert offset < len(prefix) or len(prefix) <= offset
    body = bytearray(max(len(prefix), offset + g.nbytes))
    body[offset : offset + g.nbytes] = g.tobytes()
    body[: len(prefix)] = prefix
    return bytes(body)


@pytest.mark.parametrize(
    "case",
    [
        "unaligned-offset",
        "offset-in-header",
        "trailing-bytes",
        "trailing-bytes-table",
        "trailing-bytes-uniform",
        "trailing-bytes-no-tensors",
    ],
)
def test_a_framed_body_off_its_layout_is_refused(http, url, case):
    name = fresh()
    init(http, url, name, np.zeros(32, np.float32))
    g = np.arange(32, dtype=np.float32)
    verb, status, code = "push", 400, "bad_request"
    if case == "unaligned-offset":
        body, status, code = _push_frame(name, g, 256 + 4), 422, "bad_tensor"
    elif case == "offset-in-header":
        body, status, code = _push_frame(name, g, 0), 422, "bad_tensor"
    elif case == "trailing-bytes":
        body = wire.encode(
            {"worker_id": fresh("w"), "seq": 1, "grads": {name: g}}, frame=True
        ).join() + bytes(64)
    elif case in ("trailing-bytes-table", "trailing-bytes-uniform"):
        names = [name, fresh()]
        init(http, url, names[1], np.zeros(32, np.float32))
        table: dict[str, Any] = {"names": names}
        enc = wire.encode_table(
            {"worker_id": fresh("w"), "seq": 1, "layout": "table", "grads": table},
            table,
            [g, g],
            uniform=case.endswith("uniform"),
        )
        body = enc.join() + b"\0"
    else:
        verb = "pull"
        body = wire.encode({"names": [name]}, frame=True).join() + bytes(8)
    got, _, reply, _ = send(http, url, verb, body, wire.FRAME)
    assert (got, reply["error"]["code"]) == (status, code), reply
    assert state(http, url, name)["version"] == 0
    # the same bodies laid out as the doc says are taken
    if case in ("unaligned-offset", "offset-in-header"):
        good = _push_frame(name, g, 256)
        assert send(http, url, verb, good, wire.FRAME)[0] == 200
    elif case != "trailing-bytes-no-tensors":
        assert (
            send(http, url, verb, body[: -64 if case == "trailing-bytes" else -1], wire.FRAME)[0]
            == 200
        )


# -- §3 increment: the counter's kind, chosen by the client ------------------------------------


def test_increment_kind_makes_the_counter_whatever_type_the_delta_has(http, url):
    as_float, as_int = fresh("c"), fresh("c")
    reply = ok(http, url, "increment", {"name": as_float, "delta": 1, "kind": "float"})
    assert reply["value"] == 1.0 and isinstance(reply["value"], float)
    assert state(http, url, as_float)["dtype"] == "<f8"
    reply = ok(http, url, "increment", {"name": as_float, "delta": 2, "kind": "float"})
    assert reply["value"] == 3.0 and isinstance(reply["value"], float)
    reply = ok(http, url, "increment", {"name": as_int, "delta": 2.0, "kind": "int"})
    assert reply["value"] == 2 and isinstance(reply["value"], int)
    assert state(http, url, as_int)["dtype"] == "<i8"
    # without kind, the msgpack type of delta decides
    inferred = fresh("c")
    assert isinstance(ok(http, url, "increment", {"name": inferred})["value"], int)
    # refusals change nothing
    err = refused(
        http, url, "increment", {"name": as_int, "delta": 1, "kind": "float"}, 409, "conflict"
    )
    assert err["details"]["kind"] == "int"
    refused(http, url, "increment", {"name": as_float, "delta": 1, "kind": "int"}, 409, "conflict")
    refused(
        http, url, "increment", {"name": as_int, "delta": 1.5, "kind": "int"}, 400, "bad_request"
    )
    refused(http, url, "increment", {"name": as_int, "kind": "decimal"}, 400, "bad_request")
    assert (state(http, url, as_int)["values"], state(http, url, as_float)["values"]) == (2, 3.0)
    features = http.get(f"{url}/v1/cluster").json()["features"]
    assert wire.FEATURE_COUNTER_KIND in features


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_sdk_passes_the_counter_kind(url, flavour):
    from client_sdk import AsyncPSClient, ConflictError, PSClient

    client = PSClient([url]) if flavour == "sync" else OnLoop(AsyncPSClient([url]))
    try:
        name = fresh("c")
        value = client.increment(name, 1, kind="float")
        assert value == 1.0 and isinstance(value, float)
        with pytest.raises(ConflictError):
            client.increment(name, 1, kind="int")
        value = client.increment(fresh("c"), 3.0, kind="int")
        assert value == 3 and isinstance(value, int)
    finally:
        client.close()
