"""Training modes on a real shard: sync rounds and bounded staleness (docs/PROTOCOL.md §3,
"Training modes"), over real HTTP.

Each test states one rule of the page and checks it with bodies made by ``client_sdk.wire``
(the fields a client in another language sends) or through the SDK where the point is what a
worker sees. Values are float64 and gradients small integers, so every expected value is
exact. The shard is one process (a fleet of one owns every name); the restart test starts its
own with a data dir.
"""

from __future__ import annotations

from typing import Any

import httpx2
import numpy as np
import pytest

from client_sdk import BadRequestError, PSClient, wire
from client_sdk.modes import ModeError, Sync
from client_sdk.optimizers import SGD, Add
from client_sdk.placement import shard_for
from tests.conftest import Fleet
from tests.helpers.eventually import eventually
from tests.helpers.names import fresh
from tests.helpers.reshard import reshard


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    fleet = Fleet(1, tmp_path_factory.mktemp("modes"))
    yield fleet.urls[0]
    fleet.close()


@pytest.fixture(scope="module")
def http():
    with httpx2.Client(timeout=30.0) as client:
        yield client


def post(http, url: str, verb: str, msg: Any) -> tuple[int, Any]:
    enc = wire.encode(msg, frame=False)
    r = http.post(
        f"{url}/v1/{verb}", content=enc.join(), headers={"content-type": enc.content_type}
    )
    return r.status_code, wire.unpack(bytearray(r.content), r.headers.get("content-type", ""))


def ok(http, url: str, verb: str, msg: Any) -> Any:
    status, reply = post(http, url, verb, msg)
    assert status == 200, reply
    return reply


def refused(http, url: str, verb: str, msg: Any, status: int, code: str) -> dict:
    got, reply = post(http, url, verb, msg)
    assert (got, reply["error"]["code"]) == (status, code), reply
    return reply["error"]


def state(http, url: str, name: str) -> dict:
    r = http.get(f"{url}/v1/variables/{name}", params={"values": "true"})
    assert r.status_code == 200, r.text
    return r.json()


def exists(http, url: str, name: str) -> bool:
    return http.get(f"{url}/v1/variables/{name}").status_code == 200


def init(http, url: str, name: str, value: Any, optimizer: dict | None = None, **mode: Any):
    entry: dict[str, Any] = {"value": np.asarray(value, np.float64), **mode}
    if optimizer is not None:
        entry["optimizer"] = optimizer
    assert ok(http, url, "init", {"variables": {name: entry}})["variables"][name]["created"]


def push(http, url: str, worker: str, seq: int, grads: dict, versions: dict | None = None):
    msg: dict[str, Any] = {
        "worker_id": worker,
        "seq": seq,
        "grads": {n: np.asarray(g, np.float64) for n, g in grads.items()},
    }
    if versions is not None:
        msg["versions"] = versions
    return ok(http, url, "push", msg)["variables"]


HALF = {"type": "sgd", "lr": 0.5}  # w -= g / 2: exact in float64 for small integers


def sync(replicas: int, timeout: float = 60.0) -> dict:
    return {"sync": {"replicas": replicas, "timeout": timeout}}


# -- sync rounds ------------------------------------------------------------------------------


def test_a_round_applies_the_mean_once_when_it_fills(http, url):
    name = fresh()
    init(http, url, name, [8.0, 8.0], HALF, **sync(3))
    results = [
        push(http, url, fresh("w"), 1, {name: g}, {name: 0})[name]
        for g in ([2.0, 0.0], [4.0, 6.0], [6.0, 0.0])
    ]
    assert [r["status"] for r in results] == ["accepted", "accepted", "applied"]
    assert [r["version"] for r in results] == [0, 0, 1]
    assert [r["staleness"] for r in results] == [0, 0, 0]
    s = state(http, url, name)
    assert s["values"] == [8.0 - 4.0 / 2, 8.0 - 2.0 / 2]  # the mean, [4, 2], once
    assert (s["version"], s["updates"]) == (1, 1)
    assert s["mode"] == "sync" and s["sync"] == {"replicas": 3, "timeout": 60.0}
    assert s["round"] is None
    assert s["rounds"]["filled"] == 1 and s["rounds"]["timed_out"] == 0
    assert s["rounds"]["last"]["contributors"] == 3
    assert s["rounds"]["last"]["closed"] == "filled"
    assert s["counts"]["applied"] == 3


