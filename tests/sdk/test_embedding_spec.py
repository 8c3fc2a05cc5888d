"""client_sdk.embedding and row placement: the spec's checks, the initializer's rows and the
placement of rows against docs/PROTOCOL.md §1's test vectors, the vectorized jump hash against
the scalar one, and the sum of repeated ids' gradients."""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk.embedding import (
    Constant,
    Normal,
    TableSpec,
    Uniform,
    Zeros,
    initial_rows,
    segment_sum,
    segment_sums,
    spec_from_wire,
)
from client_sdk.optimizers import SGD, Adam, Cosine, SpecError
from client_sdk.placement import jump_hash, jump_hash_array, row_keys, row_shard, rows_on

VECTORS = {  # docs/PROTOCOL.md §1, table "emb": id -> (row_key, shard for N=1, 2, 3, 4, 8, 100)
    0: (0x1C8DFF301EFC0E0C, (0, 1, 1, 1, 1, 32)),
    1: (0x0B9BA28B70AEF6F0, (0, 0, 2, 2, 4, 30)),
    -1: (0x5B0F30120CB1D013, (0, 0, 0, 0, 4, 52)),
    42: (0xD0F6ACAAC61593FE, (0, 1, 1, 3, 6, 80)),
    2**63 - 1: (0x6F6F6CFB37F6F501, (0, 1, 1, 1, 1, 18)),
}


def test_row_placement_matches_the_documented_vectors():
    ids = np.array(list(VECTORS), np.int64)
    assert [int(k) for k in row_keys("emb", ids)] == [v[0] for v in VECTORS.values()]
    for col, n in enumerate((1, 2, 3, 4, 8, 100)):
        assert row_shard("emb", ids, n).tolist() == [v[1][col] for v in VECTORS.values()]


def test_vectorized_jump_hash_is_the_scalar_one():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**63, 3000, dtype=np.int64).view(np.uint64) * np.uint64(2)
    keys[:3] = [0, 1, 2**64 - 1]
    # keys whose first step lands on each side of 2^63 (2 buckets: the top bit decides)
    inverse = pow(2862933555777941757, -1, 2**64)
    for i, stepped in enumerate((2**63 - 1, 2**63, 2**63 - 2**33, 2**63 + 2**33, 2**64 - 1)):
        keys[3 + i] = (stepped - 1) * inverse % 2**64
    for n in (1, 2, 3, 5, 17, 1000, 65536):
        assert jump_hash_array(keys, n).tolist() == [jump_hash(int(k), n) for k in keys]
    with pytest.raises(ValueError):
        jump_hash_array(keys, 0)


def test_rows_on_says_whether_every_row_is_on_the_shard():
    rng = np.random.default_rng(3)
    ids = np.concatenate(
        [list(VECTORS), rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64), [-(2**63)]]
    ).astype(np.int64)
    for n in (1, 2, 3, 5):
        owners = row_shard("emb", ids, n)
        for shard in range(n):
            mine = ids[owners == shard]
            assert rows_on("emb", mine, n, shard)
            assert rows_on("emb", ids, n, shard) == (n == 1)
            for one in ids[:40]:  # a single row: on its shard, on no other
                assert rows_on("emb", np.array([one]), n, shard) == (
                    row_shard("emb", np.array([one]), n)[0] == shard
                )
        assert rows_on("emb", ids[:0], n, n - 1)  # no rows: all of them are anywhere
    assert not rows_on("emb", ids[:1], 2, 2)  # no shard 2 of 2


def test_growing_a_fleet_moves_rows_only_to_the_new_shard():
    ids = np.arange(-5000, 5000, dtype=np.int64)
    before, after = row_shard("t", ids, 4), row_shard("t", ids, 5)
    moved = before != after
    assert set(after[moved].tolist()) == {4}
    assert 0.1 < moved.mean() < 0.3


def test_initial_rows_match_the_documented_vectors():
    uniform = initial_rows(TableSpec(dim=3), "emb", np.array([0, -1], np.int64))
    np.testing.assert_array_equal(
        uniform,
        np.array(
            [
                [-0.040265575, -0.010246516, -0.0027227041],
                [-0.031450234, 0.014551453, -0.037265994],
            ],
            np.float32,
        ),
    )
    normal = initial_rows(
        TableSpec(dim=3, initializer=Normal(std=1.0), seed=7), "emb", np.array([1], np.int64)
    )
    np.testing.assert_allclose(normal, [[-1.5649287, -0.42697096, -0.10121254]], rtol=1e-6)


