"""Admission and eviction inside one table (server/embedding/admission.py, the hooks in
server/embedding/table.py), without HTTP: replaying the same pushes gives the same table,
eviction never takes a row its push updates, a refused update changes no count, and the
pending counts forget the least recently pushed ids first."""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk.embedding import Admission, TableSpec, Zeros
from client_sdk.optimizers import SGD, Adagrad
from server.embedding import admission
from server.embedding.table import EmbeddingTable
from server.errors import ShardError


def pushes(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        ids = np.unique(rng.integers(0, 300, 40))
        yield ids, rng.normal(size=(len(ids), 8)).astype(np.float32)


def table(**rules) -> EmbeddingTable:
    spec = TableSpec(8, optimizer=Adagrad(lr=0.1), admission=Admission(**rules))
    return EmbeddingTable("t", spec, 1 << 20, max_pending=64)


def test_replaying_the_same_pushes_gives_the_same_rows_counts_and_evictions():
    a, b = table(min_count=2, ttl=20, max_rows=100), table(min_count=2, ttl=20, max_rows=100)
    for ids, grads in pushes(200):
        a.update(ids, grads)
    for ids, grads in pushes(200):
        b.update(ids, grads)
    assert a.evicted > 0 and a.pending.forgotten > 0 and len(a) <= 100
    left, right = a.arrays(), b.arrays()
    assert left.keys() == right.keys()
    for key in left:
        assert np.array_equal(left[key], right[key]), key
    assert (a.admitted, a.evicted, a.version) == (b.admitted, b.evicted, b.version)


def test_a_restored_table_goes_on_as_the_original():
    a = table(min_count=2, ttl=20, max_rows=100)
    stream = list(pushes(120))
    for ids, grads in stream[:60]:
        a.update(ids, grads)
    b = EmbeddingTable.restored("t", a.spec, 1 << 20, a.meta(), a.arrays(), max_pending=64)
    for ids, grads in stream[60:]:
        a.update(ids, grads)
        b.update(ids, grads)
    for key, value in a.arrays().items():
        assert np.array_equal(value, b.arrays()[key]), key
    assert (a.admitted, a.evicted, a.pending.forgotten) == (
        b.admitted,
        b.evicted,
        b.pending.forgotten,
    )


def test_eviction_spares_the_rows_of_the_push_that_needs_room():
    t = EmbeddingTable(
        "t",
        TableSpec(2, initializer=Zeros(), optimizer=SGD(lr=1.0), admission=Admission(max_rows=16)),
        1 << 20,
    )
    t.update(np.arange(8), np.ones((8, 2), np.float32))  # update 1
    t.update(np.arange(8, 16), np.ones((8, 2), np.float32))  # update 2: 8..15 are newer
    ids = np.concatenate([np.arange(8), np.arange(100, 104)])
    created, _ = t.update(ids, np.ones((12, 2), np.float32))
    # room for 4 new rows + 16 // 16: five rows go, the least recent outside the push: of 8..15
    assert created == 4 and t.evicted == 5 and len(t) == 15
    rows = t.gather(ids)
    assert np.all(rows[:8] == -2) and np.all(rows[8:] == -1)
    assert int(np.count_nonzero(t.index.lookup(np.arange(8, 16)) >= 0)) == 3
    # a push whose own rows fill the table leaves nothing to evict: refused, nothing changed
    with pytest.raises(ShardError, match=r"admission\.max_rows"):
        t.update(np.arange(200, 217), np.ones((17, 2), np.float32))
    assert len(t) == 15 and t.evicted == 5


def test_a_refused_update_changes_no_count():
    t = EmbeddingTable(
        "t",
        TableSpec(
            2,
            initializer=Zeros(),
            optimizer=SGD(lr=10.0),
            admission=Admission(min_count=2, max_rows=4),
        ),
        1 << 20,
    )
    t.update(np.array([1, 2]), np.ones((2, 2), np.float32))
    t.update(np.array([1]), np.ones((1, 2), np.float32))  # 1 admitted
    before = {k: v.copy() for k, v in t.arrays().items()}
    state = (t.version, t.admitted, t.evicted, len(t.pending))
    huge = np.full((2, 2), 3e38, np.float32)  # 0 - 10 * 3e38 overflows float32
    with pytest.raises(ShardError):
        t.update(np.array([1, 2]), huge)
    assert (t.version, t.admitted, t.evicted, len(t.pending)) == state
    for key, value in t.arrays().items():
        assert np.array_equal(value, before[key]), key


def test_pending_counts_forget_the_least_recently_pushed_first():
    p = admission.PendingCounts(32)
    for tick in range(1, 5):  # ids 0..9 at tick 1, 10..19 at 2, ...
        ids = np.arange(10 * (tick - 1), 10 * tick)
        where, after = p.counted(ids)
        p.commit(ids, where, after, np.zeros(len(ids), bool), tick)
    kept = set(p.arrays()["pending.ids"].tolist())
    assert len(p) == 30 and p.forgotten == 10  # 32 * 15 // 16 = 30 kept of 40
    assert kept == set(range(10, 40))
    where, after = p.counted(np.array([5, 15]))
    assert where[0] == -1 and after.tolist() == [1, 2]