def test_an_open_round_shows_its_contributors(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, **sync(2))
    push(http, url, fresh("w"), 1, {name: [1.0]}, {name: 0})
    s = state(http, url, name)
    assert s["round"]["version"] == 0 and s["round"]["contributors"] == 1
    assert s["round"]["age"] >= 0
    assert s["values"] == [0.0] and s["version"] == 0
    assert s["counts"]["accepted"] == 1


def test_a_gradient_on_a_closed_round_is_dropped_as_stale(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, **sync(1))
    assert push(http, url, fresh("w"), 1, {name: [2.0]}, {name: 0})[name]["status"] == "applied"
    late = push(http, url, fresh("w"), 1, {name: [100.0]}, {name: 0})[name]
    assert late["status"] == "dropped" and late["reason"] == "stale"
    assert late["version"] == 1 and late["staleness"] == 1
    assert isinstance(late["message"], str) and late["message"]
    s = state(http, url, name)
    assert s["values"] == [-1.0] and s["version"] == 1
    assert s["counts"]["dropped"] == 1


def test_replicas_fewer_than_workers_drop_the_slowest(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, **sync(2))
    statuses = [
        push(http, url, fresh("w"), 1, {name: [g]}, {name: 0})[name]["status"]
        for g in (2.0, 4.0, 1000.0)
    ]
    assert statuses == ["accepted", "applied", "dropped"]
    assert state(http, url, name)["values"] == [-1.5]


def test_a_workers_second_gradient_in_one_round_is_dropped(http, url):
    name, worker = fresh(), fresh("w")
    init(http, url, name, [0.0], HALF, **sync(2))
    assert push(http, url, worker, 1, {name: [2.0]}, {name: 0})[name]["status"] == "accepted"
    again = push(http, url, worker, 2, {name: [2.0]}, {name: 0})[name]
    assert again["status"] == "dropped" and again["reason"] == "repeat"
    s = state(http, url, name)
    assert s["round"]["contributors"] == 1 and s["version"] == 0


def test_a_retried_push_joins_its_round_once(http, url):
    name, worker = fresh(), fresh("w")
    init(http, url, name, [0.0], HALF, **sync(2))
    assert push(http, url, worker, 7, {name: [2.0]}, {name: 0})[name]["status"] == "accepted"
    assert push(http, url, worker, 7, {name: [2.0]}, {name: 0})[name]["status"] == "duplicate"
    assert state(http, url, name)["round"]["contributors"] == 1
    assert push(http, url, fresh("w"), 1, {name: [4.0]}, {name: 0})[name]["status"] == "applied"
    assert state(http, url, name)["values"] == [-1.5]


def test_a_round_that_does_not_fill_applies_what_it_has_at_its_timeout(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, **sync(3, timeout=0.3))
    push(http, url, fresh("w"), 1, {name: [2.0]}, {name: 0})
    push(http, url, fresh("w"), 1, {name: [4.0]}, {name: 0})
    s = eventually(
        lambda: (s := state(http, url, name))["version"] == 1 and s, "the round timed out"
    )
    assert s["values"] == [-1.5]  # the mean of the two it had
    assert s["rounds"]["timed_out"] == 1 and s["rounds"]["filled"] == 0
    assert s["rounds"]["last"] == {**s["rounds"]["last"], "contributors": 2, "closed": "timed_out"}
    # the next round starts afresh on version 1
    assert push(http, url, fresh("w"), 1, {name: [2.0]}, {name: 1})[name]["status"] == "accepted"


