"""``POST /v1/poll`` (docs/PROTOCOL.md §3 poll), over real HTTP against real shard processes.

A poll is a pull that waits: "newer than" (answer when one named variable's version differs
from the one the client holds) and "min version" (answer when every named variable reached a
version). Each test sends hand-made bodies (``client_sdk.wire``) as a client written from the
page would, and learns that a poll is waiting from the shard itself (``polls_waiting`` in
``GET /v1/cluster``), never from a sleep. Where a test checks that a poll is *still* waiting,
it first makes one more round trip to the shard, so a wrong answer would have come by then.
"""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx2
import numpy as np
import pytest

from client_sdk import wire
from tests.conftest import HTTP_MODES, Fleet, http_json
from tests.helpers.names import fresh

ACCEPT_FRAME = f"{wire.FRAME}, {wire.MSGPACK}"
#: How far above a variable's current version a min_version may be (docs/PROTOCOL.md, Limits).
MAX_AHEAD = 1_000_000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(1, tmp_path_factory.mktemp("poll"))
    yield f
    f.close()


@pytest.fixture(scope="module")
def url(fleet):
    return fleet.urls[0]


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        yield ex


def post(url: str, verb: str, msg: Any, accept_frame: bool = False) -> tuple[int, Any]:
    enc = wire.encode(msg)
    headers = {"content-type": enc.content_type}
    if accept_frame:
        headers["accept"] = ACCEPT_FRAME
    r = httpx2.post(f"{url}/v1/{verb}", content=enc.join(), headers=headers, timeout=60.0)
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"])


def ok(url: str, verb: str, msg: Any, **kwargs: Any) -> Any:
    status, reply = post(url, verb, msg, **kwargs)
    assert status == 200, reply
    return reply


def refused(url: str, msg: Any, status: int, code: str) -> dict:
    got, reply = post(url, "poll", msg)
    assert (got, reply["error"]["code"]) == (status, code), reply
    return reply["error"]


def init(url: str, **values: np.ndarray) -> None:
    ok(url, "init", {"variables": {n: {"value": v} for n, v in values.items()}})


_seq = iter(range(1, 1 << 62))


def push(url: str, name: str, grad: np.ndarray) -> int:
    """Push ``grad`` (SGD, lr 0.01 by default) and return the variable's new version."""
    reply = ok(url, "push", {"worker_id": "learner", "seq": next(_seq), "grads": {name: grad}})
    return reply["variables"][name]["version"]


def polls_waiting(url: str) -> int:
    return http_json(f"{url}/v1/cluster")["polls_waiting"]


def until(predicate: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.02)


def waiting_poll(pool, url: str, msg: dict, count: int = 1) -> concurrent.futures.Future:
    """Send ``msg`` as a poll on another thread; return once the shard holds ``count`` polls."""
    before = polls_waiting(url)
    future = pool.submit(post, url, "poll", msg)
    until(lambda: future.done() or polls_waiting(url) >= before + count, "the poll waits")
    assert not future.done(), future.result()
    return future


def still_waiting(url: str, future: concurrent.futures.Future) -> bool:
    http_json(f"{url}/v1/cluster")  # one more round trip: a wrong answer would be here by now
    try:
        future.result(timeout=0.3)
    except concurrent.futures.TimeoutError:
        return True
    return False


# -- newer than --------------------------------------------------------------------------------


def test_the_shard_lists_poll_in_its_features(url):
    assert "poll" in http_json(f"{url}/v1/cluster")["features"]


def test_a_poll_answers_at_a_push_with_only_what_changed(pool, url):
    a, b = fresh("a"), fresh("b")
    init(url, **{a: np.zeros(3, np.float32), b: np.zeros(2, np.float32)})
    future = waiting_poll(pool, url, {"names": [a, b], "versions": {a: 0, b: 0}, "timeout": 25})
    assert push(url, a, np.ones(3, np.float32)) == 1
    status, reply = future.result(timeout=20)
    assert status == 200, reply
    assert reply["ready"] is True
    got = reply["variables"]
    assert got[a]["version"] == 1 and "value" not in got[b] and got[b]["version"] == 0
    np.testing.assert_allclose(wire.decode_tensor(got[a]["value"]), np.full(3, -0.01), rtol=1e-6)


def test_a_poll_that_times_out_answers_not_ready_and_sends_no_value(url):
    a = fresh()
    init(url, **{a: np.zeros(4, np.float32)})
    reply = ok(url, "poll", {"names": [a], "versions": {a: 0}, "timeout": 0.2})
    assert reply == {"ready": False, "variables": {a: {"version": 0}}}


