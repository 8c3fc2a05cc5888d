"""Partitioned variables on shard processes: one variable to every verb, its parts spread out.

A variable inited with ``partitions=k`` (or bigger than the fleet's ``--partition-bytes``) is
``k`` variables ``name/part-i`` on the shards that own their names, and its layout is kept by
the shard that owns ``name``. Here: it trains bit for bit like the same variable unpartitioned
under every optimizer; another client that never inited it pulls, pushes, assigns, waits and
polls it from the layout it learns; snapshots, a SIGTERM + restart and a checkpoint resharded
2 -> 3 keep it whole; a delete and re-init by another client is noticed, not used stale; bad
input is refused naming the field, nothing applied.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx2
import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadRequestError,
    BadTensorError,
    ConflictError,
    PartitionedError,
    PSClient,
    wire,
)
from client_sdk.optimizers import SGD, Adagrad, Adam, AdamW, Add, Ftrl, RMSprop
from client_sdk.partitions import part_name
from client_sdk.placement import shard_for
from tests.helpers.reshard import reshard

OPTIMIZERS = [
    SGD(lr=0.1),
    SGD(lr=0.1, momentum=0.9, nesterov=True),
    AdamW(lr=0.05, weight_decay=0.1),
    Add(),
    Adagrad(lr=0.2),
    Adam(lr=0.05),
    RMSprop(lr=0.01, centered=True),
    Ftrl(lr=0.1, l1=0.01),
]


def _fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def fleet3(module_fleet_factory):
    return module_fleet_factory(3)


def _post(url: str, verb: str, msg: dict) -> tuple[int, dict]:
    enc = wire.encode(msg)
    r = httpx2.post(
        f"{url}/v1/{verb}", content=enc.join(), headers={"content-type": enc.content_type}
    )
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"])


def _spread_name(prefix: str, parts: int, n: int) -> str:
    """A fresh name whose parts are on at least two shards (most names are)."""
    while True:
        name = _fresh(prefix)
        if len({shard_for(part_name(name, i), n) for i in range(parts)}) >= 2:
            return name


def test_a_partitioned_variable_trains_like_the_same_variable_unpartitioned(fleet3):
    rng = np.random.default_rng(3)
    runs = {}
    for i, opt in enumerate(OPTIMIZERS):
        w0 = rng.standard_normal((11, 6)).astype(np.float32)
        grads = [rng.standard_normal(w0.shape).astype(np.float32) for _ in range(6)]
        runs[i] = (_spread_name(f"p{i}", 3, 3), _fresh(f"u{i}"), opt, w0, grads)
    with PSClient(fleet3.urls, worker_id=_fresh("w")) as ps:
        for part, plain, opt, w0, _ in runs.values():
            made = ps.init({part: w0}, optimizer=opt, partitions=3)
            assert made[part]["created"] is True and made[part]["partitions"] == 3
            ps.init({plain: w0}, optimizer=opt)
        for k in range(6):
            pushed = ps.push(
                {n: g[k] for part, plain, _, _, g in runs.values() for n in (part, plain)}
            )
            for part, plain, *_ in runs.values():
                assert pushed[part]["version"] == pushed[plain]["version"] == k + 1
        names = [n for part, plain, *_ in runs.values() for n in (part, plain)]
        pulled = ps.pull(names)
        assert ps.versions(names) == dict.fromkeys(names, 6)
        listed = {s["name"]: s for s in ps.variables()}
    for part, plain, *_ in runs.values():
        assert pulled[part].shape == (11, 6) and not pulled[part].flags.writeable
        np.testing.assert_array_equal(pulled[part], pulled[plain], err_msg=part)
        shown = listed[part]
        assert shown["kind"] == "partitioned" and shown["shape"] == [11, 6]
        assert [p["rows"] for p in shown["parts"]] == [4, 4, 3]
        assert len({p["shard"] for p in shown["parts"]}) >= 2  # spread over the fleet
        for i, p in enumerate(shown["parts"]):
            assert listed[p["name"]]["shard"] == p["shard"] == shard_for(part_name(part, i), 3)
            assert listed[p["name"]]["version"] == 6


def test_another_client_learns_the_layout_for_every_verb(fleet3):
    name = _spread_name("learn", 4, 3)
    w0 = np.arange(40, dtype=np.float32).reshape(10, 4)
    with (
        PSClient(fleet3.urls, worker_id=_fresh("a")) as a,
        PSClient(fleet3.urls, worker_id=_fresh("b")) as b,
    ):
        a.init({name: w0}, optimizer=SGD(lr=1.0), partitions=4)
        b.wait_ready([name], timeout=30)  # the layout, then every part
        np.testing.assert_array_equal(b.pull([name])[name], w0)
        assert b.versions([name]) == {name: 0}
        got = b.push({name: np.ones((10, 4), np.float32)})
        assert got[name]["status"] == "applied" and got[name]["version"] == 1
        assert len(got[name]["parts"]) == 4
        np.testing.assert_array_equal(a.pull([name])[name], w0 - 1)
        c = PSClient(fleet3.urls, worker_id=_fresh("c"))  # pushes before it ever pulled
        try:
            c.push_async({name: np.ones((10, 4), np.float32)}).result(timeout=30)
            assert c.assign({name: w0 * 2})[name]["version"] == 3
        finally:
            c.close()
        np.testing.assert_array_equal(b.pull([name])[name], w0 * 2)
        got = b.pull([name], min_version=3, timeout=10)
        np.testing.assert_array_equal(got[name], w0 * 2)


def test_newer_than_returns_the_whole_variable_when_any_part_changed(fleet3):
    name = _spread_name("bcast", 3, 3)
    w0 = np.zeros((9, 2), np.float32)
    with (
        PSClient(fleet3.urls, worker_id=_fresh("learner")) as learner,
        PSClient(fleet3.urls, worker_id=_fresh("actor")) as actor,
    ):
        learner.init({name: w0}, optimizer=SGD(lr=1.0), partitions=3)
        actor.pull([name])
        got: dict = {}
        waiting = threading.Thread(
            target=lambda: got.update(actor.pull([name], newer_than="cached", timeout=30))
        )
        waiting.start()
        learner.push({name: np.ones((9, 2), np.float32)})
        waiting.join(60)
        assert not waiting.is_alive()
        np.testing.assert_array_equal(got[name], -np.ones((9, 2), np.float32))
        assert actor.pull([name], newer_than="cached", timeout=0.2) == {}


def test_the_asyncio_client_pulls_and_pushes_a_partitioned_variable(fleet3):
    name = _fresh("async")
    w0 = np.ones((5, 3), np.float64)

    async def main() -> np.ndarray:
        async with AsyncPSClient(fleet3.urls, worker_id=_fresh("as")) as ps:
            await ps.init({name: w0}, optimizer=SGD(lr=0.5), partitions=5)
            await ps.push({name: np.full((5, 3), 2.0)})
            task = await ps.push_async({name: np.full((5, 3), 2.0)})
            await task
            return (await ps.pull([name]))[name]

    np.testing.assert_array_equal(asyncio.run(main()), w0 - 2.0)


def test_bad_input_is_refused_naming_the_field_and_nothing_is_applied(fleet3):
    name, plain = _fresh("bad"), _fresh("plain")
    w0 = np.zeros((4, 2), np.float32)
    with PSClient(fleet3.urls, worker_id=_fresh("w")) as ps:
        for k, words in ((0, ">= 1"), (5, "more than the 4 row"), (-1, ">= 1")):
            with pytest.raises(BadRequestError, match=words) as err:
                ps.init({name: w0}, partitions=k)
            assert err.value.details["field"] == "partitions"
        with pytest.raises(BadRequestError, match="scalar"):
            ps.init({name: np.float32(1.0)}, partitions=2)
        scalar = _fresh("scalar")  # partitions=1 (or none) is a plain variable, scalars too
        assert ps.init({scalar: np.float32(1.0)}, partitions=1)[scalar]["created"] is True
        assert ps.init({_fresh("s"): np.int64(3)})
        with pytest.raises(BadRequestError, match="asynchronously"):
            ps.init({name: w0}, partitions=2, max_staleness=3)
        with pytest.raises(BadRequestError, match="clip_norm") as err:
            ps.init({name: w0}, optimizer=Adam(lr=0.1, clip_norm=1.0), partitions=2)
        assert err.value.details["field"] == "optimizer.clip_norm"
        ps.init({name: w0}, partitions=2)
        ps.init({plain: w0})
        for values, k in (({name: w0}, 4), ({name: w0}, 1), ({plain: w0}, 2)):
            with pytest.raises(ConflictError) as err:
                ps.init(values, partitions=k)
            assert err.value.details["field"] == "partitions", err.value
        with pytest.raises(ConflictError) as err:  # another shape: the layout says which field
            ps.init({name: np.zeros((6, 2), np.float32)}, partitions=2)
        assert err.value.details["field"] == "shape"
        with pytest.raises(BadTensorError, match=r"\[4, 2\]"):
            ps.push({name: np.ones((3, 2), np.float32), plain: np.ones((4, 2), np.float32)})
        assert ps.pull([name, plain], min_version=0) is not None
        assert {s["name"]: s.get("version") for s in ps.variables() if s["name"] == plain} == {
            plain: 0
        }
        assert ps.versions([name]) == {name: 0}
        with pytest.raises(PartitionedError):  # a counter's verb on a partitioned variable
            ps.increment(name)
        owner = fleet3.urls[shard_for(name, 3)]
        status, reply = _post(owner, "pull", {"names": [name]})  # a raw client's plain pull
        assert status == 409 and reply["error"]["code"] == "partitioned"
        assert reply["error"]["details"]["layouts"][name] == {
            "partitions": 2,
            "dtype": "<f4",
            "shape": [4, 2],
        }
        for entry, field in (
            ({"partitions": 1, "dtype": "<f4", "shape": [4, 2]}, "partitions"),
            ({"partitions": 3, "dtype": "<f4", "shape": []}, "partitions"),
            ({"partitions": 2, "dtype": "<c8", "shape": [4]}, "dtype"),
            ({"partitions": 2, "dtype": "<f4", "shape": [4, -1]}, "shape"),
            ({"partitions": True, "dtype": "<f4", "shape": [4]}, "partitions"),
        ):
            fresh = _fresh("raw")
            status, reply = _post(
                fleet3.urls[shard_for(fresh, 3)], "init", {"variables": {fresh: entry}}
            )
            assert status == 400 and reply["error"]["details"]["field"] == field, reply


def test_set_optimizer_and_freeze_reach_every_part(fleet3):
    name = _spread_name("opt", 3, 3)
    with PSClient(fleet3.urls, worker_id=_fresh("a")) as a:
        a.init({name: np.zeros((6, 2), np.float32)}, optimizer=SGD(lr=1.0), partitions=3)
    with PSClient(fleet3.urls, worker_id=_fresh("b")) as b:  # looks the name up first
        changed = b.set_optimizer([name], SGD(lr=0.5))
        assert changed[name]["optimizer"]["lr"] == 0.5 and len(changed[name]["parts"]) == 3
        b.push({name: np.ones((6, 2), np.float32)})
        np.testing.assert_array_equal(b.pull([name])[name], np.full((6, 2), -0.5))
        with pytest.raises(BadRequestError, match="clip_norm"):
            b.set_optimizer([name], SGD(lr=0.5, clip_norm=2.0))
        b.set_optimizer([name], frozen=True)
        with pytest.raises(ConflictError):
            b.push({name: np.ones((6, 2), np.float32)})
        assert b.versions([name]) == {name: 1}


def test_a_delete_and_reinit_by_another_client_is_noticed(fleet3):
    name = _fresh("again")
    with (
        PSClient(fleet3.urls, worker_id=_fresh("a")) as a,
        PSClient(fleet3.urls, worker_id=_fresh("b")) as b,
    ):
        a.init({name: np.zeros((6, 2), np.float32)}, partitions=3)
        np.testing.assert_array_equal(b.pull([name])[name], np.zeros((6, 2)))
        removed = a.delete([name])
        assert removed == sorted([name, *(part_name(name, i) for i in range(3))])
        a.init({name: np.ones((6, 2), np.float32)}, partitions=2)
        np.testing.assert_array_equal(b.pull([name])[name], np.ones((6, 2)))
        a.delete([name])
        a.init({name: np.full((6, 2), 7, np.float32)})  # plain now
        np.testing.assert_array_equal(b.pull([name])[name], np.full((6, 2), 7))
        assert [s["kind"] for s in b.variables() if s["name"].startswith(name)] == ["tensor"]


def test_a_variable_above_partition_bytes_is_split_by_itself(fleet_factory):
    fleet = fleet_factory(2, "--partition-bytes", "1024")
    big, small = _fresh("big"), _fresh("small")
    with PSClient(fleet.urls, worker_id="w") as ps:
        made = ps.init({big: np.ones((40, 16), np.float32), small: np.ones((16, 16), np.float32)})
        assert made[big]["partitions"] == 3 and "partitions" not in made[small]
        assert [p["rows"] for p in _listed(ps)[big]["parts"]] == [14, 13, 13]
        with pytest.raises(ConflictError):  # partitions=1: not partitioned, as it exists
            ps.init({big: np.ones((40, 16), np.float32)}, partitions=1)
        assert ps.init({big: np.ones((40, 16), np.float32)})[big]["created"] is False


def _listed(ps: PSClient) -> dict:
    return {s["name"]: s for s in ps.variables()}


def _stateful_run(rng: np.random.Generator) -> dict:
    out = {}
    for i, opt in enumerate((Adam(lr=0.05), Adagrad(lr=0.1), SGD(lr=0.1, momentum=0.5))):
        w0 = rng.standard_normal((9, 4)).astype(np.float32)
        grads = [rng.standard_normal(w0.shape).astype(np.float32) for _ in range(8)]
        out[_fresh(f"s{i}")] = (opt, w0, grads)
    return out


def _train(ps: PSClient, runs: dict, steps: range, reference: bool = False) -> None:
    for k in steps:
        ps.push({(n + "-ref" if reference else n): g[k] for n, (_, _, g) in runs.items()})


def test_snapshots_and_a_restart_keep_it_whole(fleet_factory):
    fleet = fleet_factory(2, "--snapshot-interval", "0", data=True)
    runs = _stateful_run(np.random.default_rng(11))
    with PSClient(fleet.urls, worker_id="t") as ps:
        for name, (opt, w0, _) in runs.items():
            ps.init({name: w0}, optimizer=opt, partitions=3)
            ps.init({name + "-ref": w0}, optimizer=opt)
        _train(ps, runs, range(4))
        _train(ps, runs, range(4), reference=True)
        for i in range(2):
            assert fleet.stop(i) == 0  # SIGTERM: a final snapshot
            fleet.start(i)
    with PSClient(fleet.urls, worker_id="t2") as ps:  # a client that learns it afresh
        _train(ps, runs, range(4, 8))
        _train(ps, runs, range(4, 8), reference=True)
        pulled = ps.pull([n for name in runs for n in (name, name + "-ref")])
        assert {s["name"] for s in ps.variables() if s["kind"] == "partitioned"} == set(runs)
    for name in runs:
        np.testing.assert_array_equal(pulled[name], pulled[name + "-ref"], err_msg=name)


def test_a_checkpoint_resharded_2_to_3_is_equal_after_the_move(fleet_factory, tmp_path):
    fleet = fleet_factory(2, "--snapshot-interval", "0", data=True)
    runs = _stateful_run(np.random.default_rng(12))
    with PSClient(fleet.urls, worker_id="t") as ps:
        for name, (opt, w0, _) in runs.items():
            ps.init({name: w0}, optimizer=opt, partitions=4)
            ps.init({name + "-ref": w0}, optimizer=opt)
        _train(ps, runs, range(4))
        _train(ps, runs, range(4), reference=True)
        before = ps.pull(list(runs))
        ps.checkpoint()
    for i in range(2):
        fleet.stop(i)
    _, dirs = reshard(fleet.data_dirs, tmp_path / "three", 3)
    fleet3 = fleet_factory(3, data_dirs=dirs)
    with PSClient(fleet3.urls, worker_id="t3") as ps:
        after = ps.pull(list(runs))
        listed = {s["name"]: s for s in ps.variables()}
        for name in runs:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
            assert listed[name]["shard"] == shard_for(name, 3)  # the layout moved to its owner
            assert {p["shard"] for p in listed[name]["parts"]} == {
                shard_for(part_name(name, i), 3) for i in range(4)
            }
        _train(ps, runs, range(4, 8))
        _train(ps, runs, range(4, 8), reference=True)
        pulled = ps.pull([n for name in runs for n in (name, name + "-ref")])
    for name in runs:
        np.testing.assert_array_equal(pulled[name], pulled[name + "-ref"], err_msg=name)


def test_the_owner_shows_the_logical_variable_and_its_parts(fleet3):
    name = _fresh("shown")
    with PSClient(fleet3.urls, worker_id=_fresh("w")) as ps:
        ps.init({name: np.zeros((7, 3), np.float16)}, partitions=2)
    r = httpx2.get(f"{fleet3.urls[shard_for(name, 3)]}/v1/variables/{name}")
    assert r.status_code == 200
    shown = r.json()
    assert shown["kind"] == "partitioned" and shown["dtype"] == "<f2"
    assert shown["shape"] == [7, 3] and shown["partitions"] == 2
    assert [p["name"] for p in shown["parts"]] == [part_name(name, 0), part_name(name, 1)]
    assert [p["rows"] for p in shown["parts"]] == [4, 3]