def test_a_push_to_a_sync_variable_must_say_its_version(http, url):
    name, other = fresh(), fresh()
    init(http, url, name, [0.0], HALF, **sync(2))
    init(http, url, other, [0.0], HALF)
    grads = {"worker_id": fresh("w"), "seq": 1, "grads": {name: np.ones(1), other: np.ones(1)}}
    err = refused(http, url, "push", grads, 400, "bad_request")
    assert err["details"]["field"] == "versions" and err["details"]["variable"] == name
    err = refused(http, url, "push", {**grads, "versions": {name: 1}}, 400, "bad_request")
    assert err["details"]["field"] == "versions" and err["details"]["version"] == 0
    for n in (name, other):  # nothing applied, no round opened
        s = state(http, url, n)
        assert s["version"] == 0 and s["values"] == [0.0]
    assert state(http, url, name)["round"] is None


def test_an_assign_discards_the_open_round(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, **sync(2))
    push(http, url, fresh("w"), 1, {name: [2.0]}, {name: 0})
    ok(http, url, "assign", {"values": {name: np.array([10.0])}})
    s = state(http, url, name)
    assert s["round"] is None and s["rounds"]["discarded"] == 1
    assert s["values"] == [10.0] and s["version"] == 1
    assert push(http, url, fresh("w"), 1, {name: [2.0]}, {name: 1})[name]["status"] == "accepted"


def test_an_increment_of_a_sync_scalar_discards_the_open_round(http, url):
    name = fresh()
    init(http, url, name, 0.0, HALF, **sync(2, timeout=0.2))
    push(http, url, fresh("w"), 1, {name: 2.0}, {name: 0})
    assert ok(http, url, "increment", {"name": name, "delta": 1.0})["version"] == 1
    s = state(http, url, name)
    assert s["round"] is None and s["rounds"]["discarded"] == 1
    assert (s["values"], s["version"]) == (1.0, 1)
    assert push(http, url, fresh("w"), 1, {name: 2.0}, {name: 1})[name]["status"] == "accepted"


def test_an_open_round_survives_a_restart(fleet_factory):
    fleet = fleet_factory(1, data=True)
    url, name, first = fleet.urls[0], fresh(), fresh("w")
    with httpx2.Client(timeout=30.0) as http:
        init(http, url, name, [0.0], HALF, **sync(2, timeout=600))
        assert push(http, url, first, 5, {name: [2.0]}, {name: 0})[name]["status"] == "accepted"
    fleet.stop(0)
    fleet.start(0)
    with httpx2.Client(timeout=30.0) as http:
        s = state(http, url, name)
        assert s["round"]["contributors"] == 1 and s["version"] == 0
        # its retry is still recognised, and the round goes on from where it was
        assert push(http, url, first, 5, {name: [2.0]}, {name: 0})[name]["status"] == "duplicate"
        assert push(http, url, fresh("w"), 1, {name: [4.0]}, {name: 0})[name]["status"] == "applied"
        s = state(http, url, name)
        assert s["values"] == [-1.5] and s["version"] == 1 and s["rounds"]["filled"] == 1


def test_a_round_due_while_the_shard_is_paused_closes_when_the_pause_ends(fleet_factory):
    fleet = fleet_factory(1, data=True)
    url, name = fleet.urls[0], fresh()
    with httpx2.Client(timeout=30.0) as http:
        init(http, url, name, [0.0], HALF, **sync(2, timeout=0.2))
        push(http, url, fresh("w"), 1, {name: [2.0]}, {name: 0})
        ok(http, url, "pause", {"checkpoint": "rounds", "lease": 60})
        s = eventually(
            lambda: (s := state(http, url, name))["round"]["age"] > 0.5 and s,
            "the round is past its timeout",
        )
        assert s["version"] == 0  # a paused shard changes nothing
        ok(http, url, "resume", {"checkpoint": "rounds"})
        s = eventually(
            lambda: (s := state(http, url, name))["version"] == 1 and s, "the round closed"
        )
        assert s["values"] == [-1.0] and s["rounds"]["timed_out"] == 1


