"""``delete`` through the SDK, end to end (docs/PROTOCOL.md §3): by names and by a prefix
across three shards, idempotent, the client's cache forgotten, kept across a restart, refused
while a sync round is open. Real shard processes (``fleet_factory``), ``PSClient`` and
``AsyncPSClient``. The verb's replies, retries, bad input and its races with pushes and polls
over raw HTTP are in tests/shard/test_set_optimizer_and_delete.py.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadRequestError,
    ConflictError,
    PSClient,
    UnknownVariableError,
)
from client_sdk.modes import Sync
from client_sdk.optimizers import SGD, Adagrad
from client_sdk.placement import shard_for
from tests.conftest import Fleet, OnLoop, http_json

SHARDS = 3


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory):
    fleet = Fleet(SHARDS, tmp_path_factory.mktemp("delete"))
    yield fleet
    fleet.close()


@pytest.fixture
def ps(fleet3):
    with PSClient(fleet3.urls, worker_id=f"w-{uuid.uuid4().hex[:8]}") as client:
        yield client


def fresh(prefix: str = "v") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def spread(run: str, each: int = 2) -> list[str]:
    """Names under ``run/``, at least ``each`` on every shard."""
    names: list[str] = []
    for i in range(1000):
        name = f"{run}/layer{i}"
        if sum(shard_for(n, SHARDS) == shard_for(name, SHARDS) for n in names) < each:
            names.append(name)
        if len(names) == each * SHARDS:
            return names
    raise AssertionError("placement left a shard without names")


def listed(urls: list[str]) -> set[str]:
    """Every variable name the fleet holds, from ``GET /v1/variables`` of each shard."""
    return {v["name"] for url in urls for v in http_json(f"{url}/v1/variables")["variables"]}


W0 = np.arange(8, dtype=np.float64)


def test_a_deleted_variable_is_unknown_until_created_again_afresh(ps):
    name = fresh("w")
    ps.init({name: W0}, optimizer=Adagrad(lr=0.1))
    ps.push({name: np.ones(8)})
    ps.set_optimizer([name], frozen=True)

    assert ps.delete([name]) == [name]

    with pytest.raises(UnknownVariableError):
        ps.pull([name])
    with pytest.raises(UnknownVariableError):
        ps.push({name: np.ones(8)})
    # Created again: another shape and dtype, another optimizer, version 0, not frozen.
    new = np.full(3, 7, np.float32)
    assert ps.init({name: new}, optimizer=SGD(lr=0.5)) == {name: {"version": 0, "created": True}}
    np.testing.assert_array_equal(ps.pull([name])[name], new)  # not a cached old value
    ps.push({name: np.ones(3, np.float32)})
    np.testing.assert_allclose(ps.pull([name])[name], new - 0.5)


def test_deleting_what_is_not_there_succeeds_listing_nothing(ps):
    name = fresh("gone")
    ps.init({name: W0})
    assert ps.delete([name, fresh("never")]) == [name]
    assert ps.delete([name]) == []
    assert ps.delete(fresh("no-such-run") + "/") == []


def test_a_prefix_deletes_a_run_on_every_shard_counters_included(ps, fleet3):
    run, other = fresh("run"), fresh("run")
    names = spread(run)
    ps.init({n: W0 for n in names} | {f"{other}/layer0": W0})
    ps.increment(f"{run}/global_step")

    deleted = ps.delete(f"{run}/")

    assert deleted == sorted([*names, f"{run}/global_step"])
    held = listed(fleet3.urls)
    assert not any(n.startswith(f"{run}/") for n in held)
    assert f"{other}/layer0" in held
    # Start the run over: the same names init again.
    assert all(r["created"] for r in ps.init({n: W0 for n in names}).values())


def test_the_asyncio_client_deletes_too(fleet3):
    name = fresh("async")
    ps = OnLoop(AsyncPSClient(fleet3.urls, worker_id=fresh("aw")))
    try:
        ps.init({name: W0})
        assert ps.delete([name]) == [name]
        with pytest.raises(UnknownVariableError):
            ps.pull([name])
    finally:
        ps.close()


def test_a_restart_does_not_bring_a_deleted_variable_back(fleet_factory):
    fleet = fleet_factory(2, data=True)
    gone, kept = fresh("gone"), fresh("kept")
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps:
        ps.init({gone: W0, kept: W0})
        ps.push({gone: np.ones(8), kept: np.ones(8)})
        assert ps.delete([gone]) == [gone]

    for i in range(fleet.n):
        assert fleet.stop(i) == 0
        fleet.start(i)

    assert listed(fleet.urls) == {kept}
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps:
        with pytest.raises(UnknownVariableError):
            ps.pull([gone])
        assert ps.init({gone: W0})[gone]["created"] is True


def test_the_sdk_refuses_an_empty_prefix_before_sending(ps):
    with pytest.raises(BadRequestError, match="prefix"):
        ps.delete("")
    with pytest.raises(BadRequestError):
        ps.delete(None)


# -- with sync rounds ------------------------------------------------------------------------------


def test_a_variable_with_an_open_sync_round_is_not_deleted(ps):
    name = fresh("sync")
    ps.init({name: W0}, sync=Sync(replicas=2, timeout=30.0))
    ps.pull([name])
    assert ps.push({name: np.ones(8)})[name]["status"] == "accepted"  # the round is open

    with pytest.raises(ConflictError) as info:
        ps.delete([name])
    assert name in info.value.details["open_rounds"]
    assert ps.pull([name])[name].shape == (8,)  # still there

    with PSClient(ps.shards, worker_id=fresh("second")) as other:
        other.push({name: np.ones(8)}, versions={name: 0})  # the second replica closes it
    assert ps.delete([name]) == [name]
