"""Embedding tables through the SDK on real shard processes: ``create_table``, ``pull_rows``,
``push_rows`` of ``PSClient`` and ``AsyncPSClient`` (docs/PROTOCOL.md §3, README).

The rows a fleet holds after many pushes with repeated ids are checked against references
computed here: an Adam written out in numpy with each row's own step count, and for every
optimizer the update server/optim.py applies to a dense variable (tested against torch and TF
in tests/shard/test_optimizers.py), applied row by row with the row's own step. A 1-shard and a
3-shard fleet pushed the same batches hold the same rows (placement changes nothing). The
requests over raw HTTP, and bad input on the wire, are in tests/shard/test_embedding_requests.py.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadTensorError,
    ConflictError,
    ProtocolError,
    PSClient,
    UnknownVariableError,
)
from client_sdk.embedding import Normal, TableSpec, Zeros, initial_rows
from client_sdk.optimizers import SGD, Adagrad, Adam, AdamW, Ftrl, Optimizer, RMSprop
from client_sdk.placement import row_shard
from server import optim
from tests.conftest import Fleet, http_json
from tests.helpers.eventually import eventually
from tests.helpers.names import fresh
from tests.sdk.test_client import AsIfOlder

DIM = 8


@pytest.fixture(scope="module")
def fleets(tmp_path_factory):
    one = Fleet(1, tmp_path_factory.mktemp("emb-1"))
    three = Fleet(3, tmp_path_factory.mktemp("emb-3"))
    yield one, three
    one.close()
    three.close()


def batches(steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches of 48 ids from a pool of 40 (many repeats within a batch, and rows
    updated a different number of times each), negative and huge ids among them."""
    rng = np.random.default_rng(seed)
    pool = np.concatenate([np.arange(-5, 30), [2**62, -(2**63), 2**63 - 1, 10**12, 77]])
    out = []
    for _ in range(steps):
        ids = rng.choice(pool, size=48).astype(np.int64)
        grads = rng.standard_normal((48, DIM)).astype(np.float32)
        out.append((ids, grads))
    return out


