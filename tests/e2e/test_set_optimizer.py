"""``set_optimizer`` and ``init``'s optimizer conflict through the SDK, end to end
(docs/PROTOCOL.md §3): real shard processes (``fleet_factory``), ``PSClient`` and
``AsyncPSClient``, a prefix across three shards, a restart on the data dir.

What a change does to the optimizer's slots is told from the values pushes make, against a
variable pushed the same gradients on the same shard: independent of the optimizers' default
settings, which docs/PROTOCOL.md states and tests/shard/test_optimizers.py checks. The verbs'
replies, retries and bad input over raw HTTP are in tests/shard/test_set_optimizer_and_delete.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadRequestError,
    ConflictError,
    FrozenError,
    PSClient,
    PushError,
    UnknownVariableError,
)
from client_sdk.optimizers import SGD, Adagrad, Adam, Cosine
from client_sdk.placement import shard_for
from tests.conftest import OnLoop, http_json
from tests.helpers.names import beside, fresh, spread

SHARDS = 3


def shown(urls: list[str], name: str) -> dict[str, Any]:
    """``GET /v1/variables/{name}`` of the shard that owns it."""
    return http_json(f"{urls[shard_for(name, len(urls))]}/v1/variables/{name}")


def steps(ps3: PSClient, name: str, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The change each of ``grads`` makes to ``name``, pushed one at a time."""
    out = []
    for g in grads:
        before = ps3.pull([name])[name].copy()
        ps3.push({name: g})
        out.append(ps3.pull([name])[name] - before)
    return out


rng = np.random.default_rng(16)
G1, G2 = rng.standard_normal(8), rng.standard_normal(8)
W0 = rng.standard_normal(8)


# -- changing settings of the same type keeps the slots --------------------------------------


def test_new_settings_of_the_same_type_keep_the_slots(ps3, fleet3):
    changed, reference = fresh("adagrad"), fresh("reference")
    ps3.init({changed: W0, reference: W0}, optimizer=Adagrad(lr=0.1))
    steps(ps3, changed, [G1])
    steps(ps3, reference, [G1])
    version = shown(fleet3.urls, changed)["version"]

    result = ps3.set_optimizer([changed], Adagrad(lr=0.05))

    assert result[changed]["status"] == "applied"
    assert result[changed]["slots"] == "kept"
    assert result[changed]["optimizer_version"] == 1
    assert result[changed]["optimizer"]["type"] == "adagrad"
    assert result[changed]["optimizer"]["lr"] == 0.05
    assert result[changed]["frozen"] is False
    assert result[changed]["version"] == version  # the value is not touched
    seen = shown(fleet3.urls, changed)
    assert (seen["optimizer"]["lr"], seen["optimizer_version"], seen["frozen"]) == (0.05, 1, False)
    assert seen["version"] == version
    # The accumulator went on: the step is the reference's (same accumulator), at half the rate.
    (step,) = steps(ps3, changed, [G2])
    (ref_step,) = steps(ps3, reference, [G2])
    np.testing.assert_allclose(step, 0.5 * ref_step, rtol=1e-12, atol=0)


def test_another_type_resets_the_slots_and_the_reply_says_so(ps3):
    name, first_step = fresh("switch"), fresh("first-step")
    ps3.init({name: W0}, optimizer=Adagrad(lr=0.1))
    steps(ps3, name, [G1, G2])

    assert ps3.set_optimizer([name], SGD(lr=0.1))[name]["slots"] == "reset"
    result = ps3.set_optimizer([name], Adagrad(lr=0.1))
    assert result[name]["slots"] == "reset"
    assert result[name]["optimizer_version"] == 2

    # Adagrad's state starts again: the next step is a new variable's first step.
    ps3.init({first_step: ps3.pull([name])[name]}, optimizer=Adagrad(lr=0.1))
    (step,) = steps(ps3, name, [G2])
    (fresh_step,) = steps(ps3, first_step, [G2])
    np.testing.assert_allclose(step, fresh_step, rtol=1e-12, atol=1e-15)


