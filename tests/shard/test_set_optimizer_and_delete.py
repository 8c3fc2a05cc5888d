"""``set_optimizer``, ``delete`` and ``init``'s optimizer conflict on one shard, over raw HTTP
(docs/PROTOCOL.md §3): what each reply says, what ``GET /v1/variables/{name}`` then shows, a
retry answered ``duplicate``, a restart on the data dir, and bad input refused naming the
field with nothing changed. The same verbs through the SDK, across shards, are in
tests/e2e/test_set_optimizer.py and tests/e2e/test_delete.py.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx2
import numpy as np
import pytest

from client_sdk import PSClient, UnknownVariableError, wire
from client_sdk.placement import shard_for
from tests.conftest import Fleet
from tests.helpers.names import fresh

W0 = np.arange(4, dtype=np.float64)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    fleet = Fleet(1, tmp_path_factory.mktemp("set-optimizer-delete"))
    yield fleet.urls[0]
    fleet.close()


def post(url: str, verb: str, msg: dict[str, Any]) -> tuple[int, Any]:
    enc = wire.encode(msg, frame=False)
    r = httpx2.post(
        f"{url}/v1/{verb}",
        content=enc.join(),
        headers={"content-type": enc.content_type},
        timeout=30.0,
    )
    return r.status_code, wire.unpack(bytearray(r.content), r.headers.get("content-type", ""))


def ok(url: str, verb: str, msg: dict[str, Any]) -> Any:
    status, reply = post(url, verb, msg)
    assert status == 200, reply
    return reply


def refused(url: str, verb: str, msg: dict[str, Any], status: int, code: str) -> dict[str, Any]:
    got, reply = post(url, verb, msg)
    assert (got, reply["error"]["code"]) == (status, code), reply
    return reply["error"]


def shown(url: str, name: str) -> dict[str, Any]:
    r = httpx2.get(f"{url}/v1/variables/{name}", timeout=30.0)
    assert r.status_code == 200, r.text
    return r.json()


def names_held(url: str) -> set[str]:
    return {v["name"] for v in httpx2.get(f"{url}/v1/variables").json()["variables"]}


def init(url: str, values: dict[str, np.ndarray], optimizer: dict | None = None) -> Any:
    entries = {
        n: {"value": v} | ({} if optimizer is None else {"optimizer": optimizer})
        for n, v in values.items()
    }
    return ok(url, "init", {"variables": entries})


def writer() -> dict[str, Any]:
    """A fresh worker's first write: ``worker_id`` and ``seq``."""
    return {"worker_id": fresh("raw"), "seq": 1}


SGD = {"type": "sgd", "lr": 0.1}


# -- set_optimizer -----------------------------------------------------------------------------


def test_a_change_is_versioned_and_shown_and_the_value_is_untouched(url):
    name = fresh()
    init(url, {name: W0}, SGD)
    ok(url, "push", {"grads": {name: np.ones(4)}, **writer()})

    reply = ok(
        url, "set_optimizer", {"names": [name], "optimizer": {"type": "sgd", "lr": 0.5}, **writer()}
    )

    entry = reply["variables"][name]
    assert entry["status"] == "applied"
    assert entry["slots"] == "kept"
    assert (entry["version"], entry["optimizer_version"], entry["frozen"]) == (1, 1, False)
    assert entry["optimizer"]["type"] == "sgd" and entry["optimizer"]["lr"] == 0.5
    seen = shown(url, name)
    assert (seen["version"], seen["optimizer_version"], seen["frozen"]) == (1, 1, False)
    assert seen["optimizer"] == entry["optimizer"]
    np.testing.assert_allclose(seen["mean"], (W0 - 0.1).mean())
    listed = {v["name"]: v for v in httpx2.get(f"{url}/v1/variables").json()["variables"]}
    assert listed[name]["optimizer_version"] == 1 and listed[name]["frozen"] is False

    other_type = {"type": "adagrad", "lr": 0.1}
    entry = ok(url, "set_optimizer", {"names": [name], "optimizer": other_type, **writer()})
    assert entry["variables"][name]["slots"] == "reset"
    assert entry["variables"][name]["optimizer_version"] == 2
    again = ok(url, "set_optimizer", {"names": [name], "optimizer": other_type, **writer()})
    assert again["variables"][name]["optimizer_version"] == 2  # nothing changed