def test_a_poll_for_a_version_not_held_answers_at_once_with_the_value(url):
    a, b = fresh("a"), fresh("b")
    init(url, **{a: np.arange(3, dtype=np.float32), b: np.zeros(1, np.float32)})
    push(url, a, np.zeros(3, np.float32))
    # a: held at an older version; b: not held at all (no entry). Both differ at once.
    reply = ok(url, "poll", {"names": [a, b], "versions": {a: 0}, "timeout": 30})
    assert reply["ready"] is True
    assert reply["variables"][a]["version"] == 1
    np.testing.assert_array_equal(wire.decode_tensor(reply["variables"][a]["value"]), np.arange(3))
    assert "value" in reply["variables"][b]


def test_a_poll_in_the_table_layout_answers_as_a_pull_table(pool, url):
    a, b = fresh("a"), fresh("b")
    init(url, **{a: np.zeros(5, np.float32), b: np.zeros(5, np.float32)})
    msg = {"names": [a, b], "versions": [0, 0], "layout": "table", "timeout": 25}
    enc = wire.encode(msg)

    def send() -> tuple[int, str, Any, bytearray]:
        r = httpx2.post(
            f"{url}/v1/poll",
            content=enc.join(),
            headers={"content-type": enc.content_type, "accept": ACCEPT_FRAME},
            timeout=60.0,
        )
        body = bytearray(r.content)
        return (
            r.status_code,
            r.headers["content-type"],
            wire.unpack(body, r.headers["content-type"]),
            body,
        )

    before = polls_waiting(url)
    future = pool.submit(send)
    until(lambda: future.done() or polls_waiting(url) > before, "the poll waits")
    push(url, b, np.ones(5, np.float32))
    status, ctype, reply, body = future.result(timeout=20)
    assert status == 200 and ctype.startswith(wire.FRAME), reply
    assert reply["ready"] is True
    table = reply["table"]
    assert table["versions"] == [0, 1]
    _, values = wire.table_rows(table, body, names=[a, b])
    assert values[0] is None
    np.testing.assert_allclose(values[1], np.full(5, -0.01), rtol=1e-6)


# -- min version -------------------------------------------------------------------------------


def test_min_version_waits_until_every_named_variable_reached_it(pool, url):
    a, b = fresh("a"), fresh("b")
    init(url, **{a: np.zeros(2, np.float32), b: np.zeros(2, np.float32)})
    future = waiting_poll(pool, url, {"names": [a, b], "min_version": 2, "timeout": 25})
    push(url, a, np.ones(2, np.float32))
    push(url, a, np.ones(2, np.float32))
    push(url, b, np.ones(2, np.float32))
    assert still_waiting(url, future), future.result()  # a reached 2, b only 1
    push(url, b, np.ones(2, np.float32))
    status, reply = future.result(timeout=20)
    assert status == 200, reply
    assert reply["ready"] is True
    assert {n: e["version"] for n, e in reply["variables"].items()} == {a: 2, b: 2}
    for entry in reply["variables"].values():
        np.testing.assert_allclose(wire.decode_tensor(entry["value"]), [-0.02, -0.02], rtol=1e-6)


def test_min_version_already_reached_answers_at_once(url):
    a = fresh()
    init(url, **{a: np.zeros(2, np.float32)})
    push(url, a, np.ones(2, np.float32))
    reply = ok(url, "poll", {"names": [a], "min_version": 1, "versions": {a: 1}, "timeout": 30})
    assert reply == {"ready": True, "variables": {a: {"version": 1}}}  # held: no value travels


def test_min_version_not_reached_by_the_timeout_says_how_far_it_got(url):
    a = fresh()
    init(url, **{a: np.zeros(2, np.float32)})
    push(url, a, np.ones(2, np.float32))
    reply = ok(url, "poll", {"names": [a], "min_version": 5, "timeout": 0.2})
    assert reply["ready"] is False and reply["variables"][a]["version"] == 1