def test_an_init_stating_another_mode_for_an_existing_variable_is_a_conflict(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, **sync(2))
    for mode in ({"max_staleness": 3}, sync(3), sync(2, timeout=5.0)):
        entry = {"value": np.zeros(1), **mode}
        err = refused(http, url, "init", {"variables": {name: entry}}, 409, "conflict")
        assert name in err["details"]["conflicts"]
        assert err["details"]["field"] == next(iter(mode))
    same = ok(http, url, "init", {"variables": {name: {"value": np.zeros(1), **sync(2)}}})
    assert same["variables"][name]["created"] is False
    unstated = ok(http, url, "init", {"variables": {name: {"value": np.zeros(1)}}})
    assert unstated["variables"][name]["created"] is False
    assert state(http, url, name)["sync"] == {"replicas": 2, "timeout": 60.0}


def test_an_open_round_moves_with_its_variable_in_a_reshard(fleet_factory, tmp_path):
    fleet = fleet_factory(1, "--snapshot-interval", "0", data=True)
    names = [f"rounds/v{i}" for i in range(4)]  # on both shards of 2
    assert {shard_for(n, 2) for n in names} == {0, 1}
    with httpx2.Client(timeout=30.0) as http:
        for n in names:
            init(http, fleet.urls[0], n, [0.0, 0.0], HALF, **sync(2, timeout=600))
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps:
        ps.pull(names)
        assert {r["status"] for r in ps.push({n: np.full(2, 2.0) for n in names}).values()} == {
            "accepted"
        }
        ckpt = ps.checkpoint()
    fleet.stop(0)
    _, dirs = reshard(fleet.data_dirs, tmp_path / "two", 2, "--checkpoint", ckpt)
    two = fleet_factory(2, data_dirs=dirs)
    with httpx2.Client(timeout=30.0) as http:
        for n in names:
            url = two.urls[shard_for(n, 2)]
            assert state(http, url, n)["round"]["contributors"] == 1
            assert push(http, url, fresh("w"), 1, {n: [4.0, 4.0]}, {n: 0})[n]["status"] == "applied"
            assert state(http, url, n)["values"] == [-1.5, -1.5]


# -- bounded staleness ------------------------------------------------------------------------


def test_a_gradient_staler_than_max_staleness_is_dropped(http, url):
    name, slow, fast = fresh(), fresh("w"), fresh("w")
    init(http, url, name, [0.0], {"type": "add"}, max_staleness=1)
    assert push(http, url, fast, 1, {name: [1.0]}, {name: 0})[name]["status"] == "applied"
    assert push(http, url, fast, 2, {name: [1.0]}, {name: 1})[name]["status"] == "applied"
    stale = push(http, url, slow, 1, {name: [100.0]}, {name: 0})[name]
    assert stale["status"] == "dropped" and stale["reason"] == "stale"
    assert (stale["staleness"], stale["max_staleness"], stale["version"]) == (2, 1, 2)
    within = push(http, url, slow, 2, {name: [10.0]}, {name: 1})[name]
    assert within == {"status": "applied", "version": 3, "staleness": 1}
    s = state(http, url, name)
    assert s["values"] == [12.0]
    assert s["mode"] == "bounded"
    assert (s["max_staleness"], s["staleness_policy"]) == (1, "drop")
    assert s["counts"]["applied"] == 3 and s["counts"]["dropped"] == 1


def test_the_scale_policy_scales_a_stale_step(http, url):
    add, sgd, worker = fresh(), fresh(), fresh("w")
    init(http, url, add, [0.0], {"type": "add"}, max_staleness=0, staleness_policy="scale")
    init(http, url, sgd, [0.0], HALF, max_staleness=0, staleness_policy="scale")
    push(http, url, worker, 1, {add: [1.0], sgd: [1.0]}, {add: 0, sgd: 0})
    push(http, url, worker, 2, {add: [1.0], sgd: [1.0]}, {add: 1, sgd: 1})
    got = push(http, url, worker, 3, {add: [6.0], sgd: [6.0]}, {add: 0, sgd: 0})
    for n in (add, sgd):
        assert got[n]["status"] == "applied" and got[n]["staleness"] == 2
        assert got[n]["scale"] == pytest.approx(1 / 3)
    assert state(http, url, add)["values"] == [2.0 + 6.0 / 3]
    assert state(http, url, sgd)["values"] == [-1.0 - 0.5 * 6.0 / 3]
    assert state(http, url, add)["counts"]["scaled"] == 1


