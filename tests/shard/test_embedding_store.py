"""server.embedding without HTTP: the id -> row map against a dict under random inserts
(growth, rebuild, any int64 id) and along long probe runs, and a table's update refusing whole
(limits, overflow)."""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk.embedding import TableSpec
from client_sdk.optimizers import SGD, Ftrl
from server.embedding import EmbeddingTable
from server.embedding.index import WINDOW, IdIndex
from server.errors import ShardError


def test_index_is_a_map_from_any_id_to_its_row():
    rng = np.random.default_rng(0)
    index, model = IdIndex(), {}
    for _ in range(40):
        batch = np.unique(rng.integers(-(2**63), 2**63 - 1, 700, dtype=np.int64))
        batch = np.concatenate([batch, rng.integers(-50, 50, 200)])  # small ids collide often
        batch = np.array([i for i in dict.fromkeys(batch.tolist()) if i not in model], np.int64)
        rows = index.add(batch)
        for i, r in zip(batch.tolist(), rows.tolist()):
            model[i] = r
        probe = np.concatenate([batch[:50], rng.integers(-100, 100, 100), [2**63 - 1, -(2**63)]])
        want = [model.get(int(i), -1) for i in probe]
        assert index.lookup(probe).tolist() == want
    assert len(index) == len(model) and sorted(model.values()) == list(range(len(model)))
    keep = np.array(list(model)[::3], np.int64)
    index.rebuild(keep)
    assert index.lookup(keep).tolist() == list(range(len(keep)))
    assert (index.lookup(np.array(list(model)[1::3], np.int64)) == -1).all()


def test_index_finds_ids_at_the_end_of_long_probe_runs():
    """Ids sharing one first slot make a run longer than a lookup's windows (index.WINDOW):
    each is found, and an absent id of that slot walks the whole run to say so."""
    index = IdIndex()
    candidates = np.arange(1, 200_000, dtype=np.int64) * 7919
    homes = index._home(candidates)
    slot = np.bincount(homes).argmax()
    same = candidates[homes == slot]
    assert len(same) > 4 * WINDOW + 2
    stored, absent = same[: 4 * WINDOW], same[4 * WINDOW :]
    others = candidates[homes != slot][:300]
    index.add(np.concatenate([others[:150], stored, others[150:]]))
    rows = index.lookup(np.concatenate([stored[::-1], absent, others]))
    assert rows.tolist() == [
        *range(150 + len(stored) - 1, 149, -1),
        *[-1] * len(absent),
        *range(150),
        *range(150 + len(stored), 300 + len(stored)),
    ]


def test_an_update_is_refused_whole():
    table = EmbeddingTable("t", TableSpec(dim=2, optimizer=SGD(lr=1e6)), max_rows=3)
    assert table.update(np.array([1, 2], np.int64), np.ones((2, 2), np.float32)) == (2, 0)
    before = table.arrays()
    with pytest.raises(ShardError) as info:
        table.update(np.array([3, 4], np.int64), np.ones((2, 2), np.float32))
    assert info.value.code == "too_large"
    with pytest.raises(ShardError) as info:
        table.update(np.array([1, 3], np.int64), np.full((2, 2), 1e36, np.float32))
    assert info.value.code == "bad_tensor"
    after = table.arrays()
    assert len(table) == 2 and table.version == 1
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


def test_new_rows_start_with_each_slots_own_first_value():
    table = EmbeddingTable(
        "f", TableSpec(dim=2, optimizer=Ftrl(lr=0.1, initial_accumulator_value=0.3)), 10
    )
    table.update(np.array([7], np.int64), np.zeros((1, 2), np.float32))
    arrays = table.arrays()
    np.testing.assert_allclose(arrays["slot.accumulator"], 0.3)
    np.testing.assert_allclose(arrays["slot.linear"], 0.0)