def test_adam_with_a_lower_rate_goes_on_from_its_moments_and_step_count(ps3, fleet3):
    changed, reference = fresh("adam"), fresh("adam-reference")
    ps3.init({changed: W0, reference: W0}, optimizer=Adam(lr=1e-3))
    steps(ps3, changed, [G1])
    steps(ps3, reference, [G1])

    result = ps3.set_optimizer([changed], Adam(lr=5e-4))

    assert result[changed]["slots"] == "kept"
    assert shown(fleet3.urls, changed)["steps"] == 1
    (step,) = steps(ps3, changed, [G2])
    (ref_step,) = steps(ps3, reference, [G2])  # same moments, same bias correction
    np.testing.assert_allclose(step, 0.5 * ref_step, rtol=1e-9, atol=0)
    assert shown(fleet3.urls, changed)["steps"] == 2


def test_the_step_count_restarts_with_another_type_and_a_new_schedule_takes_it_up(ps3, fleet3):
    name = fresh("count")
    ps3.init({name: W0}, optimizer=Adam(lr=1e-3))
    steps(ps3, name, [G1, G2])
    scheduled = Adam(lr=1e-3, schedule=Cosine(total=100, warmup=10))
    assert ps3.set_optimizer([name], scheduled)[name]["slots"] == "kept"
    assert shown(fleet3.urls, name)["steps"] == 2
    assert shown(fleet3.urls, name)["optimizer"]["schedule"]["type"] == "cosine"

    assert ps3.set_optimizer([name], SGD(lr=0.1, momentum=0.9))[name]["slots"] == "reset"
    assert shown(fleet3.urls, name)["steps"] == 0
    # SGD gaining nothing, then losing its momentum: the same type, the buffer dropped.
    steps(ps3, name, [G1])
    assert ps3.set_optimizer([name], SGD(lr=0.1))[name]["slots"] == "kept"
    assert shown(fleet3.urls, name)["steps"] == 1


def test_asking_for_what_the_variable_has_changes_nothing(ps3, fleet3):
    name = fresh("same")
    ps3.init({name: W0}, optimizer=SGD(lr=0.2))
    result = ps3.set_optimizer([name], SGD(lr=0.2), frozen=False)
    assert result[name]["optimizer_version"] == 0
    assert result[name]["slots"] == "kept"
    assert shown(fleet3.urls, name)["optimizer_version"] == 0


def test_the_asyncio_client_changes_optimizers_too(fleet3):
    name = fresh("async")
    ps3 = OnLoop(AsyncPSClient(fleet3.urls, worker_id=fresh("aw")))
    try:
        ps3.init({name: W0}, optimizer=SGD(lr=0.1))
        result = ps3.set_optimizer([name], SGD(lr=0.3))
        assert result[name]["optimizer_version"] == 1
        assert ps3.set_optimizer(name, frozen=True)[name]["frozen"] is True
        with pytest.raises(FrozenError):
            ps3.push({name: G1})
        assert sorted(ps3.delete([name])) == [name]
    finally:
        ps3.close()


# -- freezing --------------------------------------------------------------------------------