def reference(spec: TableSpec, name: str, pushes: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Row id -> value after ``pushes``, each row a dense variable of its own updated by
    server.optim with its own step count (repeats summed in the order given)."""
    values: dict[int, np.ndarray] = {}
    states: dict[int, dict[str, np.ndarray]] = {}
    steps: dict[int, int] = {}
    for ids, grads in pushes:
        summed: dict[int, np.ndarray] = {}
        for order in np.argsort(ids, kind="stable"):
            i = int(ids[order])
            summed[i] = summed[i] + grads[order] if i in summed else grads[order].copy()
        for i, g in summed.items():
            if i not in values:
                values[i] = initial_rows(spec, name, np.array([i], np.int64))[0]
                states[i] = optim.init_state(spec.optimizer, values[i])
                steps[i] = 0
            steps[i] += 1
            optim.apply(spec.optimizer, values[i], g, states[i], step=steps[i])
    return values


def adam_reference(spec: TableSpec, name: str, pushes, lr: float) -> dict:
    """Adam written out: per row m, v and its own t for the bias correction."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    rows: dict[int, list] = {}
    for ids, grads in pushes:
        for i in np.unique(ids):
            g = grads[ids == i].astype(np.float64).sum(axis=0)
            if int(i) not in rows:
                first = initial_rows(spec, name, np.array([i], np.int64))[0].astype(np.float64)
                rows[int(i)] = [first, np.zeros(DIM), np.zeros(DIM), 0]
            w, m, v, t = rows[int(i)]
            t += 1
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
            rows[int(i)] = [w, m, v, t]
    return {i: r[0] for i, r in rows.items()}


OPTIMIZERS: list[Optimizer] = [
    SGD(lr=0.1),
    SGD(lr=0.05, momentum=0.9, nesterov=True),
    SGD(lr=0.05, momentum=0.9, dampening=0.5, weight_decay=0.01),
    Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    Adam(lr=0.01),
    AdamW(lr=0.01, weight_decay=0.1, amsgrad=True),
    RMSprop(lr=0.01, momentum=0.5, centered=True),
    Ftrl(lr=0.1, l1=0.01, l2=0.01),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_rows_follow_the_optimizer_per_row(fleets, opt):
    one, three = fleets
    name = fresh("t")
    spec = TableSpec(dim=DIM, initializer=Normal(std=0.1), optimizer=opt, seed=7)
    pushes = batches(12)
    got = []
    for fleet in (one, three):
        with PSClient(fleet.urls, worker_id=fresh("w")) as ps:
            assert ps.create_table(name, DIM, initializer=Normal(std=0.1), optimizer=opt, seed=7)
            for ids, grads in pushes:
                ps.push_rows(name, ids, grads)
            everything = np.array(sorted(reference(spec, name, pushes)), np.int64)
            got.append(ps.pull_rows(name, everything))
    expected = reference(spec, name, pushes)
    want = np.stack([expected[int(i)] for i in everything])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    # One shard or three: the same rows, to the bit
    np.testing.assert_array_equal(got[0], got[1])


def test_adam_corrects_each_row_by_its_own_step_count(fleets):
    one, _ = fleets
    name = fresh("t")
    pushes = batches(20, seed=3)
    spec = TableSpec(dim=DIM, optimizer=Adam(lr=0.02))
    with PSClient(one.urls, worker_id=fresh("w")) as ps:
        ps.create_table(name, DIM, optimizer=Adam(lr=0.02))
        for ids, grads in pushes:
            ps.push_rows(name, ids, grads)
        expected = adam_reference(spec, name, pushes, 0.02)
        ids = np.array(sorted(expected), np.int64)
        got = ps.pull_rows(name, ids)
    np.testing.assert_allclose(got, np.stack([expected[int(i)] for i in ids]), rtol=1e-4, atol=1e-5)


def test_pull_rows_repeats_and_order_and_initial_rows(fleets):
    _, three = fleets
    name = fresh("t")
    with PSClient(three.urls, worker_id=fresh("w")) as ps:
        assert ps.create_table(name, DIM, seed=11) is True
        assert ps.create_table(name, DIM, seed=11) is False
        ids = np.array([5, -1, 5, 2**63 - 1, 0, -1], np.int64)
        rows = ps.pull_rows(name, ids)
        assert rows.shape == (6, DIM) and rows.dtype == np.float32
        np.testing.assert_array_equal(rows, initial_rows(TableSpec(dim=DIM, seed=11), name, ids))
        assert ps.pull_rows(name, []).shape == (0, DIM)
        assert ps.pull_rows(name, [3, 3]).shape == (2, DIM)
        # rows over every shard
        assert len(set(row_shard(name, np.arange(50), 3).tolist())) == 3
        result = ps.push_rows(name, np.arange(50), np.ones((50, DIM), np.float32))
        assert result == {"rows": 50, "created": 50, "counted": 0, "duplicate": 0}


def test_sdk_refuses_bad_arguments_before_sending(fleets):
    one, _ = fleets
    name = fresh("t")
    with PSClient(one.urls, worker_id=fresh("w")) as ps:
        ps.create_table(name, DIM, initializer=Zeros())
        with pytest.raises(BadTensorError, match="integers"):
            ps.pull_rows(name, [1.5, 2.0])
        with pytest.raises(BadTensorError, match="integers"):
            ps.push_rows(name, np.array([True]), np.ones((1, DIM)))
        with pytest.raises(BadTensorError, match="shape"):
            ps.push_rows(name, [1, 2], np.ones((3, DIM)))
        with pytest.raises(BadTensorError, match="dim"):
            ps.push_rows(name, [1, 2], np.ones((2, DIM + 1)))
        with pytest.raises(BadTensorError):
            ps.push_rows(name, [1], np.full((1, DIM), math.nan))
        np.testing.assert_array_equal(ps.pull_rows(name, [1, 2]), np.zeros((2, DIM)))
        with pytest.raises(ConflictError, match="dim"):
            ps.create_table(name, DIM + 1, initializer=Zeros())
        with pytest.raises(UnknownVariableError):
            ps.pull_rows(fresh("t"), [1])
        var = fresh("v")
        ps.init({var: np.zeros(3)})
        with pytest.raises(ConflictError, match="dense variable"):
            ps.create_table(var, DIM)
        with pytest.raises(ConflictError, match="embedding table"):
            ps.pull([name])


def test_async_client(fleets):
    _, three = fleets
    name = fresh("t")

    async def run() -> np.ndarray:
        async with AsyncPSClient(three.urls, worker_id=fresh("w")) as ps:
            await ps.create_table(name, DIM, initializer=Zeros(), optimizer=SGD(lr=1.0))
            await ps.push_rows(name, [1, 2, 1], np.ones((3, DIM), np.float32))
            return await ps.pull_rows(name, [2, 1])

    rows = asyncio.run(run())
    np.testing.assert_array_equal(rows, [[-1.0] * DIM, [-2.0] * DIM])


def test_rows_and_slots_come_back_after_kill_9(fleet_factory):
    fleet = fleet_factory(2, "--snapshot-interval", "0.2", data=True)
    name = fresh("t")
    pushes = batches(6, seed=5)
    opt = Adam(lr=0.05)
    with PSClient(fleet.urls, worker_id=fresh("w"), retry_deadline=60) as ps:
        ps.create_table(name, DIM, optimizer=opt)
        for ids, grads in pushes[:3]:
            ps.push_rows(name, ids, grads)
        every = np.array(sorted(reference(TableSpec(dim=DIM, optimizer=opt), name, pushes)))
        held = ps.pull_rows(name, every)
        versions = [http_json(f"{u}/v1/tables/{name}")["version"] for u in fleet.urls]
        state = http_json(f"{fleet.urls[0]}/v1/cluster")["state_version"]
        eventually(lambda: _snapshot_holds(fleet.urls[0], state), "a snapshot of the pushes")
        fleet.kill(0)
        fleet.start(0)
        np.testing.assert_array_equal(ps.pull_rows(name, every), held)
        info = http_json(f"{fleet.urls[0]}/v1/tables/{name}")
        assert info["version"] == versions[0] and info["rows"] > 0
        # the slots and per-row step counts came back too: later pushes match the reference
        for ids, grads in pushes[3:]:
            ps.push_rows(name, ids, grads)
        expected = reference(TableSpec(dim=DIM, optimizer=opt), name, pushes)
        np.testing.assert_allclose(
            ps.pull_rows(name, every),
            np.stack([expected[int(i)] for i in every]),
            rtol=1e-5,
            atol=1e-6,
        )


def _snapshot_holds(url: str, state_version: int) -> bool:
    last = http_json(f"{url}/v1/cluster").get("last_snapshot") or {}
    return last.get("state_version", -1) >= state_version


def test_shards_without_embedding_tables_are_named(fleets):
    _, three = fleets
    transport = AsIfOlder(False, drop_features=("embedding_tables",))
    with PSClient(three.urls, worker_id=fresh("w"), transport=transport) as ps:
        for call in (
            lambda: ps.create_table(fresh("t"), DIM),
            lambda: ps.pull_rows(fresh("t"), [1]),
            lambda: ps.push_rows(fresh("t"), [1], np.ones((1, DIM))),
        ):
            with pytest.raises(ProtocolError, match="upgrade") as info:
                call()
            assert info.value.shard == three.urls[0]


def test_many_repeats_of_one_id_are_summed(fleets):
    one, _ = fleets
    name = fresh("t")
    with PSClient(one.urls, worker_id=fresh("w")) as ps:
        ps.create_table(name, DIM, initializer=Zeros(), optimizer=SGD(lr=1.0))
        ids = np.array([4] * 100 + [5] * 3, np.int64)
        grads = np.random.default_rng(2).standard_normal((103, DIM)).astype(np.float32)
        assert ps.push_rows(name, ids, grads)["rows"] == 2
        got = ps.pull_rows(name, [4, 5])
    want = -np.stack([grads[:100].astype(np.float64).sum(0), grads[100:].astype(np.float64).sum(0)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rows_over_several_shards_in_any_order_with_repeats_and_an_empty_shard(fleets):
    """On 3 shards: pushes and pulls of ids given in any order, with repeats, whose rows lie on
    two of the shards (the third has no part of the request), and then on all three; each
    pulled row is the one pushed to its own id (SGD lr 1 from zeros: minus the sum of its
    gradients), in the order the ids were given."""
    _, three = fleets
    name = fresh("t")
    rng = np.random.default_rng(5)
    candidates = rng.integers(-(2**62), 2**62, size=400, dtype=np.int64)
    placed = row_shard(name, candidates, 3)
    two = candidates[placed != 2][:30]  # rows on shards 0 and 1 only
    assert set(row_shard(name, two, 3).tolist()) == {0, 1}
    with PSClient(three.urls, worker_id=fresh("w")) as ps:
        ps.create_table(name, DIM, initializer=Zeros(), optimizer=SGD(lr=1.0))
        want: dict[int, np.ndarray] = {}
        for pool in (two, candidates[:60]):
            ids = rng.choice(pool, size=3 * len(pool))  # shuffled, each id about 3 times
            grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
            ps.push_rows(name, ids, grads)
            for i, g in zip(ids.tolist(), grads.astype(np.float64)):
                want[i] = want.get(i, np.zeros(DIM)) - g
            asked = rng.permutation(np.concatenate([pool, pool[:7], pool[::-4]]))
            got = ps.pull_rows(name, asked)
            expected = np.stack([want.get(i, np.zeros(DIM)) for i in asked.tolist()])
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