def test_frozen_refuses_pushes_whole_and_assign_still_writes(url):
    frozen, other = fresh("frozen"), fresh("other")
    init(url, {frozen: W0, other: W0}, SGD)
    reply = ok(url, "set_optimizer", {"names": [frozen], "frozen": True, **writer()})
    assert reply["variables"][frozen]["frozen"] is True
    assert reply["variables"][frozen]["optimizer"]["lr"] == 0.1

    grads = {frozen: np.ones(4), other: np.ones(4)}
    error = refused(url, "push", {"grads": grads, **writer()}, 409, "frozen")
    assert error["details"]["frozen"] == [frozen]
    assert "frozen=False" in error["message"]
    assert shown(url, frozen)["version"] == 0 and shown(url, other)["version"] == 0

    ok(url, "assign", {"values": {frozen: W0 + 1}, **writer()})
    assert shown(url, frozen)["version"] == 1

    ok(url, "set_optimizer", {"names": [frozen], "frozen": False, **writer()})
    ok(url, "push", {"grads": grads, **writer()})
    assert shown(url, frozen)["version"] == 2
    assert shown(url, frozen)["optimizer_version"] == 2


def test_a_retry_of_an_applied_push_is_a_duplicate_even_once_frozen(url):
    name = fresh()
    init(url, {name: W0}, SGD)
    push = {"grads": {name: np.ones(4)}, **writer()}
    ok(url, "push", push)
    ok(url, "set_optimizer", {"names": [name], "frozen": True, **writer()})
    assert ok(url, "push", push)["variables"][name]["status"] == "duplicate"


def test_a_prefix_matches_tensors_not_counters(url):
    run = fresh("run")
    init(url, {f"{run}/a": W0, f"{run}/b": W0, fresh("run") + "/a": W0}, SGD)
    ok(url, "increment", {"name": f"{run}/step", **writer()})
    reply = ok(url, "set_optimizer", {"prefix": f"{run}/", "frozen": True, **writer()})
    assert sorted(reply["variables"]) == [f"{run}/a", f"{run}/b"]
    assert ok(url, "set_optimizer", {"prefix": fresh("none"), "frozen": True, **writer()}) == {
        "variables": {}
    }


def test_a_prefix_past_the_names_limit_is_413_and_changes_nothing(fleet_factory):
    fleet = fleet_factory(1, "--max-request-names", "6")  # a request's own map holds 4 fields
    url, run = fleet.urls[0], fresh("big")
    init(url, {f"{run}/{i}": W0 for i in range(4)}, SGD)
    init(url, {f"{run}/{i}": W0 for i in range(4, 7)}, SGD)
    error = refused(
        url, "set_optimizer", {"prefix": f"{run}/", "frozen": True, **writer()}, 413, "too_large"
    )
    assert (error["details"]["limit"], error["details"]["matched"]) == (6, 7), error
    error = refused(url, "delete", {"prefix": f"{run}/", **writer()}, 413, "too_large")
    assert names_held(url) == {f"{run}/{i}" for i in range(7)}
    assert not any(shown(url, f"{run}/{i}")["frozen"] for i in range(7))


def test_a_retried_set_optimizer_is_a_duplicate_and_changes_nothing(url):
    name = fresh()
    init(url, {name: W0}, SGD)
    first = {"names": [name], "optimizer": {"type": "sgd", "lr": 0.2}, **writer()}
    ok(url, "set_optimizer", first)
    second = {"names": [name], "optimizer": {"type": "sgd", "lr": 0.3}}
    ok(url, "set_optimizer", {**second, "worker_id": first["worker_id"], "seq": 2})

    entry = ok(url, "set_optimizer", first)["variables"][name]

    assert (entry["status"], entry["slots"], entry["optimizer_version"]) == ("duplicate", None, 2)
    assert entry["optimizer"]["lr"] == 0.3
    assert shown(url, name)["optimizer"]["lr"] == 0.3