def test_a_frozen_variable_refuses_pushes_whole_until_unfrozen(ps3, fleet3):
    frozen = fresh("frozen")
    other = beside(frozen, "other", SHARDS)
    ps3.init({frozen: W0, other: W0}, optimizer=SGD(lr=0.1))
    result = ps3.set_optimizer([frozen], frozen=True)
    assert result[frozen]["frozen"] is True
    assert result[frozen]["optimizer_version"] == 1
    assert result[frozen]["optimizer"]["lr"] == 0.1  # the optimizer stays

    with pytest.raises(FrozenError) as info:
        ps3.push({frozen: G1, other: G1})
    err = info.value
    assert isinstance(err, ConflictError)
    assert (err.status, err.code) == (409, "frozen")
    assert frozen in err.details["frozen"]
    assert "set_optimizer" in err.message and "frozen=False" in err.message
    # Nothing of the push was applied, on either variable.
    assert shown(fleet3.urls, frozen)["version"] == 0
    assert shown(fleet3.urls, other)["version"] == 0
    np.testing.assert_array_equal(ps3.pull([frozen])[frozen], W0)

    # A background push surfaces it too, on flush.
    ps3.push_async({frozen: G1})
    with pytest.raises(PushError) as info:
        ps3.flush()
    assert any(isinstance(e, FrozenError) for e in info.value.errors)

    # An assign is an explicit overwrite: it still writes a frozen variable.
    ps3.assign({frozen: W0 * 2})
    np.testing.assert_array_equal(ps3.pull([frozen])[frozen], W0 * 2)

    assert ps3.set_optimizer([frozen], frozen=False)[frozen]["frozen"] is False
    ps3.push({frozen: G1})
    np.testing.assert_allclose(ps3.pull([frozen])[frozen], W0 * 2 - 0.1 * G1, rtol=1e-12)
    assert shown(fleet3.urls, frozen)["optimizer_version"] == 2


# -- a prefix reaches every shard --------------------------------------------------------------


def test_a_prefix_changes_every_matching_variable_on_every_shard(ps3, fleet3):
    run = fresh("run")
    names = spread(run, SHARDS)
    counter, elsewhere = f"{run}/global_step", fresh("run") + "/layer0"
    ps3.init({n: W0 for n in names} | {elsewhere: W0}, optimizer=SGD(lr=0.1))
    ps3.increment(counter)

    result = ps3.set_optimizer(f"{run}/", SGD(lr=0.01))

    assert sorted(result) == sorted(names)  # not the counter, not another run's variable
    for name in names:
        assert result[name]["optimizer"]["lr"] == 0.01
        assert shown(fleet3.urls, name)["optimizer"]["lr"] == 0.01
    assert shown(fleet3.urls, elsewhere)["optimizer"]["lr"] == 0.1
    assert ps3.set_optimizer(fresh("nothing-here") + "/", frozen=True) == {}


def test_a_prefix_matching_more_than_a_request_may_name_is_refused(fleet_factory):
    # 10: an optimizer's map (8 fields) must fit a request too.
    fleet = fleet_factory(1, "--max-request-names", "10")
    run = fresh("big")
    names = [f"{run}/{i}" for i in range(11)]
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps3:
        ps3.init(dict.fromkeys(names, W0), optimizer=SGD(lr=0.1))  # in two requests
        with pytest.raises(BadRequestError) as info:
            ps3.set_optimizer(f"{run}/", SGD(lr=0.5))
        assert (info.value.status, info.value.code) == (413, "too_large")
        assert (info.value.details["limit"], info.value.details["matched"]) == (10, 11)
        for name in names:
            assert shown(fleet.urls, name)["optimizer"]["lr"] == 0.1
        # Named in a list, they all change (the SDK splits it into requests of 10).
        assert sorted(ps3.set_optimizer(names, SGD(lr=0.5))) == sorted(names)


# -- kept across a restart, applied once ------------------------------------------------------