def test_a_bounded_variable_needs_the_version_too(http, url):
    name = fresh()
    init(http, url, name, [0.0], HALF, max_staleness=3)
    msg = {"worker_id": fresh("w"), "seq": 1, "grads": {name: np.ones(1)}}
    assert refused(http, url, "push", msg, 400, "bad_request")["details"]["field"] == "versions"
    msg["versions"] = {name: 5}
    assert refused(http, url, "push", msg, 400, "bad_request")["details"]["field"] == "versions"
    assert state(http, url, name)["version"] == 0


def test_a_push_answers_each_variable_by_its_mode(http, url):
    plain, bounded, rounds, worker = fresh(), fresh(), fresh(), fresh("w")
    init(http, url, plain, [0.0], HALF)
    init(http, url, bounded, [0.0], HALF, max_staleness=0)
    init(http, url, rounds, [0.0], HALF, **sync(2))
    ok(http, url, "assign", {"values": {bounded: np.zeros(1), rounds: np.zeros(1)}})  # version 1
    got = push(
        http,
        url,
        worker,
        1,
        {plain: [2.0], bounded: [2.0], rounds: [2.0]},
        {plain: 0, bounded: 0, rounds: 1},
    )
    assert got[plain] == {"status": "applied", "version": 1, "staleness": 0}
    assert got[bounded]["status"] == "dropped" and got[bounded]["staleness"] == 1
    assert got[rounds]["status"] == "accepted"


def test_counts_and_staleness_percentiles_per_variable_and_worker(http, url):
    name, worker = fresh(), fresh("w")
    init(http, url, name, [0.0], {"type": "add"}, max_staleness=2)
    for seq in range(5):  # staleness 0 each time
        push(http, url, worker, seq, {name: [1.0]}, {name: seq})
    push(http, url, worker, 10, {name: [1.0]}, {name: 3})  # staleness 2: applied
    push(http, url, worker, 11, {name: [1.0]}, {name: 0})  # staleness 6: dropped
    push(http, url, worker, 11, {name: [1.0]}, {name: 0})  # a retry: duplicate
    s = state(http, url, name)
    assert s["counts"] == {"applied": 6, "accepted": 0, "dropped": 1, "scaled": 0, "duplicate": 1}
    assert s["staleness"] == {"p50": 0, "p99": 6, "samples": 7}
    workers = {w["worker_id"]: w for w in http.get(f"{url}/v1/workers").json()["workers"]}
    mine = workers[worker]
    assert mine["gradients"] == {"applied": 6, "accepted": 0, "dropped": 1, "scaled": 0}
    assert mine["staleness"] == {"p50": 0, "p99": 6, "samples": 7}


