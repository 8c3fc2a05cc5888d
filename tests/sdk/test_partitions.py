"""client_sdk.partitions: the rows of each part, the automatic count, and layouts checked.

These are the rules docs/PROTOCOL.md §3 (Partitioned variables) states for any client: part i
of n rows in k parts holds n // k rows, one more for the first n % k; the parts, in order, are
the whole variable; ``--partition-bytes`` gives the fewest parts of at most that size.
"""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk.partitions import Layout, LayoutError, auto_partitions, part_name, part_rows


@pytest.mark.parametrize(
    "rows, parts, expected",
    [(10, 3, [4, 3, 3]), (11, 3, [4, 4, 3]), (12, 3, [4, 4, 4]), (2, 2, [1, 1]), (7, 7, [1] * 7)],
)
def test_part_rows_follow_the_documented_rule(rows, parts, expected):
    assert part_rows(rows, parts) == expected


def test_the_parts_are_the_whole_variable_in_order_as_views():
    layout = Layout.make("emb", np.dtype(np.float32), (11, 3), 4)
    value = np.arange(33, dtype=np.float32).reshape(11, 3)
    pieces = layout.split(value)
    assert [p.shape for p in pieces] == layout.part_shapes() == [(3, 3), (3, 3), (3, 3), (2, 3)]
    assert all(np.shares_memory(p, value) for p in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces), value)
    assert (
        layout.part_names()
        == [part_name("emb", i) for i in range(4)]
        == [
            "emb/part-0",
            "emb/part-1",
            "emb/part-2",
            "emb/part-3",
        ]
    )


@pytest.mark.parametrize(
    "shape, itemsize, limit, expected",
    [
        ((1000, 16), 4, 0, 1),  # off
        ((1000, 16), 4, 64_000, 1),  # exactly the bound: one part
        ((1000, 16), 4, 63_999, 2),
        ((1000, 16), 4, 1024, 63),
        ((3, 1 << 20), 4, 1024, 3),  # at most one part per row
        ((), 8, 1024, 1),  # a scalar is never split
        ((1, 1 << 20), 4, 1024, 1),
    ],
)
def test_auto_partitions_gives_the_fewest_parts_within_the_bound(shape, itemsize, limit, expected):
    assert auto_partitions(shape, itemsize, limit) == expected


@pytest.mark.parametrize(
    "entry, field",
    [
        ({"partitions": 1, "dtype": "<f4", "shape": [4]}, "partitions"),
        ({"partitions": 0, "dtype": "<f4", "shape": [4]}, "partitions"),
        ({"partitions": 5, "dtype": "<f4", "shape": [4]}, "partitions"),
        ({"partitions": 2, "dtype": "<f4", "shape": []}, "partitions"),
        ({"partitions": 2.0, "dtype": "<f4", "shape": [4]}, "partitions"),
        ({"partitions": 2, "dtype": "object", "shape": [4]}, "dtype"),
        ({"partitions": 2, "dtype": "<f4", "shape": [4, "2"]}, "shape"),
        ({"partitions": 2, "dtype": "<f4", "shape": 4}, "shape"),
        ([2, "<f4", [4]], "partitions"),
    ],
)
def test_a_bad_layout_names_its_field(entry, field):
    with pytest.raises(LayoutError) as err:
        Layout.from_wire("w", entry)
    assert err.value.field == field


def test_a_layout_round_trips_its_wire_form():
    layout = Layout.from_wire("w", {"partitions": 3, "dtype": "<f8", "shape": [9, 2, 2]})
    assert layout == Layout("w", "<f8", (9, 2, 2), 3)
    assert Layout.from_wire("w", layout.to_wire()) == layout