def test_a_restart_keeps_the_optimizer_its_slots_its_version_and_frozen(fleet_factory):
    fleet = fleet_factory(2, data=True)
    changed, reference, frozen = fresh("changed"), fresh("reference"), fresh("frozen")
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps3:
        ps3.init({changed: W0, reference: W0, frozen: W0}, optimizer=Adagrad(lr=0.1))
        steps(ps3, changed, [G1])
        steps(ps3, reference, [G1])
        ps3.set_optimizer([changed], Adagrad(lr=0.05))
        ps3.set_optimizer([frozen], frozen=True)

    for i in range(fleet.n):
        assert fleet.stop(i) == 0
        fleet.start(i)

    assert shown(fleet.urls, changed)["optimizer"]["lr"] == 0.05
    assert shown(fleet.urls, changed)["optimizer_version"] == 1
    assert shown(fleet.urls, frozen)["frozen"] is True
    assert shown(fleet.urls, frozen)["optimizer_version"] == 1
    with PSClient(fleet.urls, worker_id=fresh("w")) as ps3:
        (step,) = steps(ps3, changed, [G2])
        (ref_step,) = steps(ps3, reference, [G2])
        np.testing.assert_allclose(step, 0.5 * ref_step, rtol=1e-12, atol=0)
        with pytest.raises(FrozenError):
            ps3.push({frozen: G1})


# -- init of an existing variable ----------------------------------------------------------------


def test_init_stating_another_optimizer_is_a_conflict_naming_set_optimizer(ps3, fleet3):
    name = fresh("exists")
    new = beside(name, "new", SHARDS)
    ps3.init({name: W0}, optimizer=Adagrad(lr=0.1))

    with pytest.raises(ConflictError) as info:
        ps3.init({new: W0, name: W0}, optimizer=SGD(lr=0.1))
    err = info.value
    assert (err.status, err.code) == (409, "conflict")
    assert err.details["field"] == "optimizer"
    assert "set_optimizer" in err.message
    conflict = err.details["conflicts"][name]
    assert conflict["existing"]["optimizer"]["type"] == "adagrad"
    assert conflict["existing"]["optimizer_version"] == 0
    assert conflict["requested"]["optimizer"]["type"] == "sgd"
    with pytest.raises(UnknownVariableError):  # nothing of the refused init was created
        ps3.pull([new])
    assert shown(fleet3.urls, name)["optimizer"]["type"] == "adagrad"

    # The same optimizer, or none stated: the existing variable, as it is.
    assert ps3.init({name: W0}, optimizer=Adagrad(lr=0.1))[name]["created"] is False
    assert ps3.init({name: W0})[name]["created"] is False
    # After a change, the current optimizer is the one an init must state.
    ps3.set_optimizer([name], SGD(lr=0.5))
    assert ps3.init({name: W0}, optimizer=SGD(lr=0.5))[name]["created"] is False
    with pytest.raises(ConflictError) as info:
        ps3.init({name: W0}, optimizer=Adagrad(lr=0.1))
    assert info.value.details["conflicts"][name]["existing"]["optimizer_version"] == 1


# -- bad input: a clear 4xx naming the field, nothing changes ------------------------------------


def test_a_counter_has_no_optimizer_and_an_unknown_name_none_either(ps3, fleet3):
    counter = fresh("counter")
    name = beside(counter, "real", SHARDS)
    ps3.increment(counter)
    ps3.init({name: W0}, optimizer=SGD(lr=0.1))
    with pytest.raises(ConflictError) as info:
        ps3.set_optimizer([counter, name], SGD(lr=0.5))
    assert info.value.details["kind"] == "counter"
    with pytest.raises(UnknownVariableError):
        ps3.set_optimizer([beside(name, "missing", SHARDS), name], SGD(lr=0.5))
    assert shown(fleet3.urls, name)["optimizer"]["lr"] == 0.1


def test_the_sdk_refuses_what_it_can_tell_is_wrong_before_sending(ps3):
    with pytest.raises(BadRequestError, match="prefix"):
        ps3.set_optimizer("", SGD(lr=0.1))
    with pytest.raises(BadRequestError, match="frozen"):
        ps3.set_optimizer(["w"])  # neither a spec nor frozen
    with pytest.raises(BadRequestError, match="frozen"):
        ps3.set_optimizer(["w"], frozen="yes")
    with pytest.raises(BadRequestError):
        ps3.set_optimizer(["w"], {"type": "sgd"})  # a spec object, not a map
    with pytest.raises(BadRequestError):
        ps3.delete("")