def test_initial_rows_are_a_function_of_the_id_alone():
    spec = TableSpec(dim=5, initializer=Normal(std=0.5, mean=1.0), seed=3)
    ids = np.array([9, -9, 2**62, 9], np.int64)
    rows = initial_rows(spec, "x", ids)
    np.testing.assert_array_equal(rows[0], rows[3])
    np.testing.assert_array_equal(rows[1:2], initial_rows(spec, "x", ids[1:2]))
    assert not np.array_equal(
        rows,
        initial_rows(TableSpec(dim=5, initializer=Normal(std=0.5, mean=1.0), seed=4), "x", ids),
    )
    assert not np.array_equal(rows, initial_rows(spec, "y", ids))
    many = initial_rows(TableSpec(dim=16, initializer=Uniform(-1, 3)), "u", np.arange(4000))
    assert many.min() >= -1 and many.max() < 3 and abs(many.mean() - 1) < 0.05
    normal = initial_rows(TableSpec(dim=16, initializer=Normal(std=2.0)), "n", np.arange(4000))
    assert abs(normal.std() - 2) < 0.05 and abs(normal.mean()) < 0.05
    assert not initial_rows(TableSpec(dim=2, initializer=Zeros()), "z", np.arange(3)).any()
    assert (
        initial_rows(TableSpec(dim=2, initializer=Constant(0.5)), "c", np.arange(3)) == 0.5
    ).all()


def test_spec_checks_name_the_field():
    for kwargs, field in (
        ({"dim": 0}, "dim"),
        ({"dim": 65537}, "dim"),
        ({"dim": 2.0}, "dim"),
        ({"dim": 2, "dtype": "float64"}, "dtype"),
        ({"dim": 2, "seed": -1}, "seed"),
        ({"dim": 2, "optimizer": Adam(lr=0.1, schedule=Cosine(total=10))}, "optimizer.schedule"),
        ({"dim": 2, "initializer": "zeros"}, "initializer"),
    ):
        with pytest.raises(SpecError) as info:
            TableSpec(**kwargs)
        assert info.value.field == field
    with pytest.raises(SpecError) as info:
        Uniform(1, 0)
    assert info.value.field == "high"
    with pytest.raises(SpecError) as info:
        spec_from_wire({"dim": 2, "initializer": {"type": "normal", "std": -1}})
    assert info.value.field == "initializer.std"
    with pytest.raises(SpecError) as info:
        spec_from_wire({"dim": 2, "optimizer": {"type": "sgd", "lr": -1}})
    assert info.value.field == "optimizer.lr"
    spec = TableSpec(
        dim=4, dtype=np.float32, initializer=Normal(std=0.1), optimizer=SGD(lr=1), seed=5
    )
    assert spec_from_wire(spec.to_wire()) == spec


def test_segment_sum_adds_repeats_in_the_order_given():
    ids = np.array([5, 3, 5, -1, 3, 5], np.int64)
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    unique, summed = segment_sum(ids, grads)
    assert unique.tolist() == [-1, 3, 5]
    np.testing.assert_array_equal(summed, [[6, 7], [2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11]])
    same = np.array([1, 2, 3], np.int64)
    np.testing.assert_array_equal(segment_sum(same, grads[:3])[1], grads[:3])


def test_segment_sum_is_the_sum_in_order_bit_for_bit():
    # Ids repeated 1 to 9 times (several levels of repeats, unevenly), gradients of very
    # different sizes (float32 addition is not associative there): each id's sum is
    # first + second, + third, ... in the order given, exactly.
    rng = np.random.default_rng(7)
    ids = np.repeat(rng.choice(10**9, 60, replace=False), rng.integers(1, 10, 60))
    rng.shuffle(ids)
    grads = rng.standard_normal((len(ids), 3)) * 10.0 ** rng.integers(-4, 8, (len(ids), 1))
    grads = grads.astype(np.float32)
    unique, summed = segment_sum(ids, grads)
    assert unique.tolist() == sorted(set(ids.tolist()))
    for k, i in enumerate(unique):
        rows = grads[ids == i]
        total = rows[0].copy()
        for row in rows[1:]:
            total += row
        np.testing.assert_array_equal(summed[k], total)


@pytest.mark.parametrize(
    "ids",
    [
        [3, 8, 20, 41],  # distinct and sorted: the gradients as given
        [41, 3, 20, 8],  # distinct: the gradients in the order of ids
        [5, 3, 5, -1, 3, 5, 9, 9, 7],  # a few repeats: the level-major sums
        [4] * 70 + [1, 2, 1],  # more repeats than the levels: reduceat
    ],
)
def test_segment_sums_split_into_any_parts_are_segment_sums_bits(ids):
    # A push through several shards gathers each shard's sums from segment_sums' base: the
    # same bits as segment_sum's sums of those ids, for every part.
    ids = np.array(ids, np.int64)
    grads = np.random.default_rng(3).standard_normal((len(ids), 5)).astype(np.float32)
    unique, summed = segment_sum(ids, grads)
    got_unique, base, index = segment_sums(ids, grads)
    np.testing.assert_array_equal(got_unique, unique)
    every = np.arange(len(unique))
    for positions in (every, every[::2], every[-1:]):
        rows = np.take(base, positions if index is None else index[positions], axis=0)
        np.testing.assert_array_equal(rows.view(np.uint32), summed[positions].view(np.uint32))