def test_init_stating_another_optimizer_is_409_naming_set_optimizer(url):
    name, new = fresh(), fresh("new")
    init(url, {name: W0}, SGD)
    msg = {
        "variables": {
            new: {"value": W0},
            name: {"value": W0, "optimizer": {"type": "sgd", "lr": 0.2}},
        }
    }
    error = refused(url, "init", msg, 409, "conflict")
    assert error["details"]["field"] == "optimizer"
    assert "set_optimizer" in error["message"]
    conflict = error["details"]["conflicts"][name]
    assert conflict["existing"]["optimizer"]["lr"] == 0.1
    assert conflict["existing"]["optimizer_version"] == 0
    assert conflict["requested"]["optimizer"]["lr"] == 0.2
    assert new not in names_held(url)
    # The same spec (its defaults spelt out or not), or none: the existing variable.
    assert init(url, {name: W0}, SGD)["variables"][name]["created"] is False
    assert init(url, {name: W0})["variables"][name]["created"] is False


BAD_SET_OPTIMIZER = [
    ({"frozn": True}, "frozn"),
    ({"optimizer": SGD, "prefix": "x"}, "prefix"),
    ({"optimizer": {"type": "nadam"}}, "optimizer"),
    ({"optimizer": {"type": "sgd", "learning_rate": 0.1}}, "optimizer"),
    ({"optimizer": {"type": "sgd", "lr": -0.1}}, "optimizer"),
    ({"optimizer": {"type": "sgd", "lr": float("nan")}}, "optimizer"),
    ({"optimizer": "sgd"}, "optimizer"),
    ({"frozen": "yes"}, "frozen"),
    ({"frozen": 1}, "frozen"),
    ({}, "optimizer"),  # nothing to change
    ({"frozen": True, "seq": -1}, "seq"),
    ({"frozen": True, "worker_id": ""}, "worker_id"),
]


@pytest.mark.parametrize(("fields", "field"), BAD_SET_OPTIMIZER)
def test_bad_set_optimizer_is_400_naming_the_field_and_changes_nothing(url, fields, field):
    name = fresh()
    init(url, {name: W0}, SGD)
    before = shown(url, name)

    error = refused(
        url, "set_optimizer", {"names": [name], **writer(), **fields}, 400, "bad_request"
    )

    got = error["details"]["field"]
    assert got == field or got.startswith(f"{field}."), error  # optimizer.lr: the spec's field
    after = shown(url, name)
    keys = ("optimizer", "optimizer_version", "frozen", "version")
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}


BAD_TARGETS = [
    ({"prefix": ""}, "prefix"),
    ({"prefix": 7}, "prefix"),
    ({"prefix": ["a"]}, "prefix"),
    ({"prefix": "no spaces"}, "prefix"),
    ({"prefix": "p" * 257}, "prefix"),
    ({"prefix": None}, "names"),  # nil is absent: neither names nor a prefix
    ({}, "names"),
    ({"names": "w"}, "names"),
    ({"names": [1, 2]}, "names"),
]


@pytest.mark.parametrize("verb", ["set_optimizer", "delete"])
@pytest.mark.parametrize(("target", "field"), BAD_TARGETS)
def test_bad_names_or_prefix_are_400_naming_the_field(url, verb, target, field):
    name = fresh()
    init(url, {name: W0}, SGD)
    change = {"frozen": True} if verb == "set_optimizer" else {}
    error = refused(url, verb, {**target, **change, **writer()}, 400, "bad_request")
    assert error["details"]["field"] == field, error
    assert name in names_held(url) and shown(url, name)["frozen"] is False


def test_a_counter_or_an_unknown_name_refuses_the_whole_set_optimizer(url):
    counter, name = fresh("counter"), fresh()
    ok(url, "increment", {"name": counter, **writer()})
    init(url, {name: W0}, SGD)
    error = refused(
        url,
        "set_optimizer",
        {"names": [counter, name], "frozen": True, **writer()},
        409,
        "conflict",
    )
    assert error["details"]["kind"] == "counter"
    missing = fresh("missing")
    error = refused(
        url,
        "set_optimizer",
        {"names": [name, missing], "frozen": True, **writer()},
        404,
        "not_found",
    )
    assert error["details"]["missing"] == [missing]
    assert shown(url, name)["frozen"] is False


