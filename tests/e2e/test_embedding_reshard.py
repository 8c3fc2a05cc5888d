"""Embedding tables (and a partitioned variable beside them) through a fleet checkpoint and
``paramshard reshard`` 2 -> 3 (issue 17's done-when): every row moves to
``row_shard(table, id, 3)`` with its value, optimizer slots, per-row step count and touch count,
and ids still waiting for admission move with their counts.

Checked twice: in the files (the new snapshots hold exactly the rows of the old ones, each on
its owner, every array equal row for row), and in behaviour (the 3-shard fleet started on the
new snapshots and the 2-shard fleet restarted on the old ones answer the same rows, and give
the same rows again after the same further pushes: Adam's per-row steps and moments, and the
admission counts, came across whole).
"""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk import PSClient
from client_sdk.embedding import Admission, Normal, TableSpec
from client_sdk.optimizers import Adagrad, Adam
from client_sdk.placement import row_shard
from server import persistence
from server.persistence.datadir import list_snapshots
from server.persistence.tables import read_table_arrays
from tests.helpers.reshard import reshard

TABLES = {
    "emb/adam": dict(optimizer=Adam(lr=0.05), initializer=Normal(std=0.1)),
    "emb/admitted": dict(optimizer=Adagrad(lr=0.1), admission=Admission(min_count=2)),
}
DIM = 6
#: A partitioned variable in the same checkpoint (issue 17's done-when: tables and partitioned
#: variables in one reshard).
PARTED = "dense/parted"


def _dense_grads(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(30, 4)).astype(np.float32) for _ in range(n)]


def _batches(seed: int, n: int):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, 300)  # any int64 ids
    for _ in range(n):
        ids = pool[rng.integers(0, len(pool), 64)]  # repeats within and across pushes
        yield ids, rng.normal(size=(len(ids), DIM)).astype(np.float32)


def _push(ps: PSClient, seed: int, n: int) -> None:
    for name in TABLES:
        for ids, grads in _batches(seed + hash(name) % 1000, n):
            ps.push_rows(name, ids, grads)


def _newest(data_dir) -> dict:
    """The tables of the newest snapshot in ``data_dir``: name -> (spec, entry, arrays)."""
    *_, (_, _, manifest) = list_snapshots(data_dir)
    return read_table_arrays(persistence.read_manifest(manifest))


def _union(tables: list[dict], name: str, pending: bool = False) -> dict[str, np.ndarray]:
    """Every shard's arrays of table ``name`` (its rows, or its pending ids), concatenated and
    sorted by id; ``age`` is each row's table version minus its last update."""
    arrays = [t[name][2] for t in tables]
    ids_key = "pending.ids" if pending else "ids"
    order = np.argsort(np.concatenate([a[ids_key] for a in arrays]), kind="stable")
    keys = [k for k in arrays[0] if k.startswith("pending.") == pending]
    out = {k: np.concatenate([a[k] for a in arrays])[order] for k in keys}
    if not pending:
        ages = [t[name][1]["version"] - t[name][2]["last_update"] for t in tables]
        out["age"] = np.concatenate(ages)[order]
    return out


def test_a_checkpoint_with_tables_resharded_2_to_3_keeps_every_row_and_slot(
    fleet_factory, tmp_path
):
    two = fleet_factory(2, "--snapshot-interval", "0", data=True)
    with PSClient(two.urls, worker_id="w") as ps:
        for name, spec in TABLES.items():
            ps.create_table(name, DIM, seed=3, **spec)
        ps.init({PARTED: np.zeros((30, 4), np.float32)}, optimizer=Adam(lr=0.05), partitions=3)
        _push(ps, 0, 12)
        for g in _dense_grads(0, 5):
            ps.push({PARTED: g})
        ps.checkpoint()
    for i in range(2):
        two.stop(i)
    old = [_newest(d) for d in two.data_dirs]
    run, dirs = reshard(two.data_dirs, tmp_path / "three", 3)
    assert "embedding table(s)" in run.stdout
    new = [_newest(d) for d in dirs]

    for name in TABLES:
        assert all(name in t for t in new)  # every new shard has every table
        for j, t in enumerate(new):  # each row, and each pending id, on its owner
            arrays = t[name][2]
            assert np.all(row_shard(name, arrays["ids"], 3) == j)
            assert np.all(row_shard(name, arrays["pending.ids"], 3) == j)
        before, after = _union(old, name), _union(new, name)
        assert before.keys() == after.keys() and len(before["ids"]) > 0
        for key in before:  # every array, row for row; last updates as ages
            if key != "last_update":
                np.testing.assert_array_equal(after[key], before[key], err_msg=f"{name} {key}")
        pend_before, pend_after = _union(old, name, True), _union(new, name, True)
        for key in ("pending.ids", "pending.counts"):
            np.testing.assert_array_equal(pend_after[key], pend_before[key], err_msg=key)
    assert len(_union(old, "emb/admitted", True)["pending.ids"]) > 0  # something pending

    # the same rows, and the same rows again after the same further pushes
    fleet3 = fleet_factory(3, data_dirs=dirs)
    for i in range(2):
        two.start(i)
    every = {name: _union(old, name)["ids"] for name in TABLES}
    pending = _union(old, "emb/admitted", True)["pending.ids"]
    with PSClient(two.urls, worker_id="w2") as a, PSClient(fleet3.urls, worker_id="w3") as b:
        for name, ids in every.items():
            np.testing.assert_array_equal(b.pull_rows(name, ids), a.pull_rows(name, ids))
        np.testing.assert_array_equal(b.pull([PARTED])[PARTED], a.pull([PARTED])[PARTED])
        _push(a, 1, 6)
        _push(b, 1, 6)
        for ps in (a, b):
            for g in _dense_grads(1, 3):
                ps.push({PARTED: g})
        np.testing.assert_array_equal(b.pull([PARTED])[PARTED], a.pull([PARTED])[PARTED])
        made = [
            ps.push_rows("emb/admitted", pending, np.ones((len(pending), DIM), np.float32))
            for ps in (a, b)
        ]
        assert made[0]["created"] == made[1]["created"] > 0  # the counts came across
        for name, ids in every.items():
            ids = np.concatenate([ids, pending])
            np.testing.assert_array_equal(b.pull_rows(name, ids), a.pull_rows(name, ids))


def test_tables_that_do_not_fit_together_are_refused():
    from server.embedding import reshard as moves

    def source(dim: int, n: int) -> dict:
        spec = TableSpec(dim)
        arrays = {
            "ids": np.arange(n, dtype=np.int64),
            "rows": np.zeros((n, dim), np.float32),
            "slot.accumulator": np.zeros((n, dim), np.float32),
            "steps": np.zeros(n, np.int64),
            "touches": np.zeros(n, np.int64),
            "last_update": np.zeros(n, np.int64),
        }
        return {"t": (spec, {"version": 1}, arrays)}

    assert len(moves.plan([source(4, 3), source(4, 5)], 3)["t"]) == 2
    with pytest.raises(ValueError, match="another spec"):
        moves.plan([source(4, 3), source(5, 3)], 3)
    bad = source(4, 3)
    bad["t"][2]["rows"] = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="'rows' missing or not"):
        moves.plan([bad], 3)
