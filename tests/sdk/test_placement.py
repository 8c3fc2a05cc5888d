"""Placement (client_sdk/placement.py, docs/PROTOCOL.md §1): the documented test vectors, an
independent implementation of the documented steps, balance, consistency when a fleet grows,
and argument checking."""

from __future__ import annotations

import hashlib
import re
import struct
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client_sdk.placement import (
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    jump_hash,
    name_key,
    shard_for,
    validate_name,
)
from tests.conftest import ROOT

PROTOCOL = ROOT / "docs" / "PROTOCOL.md"


def _doc_vectors() -> list[tuple[str, str, dict[int, int]]]:
    """The test-vector table of PROTOCOL.md §1: (name, key hex, {N: shard})."""
    lines = PROTOCOL.read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| name | key (hex) |"))
    counts = [int(c) for c in re.findall(r"\d+", lines[head].split("|", 3)[3])]
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[1], dict(zip(counts, map(int, cells[2:]), strict=True))))
    return rows


VECTORS = _doc_vectors()


def test_the_doc_has_vectors():
    assert len(VECTORS) >= 5
    assert all(len(shards) >= 7 for _, _, shards in VECTORS)


@pytest.mark.parametrize(("name", "key_hex", "shards"), VECTORS, ids=[v[0] for v in VECTORS])
def test_documented_vectors(name, key_hex, shards):
    assert f"{name_key(name):016x}" == key_hex
    for n, shard in shards.items():
        assert shard_for(name, n) == shard, f"{name!r} with N={n}"


# An implementation of PROTOCOL.md §1 written from the prose, not from placement.py.
def _doc_key(name: str) -> int:
    (key,) = struct.unpack("<Q", hashlib.blake2b(name.encode(), digest_size=8).digest()[:8])
    return key


def _doc_jump(key: int, n: int) -> int:
    b, j = -1, 0
    while j < n:
        b = j
        key = (key * 2862933555777941757 + 1) % 2**64
        j = int((b + 1) * (2.0**31 / ((key >> 33) + 1)))
    return b


@given(st.from_regex(NAME_PATTERN, fullmatch=True), st.integers(1, 2**31))
def test_matches_the_documented_algorithm(name, n):
    assert name_key(name) == _doc_key(name)
    assert shard_for(name, n) == _doc_jump(_doc_key(name), n)
    assert 0 <= shard_for(name, n) < n


@given(st.integers(0, 2**64 - 1), st.integers(1, 10_000))
def test_jump_hash_range_and_reference(key, n):
    b = jump_hash(key, n)
    assert 0 <= b < n
    assert b == _doc_jump(key, n)
    assert jump_hash(key, 1) == 0


def realistic_names(count: int) -> list[str]:
    """Names shaped like a model's variables: layers, blocks, slots, partitions."""
    names: list[str] = []
    i = 0
    kinds = ("kernel", "bias", "gamma", "beta", "moving_mean", "moving_variance")
    while len(names) < count:
        names.append(f"layer{i}/{kinds[i % len(kinds)]}")
        names.append(f"block{i // 8}/conv{i % 8}/weights:0")
        names.append(f"emb/part-{i}")
        names.append(f"tower_{i % 4}.dense_{i}.w")
        i += 1
    return names[:count]


NAMES = realistic_names(20_000)


def test_realistic_names_are_valid_and_distinct():
    assert len(set(NAMES)) == len(NAMES)
    for name in NAMES[:200]:
        validate_name(name)


BALANCE_TOLERANCE = 0.12  # every shard within 12% of the mean (about 4 sigma at N=16)


@pytest.mark.parametrize("n", range(2, 17))
def test_balance(n):
    counts = Counter(shard_for(name, n) for name in NAMES)
    assert sorted(counts) == list(range(n))
    mean = len(NAMES) / n
    worst = max(abs(c - mean) / mean for c in counts.values())
    assert worst <= BALANCE_TOLERANCE, (n, dict(counts))


@pytest.mark.parametrize("n", range(1, 17))
def test_growing_the_fleet_moves_names_only_onto_the_new_shard(n):
    before = [shard_for(name, n) for name in NAMES]
    after = [shard_for(name, n + 1) for name in NAMES]
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert all(b == n for _, b in moved)  # nothing moves between the old shards
    expected = len(NAMES) / (n + 1)
    assert abs(len(moved) - expected) <= 0.12 * expected, (len(moved), expected)


@given(st.from_regex(NAME_PATTERN, fullmatch=True), st.integers(1, 64), st.integers(1, 64))
def test_monotone_over_any_growth(name, n, extra):
    """Going from N to M > N shards, a name either stays or lands on one of the new shards."""
    a, b = shard_for(name, n), shard_for(name, n + extra)
    assert b == a or b >= n


@settings(max_examples=200)
@given(st.from_regex(NAME_PATTERN, fullmatch=True))
def test_valid_names_are_accepted(name):
    assert validate_name(name) is name


@pytest.mark.parametrize(
    "name",
    [
        "w",
        "global_step",
        "layer1/kernel",
        "a.b:c-d_e/f",
        "x" * MAX_NAME_LENGTH,
        "0",
        "-",
        "emb/part-12",
    ],
)
def test_edge_names_are_accepted(name):
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "x" * (MAX_NAME_LENGTH + 1),
        "a b",
        "w\n",
        "\nw",
        "w\x00",
        "caf\u00e9",
        "a*b",
        "a#b",
        "a\\b",
        "a?b",
        "a%2Fb",
        "a,b",
        "\u0661",
        "w\t",
        "a+b",
        "a=b",
        "a@b",
    ],
)
def test_bad_names_are_rejected(name):
    with pytest.raises(ValueError, match="A-Z a-z 0-9") as info:
        validate_name(name)
    assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize("name", [None, 1, 1.5, b"w", ["w"], {"w": 1}, True])
def test_non_string_names_are_rejected(name):
    with pytest.raises(ValueError, match="strings"):
        validate_name(name)
    with pytest.raises(TypeError):
        shard_for(name, 2)


@given(st.text(max_size=300))
def test_validate_name_agrees_with_the_documented_pattern(text):
    ok = re.fullmatch(r"[A-Za-z0-9_.:/-]{1,256}", text) is not None
    if ok:
        assert validate_name(text) == text
    else:
        with pytest.raises(ValueError):
            validate_name(text)


@pytest.mark.parametrize("n", [0, -1, -(2**70)])
def test_jump_hash_needs_at_least_one_bucket(n):
    with pytest.raises(ValueError, match="num_buckets"):
        jump_hash(5, n)
    with pytest.raises(ValueError):
        shard_for("w", n)


@pytest.mark.parametrize("n", [1.5, 2.0, "3", None, True, False])
def test_jump_hash_bucket_count_must_be_an_int(n):
    with pytest.raises(TypeError):
        jump_hash(5, n)
    with pytest.raises(TypeError):
        shard_for("w", n)


@pytest.mark.parametrize("key", [-1, 2**64, 2**70])
def test_jump_hash_key_is_unsigned_64_bit(key):
    with pytest.raises(ValueError, match="64-bit"):
        jump_hash(key, 4)


@pytest.mark.parametrize("key", [1.0, "5", None, True, b"\x05"])
def test_jump_hash_key_must_be_an_int(key):
    with pytest.raises(TypeError):
        jump_hash(key, 4)


def test_jump_hash_edges():
    assert jump_hash(0, 1) == 0 and jump_hash(2**64 - 1, 1) == 0
    assert 0 <= jump_hash(2**64 - 1, 2**40) < 2**40