# -- delete ------------------------------------------------------------------------------------


def test_delete_removes_what_is_there_and_is_a_duplicate_when_retried(url):
    name, run = fresh(), fresh("run")
    init(url, {name: W0, f"{run}/a": W0}, SGD)
    ok(url, "increment", {"name": f"{run}/step", **writer()})
    before = int(httpx2.get(f"{url}/v1/cluster").json()["state_version"])
    ok(url, "push", {"grads": {name: np.ones(4)}, **writer()})

    request = {"names": [name, fresh("never")], **writer()}
    assert ok(url, "delete", request) == {"status": "applied", "deleted": [name]}
    assert int(httpx2.get(f"{url}/v1/cluster").json()["state_version"]) == before
    refused(url, "pull", {"names": [name]}, 404, "not_found")
    assert ok(url, "delete", {"prefix": f"{run}/", **writer()}) == {
        "status": "applied",
        "deleted": [f"{run}/a", f"{run}/step"],
    }

    init(url, {name: np.zeros(2, np.float32)})  # made again, afresh
    assert ok(url, "delete", request) == {"status": "duplicate", "deleted": []}
    assert shown(url, name)["version"] == 0 and shown(url, name)["shape"] == [2]
    assert ok(url, "delete", {"names": [fresh("never")], **writer()})["deleted"] == []


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"everything": True}, "everything"),
        ({"worker_id": None}, "worker_id"),
        ({"seq": None}, "seq"),
        ({"seq": 1.5}, "seq"),
        ({"prefix": "x"}, "prefix"),  # and names
    ],
)
def test_bad_delete_is_400_naming_the_field_and_deletes_nothing(url, fields, field):
    name = fresh()
    init(url, {name: W0})
    msg = {k: v for k, v in {"names": [name], **writer(), **fields}.items() if v is not None}
    error = refused(url, "delete", msg, 400, "bad_request")
    assert error["details"]["field"] == field, error
    assert name in names_held(url)


def test_a_name_another_shard_owns_is_421_and_nothing_is_deleted(fleet_factory):
    fleet = fleet_factory(2)
    mine = next(n for n in (fresh("mine") for _ in range(100)) if shard_for(n, 2) == 0)
    theirs = next(n for n in (fresh("theirs") for _ in range(100)) if shard_for(n, 2) == 1)
    init(fleet.urls[0], {mine: W0})
    error = refused(
        fleet.urls[0], "delete", {"names": [mine, theirs], **writer()}, 421, "not_owner"
    )
    assert error["details"]["owners"] == {theirs: 1}
    assert mine in names_held(fleet.urls[0])


def test_deletes_racing_big_pushes_never_fail_the_shard(url):
    """Pushes big enough to be applied off the event loop, while their variable is deleted and
    made again: each push is applied or refused 404, never a 500, and the shard goes on."""
    name = fresh("race")
    size = (20 << 20) // 4  # float32 gradients above the store's off-loop threshold (16 MiB)
    failures: list[BaseException] = []
    stop = threading.Event()

    def pusher() -> None:
        grad = np.full(size, 1e-3, np.float32)
        with PSClient([url], worker_id=fresh("pusher")) as ps:
            while not stop.is_set():
                try:
                    ps.push({name: grad})
                except UnknownVariableError:
                    pass
                except Exception as exc:
                    failures.append(exc)
                    return

    init(url, {name: np.zeros(size, np.float32)})
    thread = threading.Thread(target=pusher, daemon=True)
    thread.start()
    try:
        for _ in range(8):
            assert ok(url, "delete", {"names": [name], **writer()})["deleted"] in ([name], [])
            init(url, {name: np.zeros(size, np.float32)})
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert not failures, failures
    assert shown(url, name)["shape"] == [size]


