"""``delete`` through the SDK, end to end (docs/PROTOCOL.md §3): by names and by a prefix
across three shards, idempotent, the client's cache forgotten, kept across a restart, refused
while a sync round is open. Real shard processes (``fleet_factory``), ``PSClient`` and
``AsyncPSClient``. The verb's replies, retries, bad input and its races with pushes and polls
over raw HTTP are in tests/shard/test_set_optimizer_and_delete.py.
"""

from __future__ import annotations

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
from tests.conftest import OnLoop, http_json
from tests.helpers.names import fresh, spread

SHARDS = 3


def listed(urls: list[str]) -> set[str]:
    """Every variable name the fleet holds, from ``GET /v1/variables`` of each shard."""
    return {v["name"] for url in urls for v in http_json(f"{url}/v1/variables")["variables"]}


W0 = np.arange(8, dtype=np.float64)


def test_a_deleted_variable_is_unknown_until_created_again_afresh(ps3):
    name = fresh("w")
    ps3.init({name: W0}, optimizer=Adagrad(lr=0.1))
    ps3.push({name: np.ones(8)})
    ps3.set_optimizer([name], frozen=True)

    assert ps3.delete([name]) == [name]

    with pytest.raises(UnknownVariableError):
        ps3.pull([name])
    with pytest.raises(UnknownVariableError):
        ps3.push({name: np.ones(8)})
    # Created again: another shape and dtype, another optimizer, version 0, not frozen.
    new = np.full(3, 7, np.float32)
    assert ps3.init({name: new}, optimizer=SGD(lr=0.5)) == {name: {"version": 0, "created": True}}
    np.testing.assert_array_equal(ps3.pull([name])[name], new)  # not a cached old value
    ps3.push({name: np.ones(3, np.float32)})
    np.testing.assert_allclose(ps3.pull([name])[name], new - 0.5)


def test_a_value_cached_before_a_delete_is_not_served_for_the_variable_made_again(fleet3):
    # Client a caches version 1 of the name; client b deletes it, makes it again with another
    # value and brings it to version 1 too: a's pulls (plain, into out=, waiting) must see b's.
    name = fresh("again")
    with (
        PSClient(fleet3.urls, worker_id=fresh("a")) as a,
        PSClient(fleet3.urls, worker_id=fresh("b")) as b,
    ):
        a.init({name: W0}, optimizer=SGD(lr=1.0))
        a.push({name: np.ones(8)})
        np.testing.assert_array_equal(a.pull([name])[name], W0 - 1)

        assert b.delete([name]) == [name]
        b.init({name: W0 * 10}, optimizer=SGD(lr=1.0))
        assert b.push({name: np.ones(8)})[name]["version"] == 1

        np.testing.assert_array_equal(a.pull([name])[name], W0 * 10 - 1)
        np.testing.assert_array_equal(a.pull([name])[name], W0 * 10 - 1)  # now cached
        buf = np.zeros(8)
        a.pull([name], out={name: buf})
        np.testing.assert_array_equal(buf, W0 * 10 - 1)
        assert a.pull([name], min_version=1)[name][0] == -1


def test_the_asyncio_client_does_not_serve_a_deleted_variables_value_either(fleet3):
    name = fresh("again")
    a = OnLoop(AsyncPSClient(fleet3.urls, worker_id=fresh("a")))
    try:
        with PSClient(fleet3.urls, worker_id=fresh("b")) as b:
            a.init({name: W0}, optimizer=SGD(lr=1.0))
            a.push({name: np.ones(8)})
            a.pull([name])
            b.delete([name])
            b.init({name: W0 * 10}, optimizer=SGD(lr=1.0))
            b.push({name: np.ones(8)})
        np.testing.assert_array_equal(a.pull([name])[name], W0 * 10 - 1)
    finally:
        a.close()


def test_deleting_what_is_not_there_succeeds_listing_nothing(ps3):
    name = fresh("gone")
    ps3.init({name: W0})
    assert ps3.delete([name, fresh("never")]) == [name]
    assert ps3.delete([name]) == []
    assert ps3.delete(fresh("no-such-run") + "/") == []


def test_a_prefix_deletes_a_run_on_every_shard_counters_included(ps3, fleet3):
    run, other = fresh("run"), fresh("run")
    names = spread(run, SHARDS)
    ps3.init({n: W0 for n in names} | {f"{other}/layer0": W0})
    ps3.increment(f"{run}/global_step")

    deleted = ps3.delete(f"{run}/")

    assert deleted == sorted([*names, f"{run}/global_step"])
    held = listed(fleet3.urls)
    assert not any(n.startswith(f"{run}/") for n in held)
    assert f"{other}/layer0" in held
    # Start the run over: the same names init again.
    assert all(r["created"] for r in ps3.init({n: W0 for n in names}).values())


def test_the_asyncio_client_deletes_too(fleet3):
    name = fresh("async")
    ps3 = OnLoop(AsyncPSClient(fleet3.urls, worker_id=fresh("aw")))
    try:
        ps3.init({name: W0})
        assert ps3.delete([name]) == [name]
        with pytest.raises(UnknownVariableError):
            ps3.pull([name])
    finally:
        ps3.close()


def test_a_restart_does_not_bring_a_deleted_variable_back(fleet_factory):
    fleet = fleet_factory(2, data=True)
    gone, kept = fresh("gone"), fresh("kept")
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps3:
        ps3.init({gone: W0, kept: W0})
        ps3.push({gone: np.ones(8), kept: np.ones(8)})
        assert ps3.delete([gone]) == [gone]

    for i in range(fleet.n):
        assert fleet.stop(i) == 0
        fleet.start(i)

    assert listed(fleet.urls) == {kept}
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps3:
        with pytest.raises(UnknownVariableError):
            ps3.pull([gone])
        assert ps3.init({gone: W0})[gone]["created"] is True


def test_the_sdk_refuses_an_empty_prefix_before_sending(ps3):
    with pytest.raises(BadRequestError, match="prefix"):
        ps3.delete("")
    with pytest.raises(BadRequestError):
        ps3.delete(None)


# -- with sync rounds ------------------------------------------------------------------------------


def test_a_variable_with_an_open_sync_round_is_not_deleted(ps3):
    name = fresh("sync")
    ps3.init({name: W0}, sync=Sync(replicas=2, timeout=30.0))
    ps3.pull([name])
    assert ps3.push({name: np.ones(8)})[name]["status"] == "accepted"  # the round is open

    with pytest.raises(ConflictError) as info:
        ps3.delete([name])
    assert name in info.value.details["open_rounds"]
    assert ps3.pull([name])[name].shape == (8,)  # still there

    with PSClient(ps3.shards, worker_id=fresh("second")) as other:
        other.push({name: np.ones(8)}, versions={name: 0})  # the second replica closes it
    assert ps3.delete([name]) == [name]