def test_min_version_far_ahead_is_refused_naming_the_field(url):
    a = fresh()
    init(url, **{a: np.zeros(2, np.float32)})
    push(url, a, np.ones(2, np.float32))  # version 1
    err = refused(
        url, {"names": [a], "min_version": 1 + MAX_AHEAD + 1, "timeout": 5}, 400, "bad_request"
    )
    assert err["details"]["field"] == "min_version"
    assert err["details"]["variable"] == a and err["details"]["version"] == 1
    assert err["details"]["limit"] == MAX_AHEAD
    assert "min_version" in err["message"]
    # The bound itself is taken (and, not reached, answered at the timeout).
    reply = ok(url, "poll", {"names": [a], "min_version": 1 + MAX_AHEAD, "timeout": 0})
    assert reply["ready"] is False
    for bad in (-1, 1 << 63, 1.5, "2", True):
        err = refused(url, {"names": [a], "min_version": bad}, 400, "bad_request")
        assert err["details"]["field"] == "min_version"


# -- bad input -------------------------------------------------------------------------------


def test_a_poll_timeout_must_be_0_to_30_seconds(url):
    a = fresh()
    init(url, **{a: np.zeros(1, np.float32)})
    for bad in (30.5, 31, float("inf"), float("nan"), -1, "5", True):
        err = refused(url, {"names": [a], "versions": {a: 0}, "timeout": bad}, 400, "bad_request")
        assert err["details"]["field"] == "timeout"
    assert ok(url, "poll", {"names": [a], "versions": {a: 0}, "timeout": 0})["ready"] is False


def test_a_poll_of_an_unknown_variable_is_404(url):
    a = fresh()
    err = refused(url, {"names": [a], "timeout": 1}, 404, "not_found")
    assert err["details"]["missing"] == [a]


def test_a_poll_with_bad_names_or_versions_is_400(url):
    a = fresh()
    init(url, **{a: np.zeros(1, np.float32)})
    assert refused(url, {"timeout": 1}, 400, "bad_request")["details"]["field"] == "names"
    assert refused(url, {"names": a}, 400, "bad_request")["details"]["field"] == "names"
    err = refused(url, {"names": [a], "versions": {a: -1}}, 400, "bad_request")
    assert err["details"]["field"] == "versions"


# -- admission, shutdown, clients that leave -------------------------------------------------


def test_waiting_polls_take_no_request_slot(fleet_factory):
    """Eight polls wait on a shard that admits two requests at once: a pull still gets in."""
    url = fleet_factory(1, "--max-queued-requests", "2").urls[0]
    a = fresh()
    init(url, **{a: np.zeros(2, np.float32)})
    before = polls_waiting(url)
    with concurrent.futures.ThreadPoolExecutor(8) as many:
        futures = [
            many.submit(post, url, "poll", {"names": [a], "versions": {a: 0}, "timeout": 25})
            for _ in range(8)
        ]
        until(lambda: polls_waiting(url) >= before + 8, "8 polls wait")
        reply = ok(url, "pull", {"names": [a]})
        assert reply["variables"][a]["version"] == 0
        push(url, a, np.ones(2, np.float32))
        for future in futures:
            status, reply = future.result(timeout=20)
            assert status == 200 and reply["ready"] is True, reply
    assert polls_waiting(url) == 0


def test_a_shard_shutting_down_answers_its_waiting_polls(fleet_factory, pool):
    fleet = fleet_factory(1)
    url = fleet.urls[0]
    a = fresh()
    init(url, **{a: np.zeros(2, np.float32)})
    future = waiting_poll(pool, url, {"names": [a], "versions": {a: 0}, "timeout": 30})
    assert fleet.stop(0, signal.SIGTERM, grace=20) == 0
    status, reply = future.result(timeout=5)
    assert status == 200 and reply == {"ready": False, "variables": {a: {"version": 0}}}


@pytest.mark.parametrize("mode", HTTP_MODES)
def test_a_poll_whose_client_went_away_ends_on_the_shard(fleet_factory, mode):
    env = {"PARAMSHARD_HTTP": "stock" if mode == "stock" else "auto"}
    url = fleet_factory(1, env=env).urls[0]
    a = fresh()
    init(url, **{a: np.zeros(2, np.float32)})
    enc = wire.encode({"names": [a], "versions": {a: 0}, "timeout": 30})
    body = enc.join()
    host, port = url.removeprefix("http://").split(":")
    before = polls_waiting(url)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/poll HTTP/1.1\r\nHost: {host}\r\nContent-Type: {enc.content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + bytes(body)
        )
        until(lambda: polls_waiting(url) > before, "the poll waits")
    # The connection is closed: the shard stops waiting for it long before its 30 s.
    until(lambda: polls_waiting(url) == before, "the poll ends with its connection", 15.0)