def test_the_window_of_staleness_is_the_latest_128(http, url):
    name, worker = fresh(), fresh("w")
    init(http, url, name, [0.0], {"type": "add"}, max_staleness=1_000)
    for seq in range(200):
        push(http, url, worker, seq, {name: [0.0]}, {name: 0})  # staleness: seq
    # staleness 0, 1, ..., 199; the latest 128 are 72..199, their nearest-rank percentiles
    # the 64th and the 127th of them
    assert state(http, url, name)["staleness"] == {"p50": 135, "p99": 198, "samples": 128}


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "field"),
    [
        ({"sync": {"replicas": 0}}, "sync.replicas"),
        ({"sync": {"replicas": -1}}, "sync.replicas"),
        ({"sync": {"replicas": 1.5}}, "sync.replicas"),
        ({"sync": {"replicas": True}}, "sync.replicas"),
        ({"sync": {"replicas": 10_001}}, "sync.replicas"),
        ({"sync": {"timeout": 5.0}}, "sync.replicas"),
        ({"sync": {"replicas": 2, "timeout": 0}}, "sync.timeout"),
        ({"sync": {"replicas": 2, "timeout": -1.0}}, "sync.timeout"),
        ({"sync": {"replicas": 2, "timeout": 1e9}}, "sync.timeout"),
        ({"sync": {"replicas": 2, "timeout": float("nan")}}, "sync.timeout"),
        ({"sync": {"replicas": 2, "timeout": "soon"}}, "sync.timeout"),
        ({"sync": {"replicas": 2, "wait": 1}}, "sync"),
        ({"sync": 4}, "sync"),
        ({"sync": {"replicas": 2}, "max_staleness": 3}, "sync"),
        ({"sync": {"replicas": 2}, "staleness_policy": "drop"}, "staleness_policy"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 2.5}, "max_staleness"),
        ({"max_staleness": 1_000_001}, "max_staleness"),
        ({"max_staleness": 3, "staleness_policy": "ignore"}, "staleness_policy"),
        ({"staleness_policy": "scale"}, "staleness_policy"),
    ],
)
def test_bad_mode_settings_are_refused_naming_the_field(http, url, mode, field):
    good, bad = fresh(), fresh()
    msg = {"variables": {good: {"value": np.zeros(2)}, bad: {"value": np.zeros(2), **mode}}}
    err = refused(http, url, "init", msg, 400, "bad_request")
    assert err["details"]["field"] == field and err["details"]["variable"] == bad
    assert not exists(http, url, good) and not exists(http, url, bad)


def test_the_sdk_refuses_bad_modes_before_sending(url):
    with pytest.raises(ModeError) as caught:
        Sync(replicas=0)
    assert caught.value.field == "sync.replicas" and isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match="timeout"):
        Sync(replicas=2, timeout=0)
    name = fresh()
    with PSClient([url], worker_id=fresh("w")) as ps:
        with pytest.raises(BadRequestError, match="max_staleness"):
            ps.init({name: np.zeros(2)}, max_staleness=-1)
        with pytest.raises(BadRequestError, match="sync"):
            ps.init({name: np.zeros(2)}, sync=Sync(2), max_staleness=1)
        with pytest.raises(BadRequestError, match="staleness_policy"):
            ps.init({name: np.zeros(2)}, max_staleness=1, staleness_policy="later")
        assert name not in {v["name"] for v in ps.variables()}


# -- through the SDK ---------------------------------------------------------------------------


def test_the_sdk_inits_modes_and_returns_each_gradients_fate(url):
    rounds, bounded = fresh(), fresh()
    with PSClient([url], worker_id=fresh("w")) as a, PSClient([url], worker_id=fresh("w")) as b:
        a.init({rounds: np.zeros(2)}, optimizer=SGD(lr=0.5), sync=Sync(replicas=2, timeout=30))
        a.init({bounded: np.zeros(2)}, optimizer=Add(), max_staleness=0)
        for ps in (a, b):
            ps.pull([rounds, bounded])
        first = a.push({rounds: np.ones(2), bounded: np.ones(2)})
        assert first[rounds]["status"] == "accepted" and first[bounded]["status"] == "applied"
        second = b.push({rounds: np.ones(2) * 3, bounded: np.ones(2)})  # b pulled version 0
        assert second[rounds]["status"] == "applied" and second[rounds]["version"] == 1
        assert second[bounded]["status"] == "dropped" and second[bounded]["reason"] == "stale"
        np.testing.assert_array_equal(a.pull([rounds])[rounds], [-1.0, -1.0])
        shown = {v["name"]: v for v in a.variables()}
        assert shown[rounds]["sync"] == {"replicas": 2, "timeout": 30.0}
        assert shown[bounded]["max_staleness"] == 0