# -- kept across a restart -----------------------------------------------------------------------


def test_a_restart_keeps_changes_and_does_not_bring_deleted_variables_back(fleet_factory):
    fleet = fleet_factory(1, data=True)
    url = fleet.urls[0]
    changed, frozen, gone = fresh("changed"), fresh("frozen"), fresh("gone")
    init(url, {changed: W0, frozen: W0, gone: W0}, {"type": "adagrad", "lr": 0.1})
    ok(url, "push", {"grads": {changed: np.ones(4)}, **writer()})
    ok(url, "set_optimizer", {"names": [changed], "optimizer": SGD, **writer()})
    ok(url, "set_optimizer", {"names": [frozen], "frozen": True, **writer()})
    retried = {"names": [gone], **writer()}
    ok(url, "delete", retried)

    assert fleet.stop(0) == 0
    fleet.start(0)

    assert names_held(url) == {changed, frozen}
    seen = shown(url, changed)
    assert (seen["optimizer"]["type"], seen["optimizer_version"], seen["version"]) == ("sgd", 1, 1)
    assert shown(url, frozen)["frozen"] is True
    refused(url, "push", {"grads": {frozen: np.ones(4)}, **writer()}, 409, "frozen")
    # The dedup table came back too: the delete's retry is known.
    assert ok(url, "delete", retried) == {"status": "duplicate", "deleted": []}


def test_a_delete_ends_a_poll_waiting_on_the_variable_with_404(url):
    name = fresh("polled")
    init(url, {name: W0})
    answers: list[tuple[int, Any]] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            post(url, "poll", {"names": [name], "versions": {name: 0}, "timeout": 25.0})
        ),
        daemon=True,
    )
    thread.start()
    for _ in range(200):  # until the poll waits (/v1/cluster counts it), at most ~10 s
        if httpx2.get(f"{url}/v1/cluster").json()["polls_waiting"]:
            break
        thread.join(0.05)
    ok(url, "delete", {"names": [name], **writer()})
    thread.join(20.0)  # well before the poll's own timeout of 25 s
    assert not thread.is_alive(), "the delete did not end the poll"
    status, reply = answers[0]
    assert (status, reply["error"]["code"]) == (404, "not_found"), reply


def test_a_reshard_keeps_changes_and_leaves_deleted_variables_out(tmp_path):
    """In this process: a snapshot of a store after set_optimizer and delete, resharded onto two
    shards, comes back with each variable's optimizer, optimizer_version and frozen state."""
    from server import persistence
    from server.reshard import reshard
    from server.store import ParameterStore

    store = ParameterStore(0, 1)
    names = [f"r/{i}" for i in range(6)]
    adagrad = {"type": "adagrad", "lr": 0.1}
    store.init({n: (np.full(3, float(i)), adagrad) for i, n in enumerate(names)})
    store.push("w", 1, {n: np.ones(3) for n in names})

    async def change() -> None:
        await store.set_optimizer("w", 2, names=[names[0]], frozen=True)
        await store.set_optimizer("w", 3, names=[names[1]], optimizer=SGD)
        await store.delete("w", 4, names=[names[2]])

    asyncio.run(change())
    capture = store.capture()
    persistence.write_snapshot(tmp_path / "one", 1, capture, incarnation="x", checkpoint="ck")
    reshard([tmp_path / "one"], tmp_path / "two", 2, checkpoint="ck")
    held = {
        v.name: v
        for j in range(2)
        for v in persistence.find_restorable(tmp_path / "two" / f"shard-{j}", j, 2).variables
    }
    assert sorted(held) == sorted(set(names) - {names[2]})
    assert (held[names[0]].frozen, held[names[0]].optimizer_version) == (True, 1)
    assert held[names[1]].optimizer.to_wire()["type"] == "sgd"
    assert (held[names[1]].optimizer_version, held[names[1]].state) == (1, {})
    assert (held[names[3]].frozen, held[names[3]].optimizer_version) == (False, 0)
    np.testing.assert_array_equal(
        held[names[3]].state["accumulator"], store.get(names[3]).state["accumulator"]
    )
