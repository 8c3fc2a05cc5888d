"""The shard's cache of narrowed values (server/narrowed.py) lends its float16 array to the
next version's narrowing only once nothing but the cache refers to it: a reply still sending
it holds it or a view of it (a memoryview, a slice), and then a new array is made.
End to end (a fleet pulling new versions in float16): tests/sdk/test_half_precision.py.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from client_sdk.wire import casts
from server.errors import ShardError
from server.narrowed import CACHE_FROM, NarrowedCache, narrow_pull
from server.store import PullRows


def test_the_kept_array_is_spare_only_when_nothing_else_refers_to_it():
    cache = NarrowedCache(1 << 20)
    value = np.zeros(1000, np.float32)
    kept = np.empty(1000, np.float16)
    cache.put("x", "float16", value, 1, kept, "<f2")
    held = [memoryview(kept), kept[10:], kept.reshape(10, 100), kept]
    while held:
        assert cache.spare("x", "float16", value) is None
        held.pop()
    del kept
    assert cache.spare("x", "float16", np.zeros(999, np.float32)) is None  # another shape
    assert cache.spare("x", "bfloat16", value) is None  # another dtype's entry
    spare = cache.spare("x", "float16", value)
    assert spare is not None and spare.shape == (1000,) and spare.dtype == np.float16
    stats = cache.stats()
    assert (stats["entries"], stats["bytes"], stats["reused"]) == (0, 0, 1)


def _rows(value: np.ndarray) -> PullRows:
    rows = PullRows(["x"])
    rows.versions, rows.values, rows.dtypes, rows.shapes = [1], [value], ["<f4"], [[value.size]]
    return rows


def test_a_value_the_store_bounds_within_float16s_range_is_narrowed_without_the_range_check(
    monkeypatch,
):
    """A big value whose bound (the store's, at least its largest magnitude) is within
    float16's range is cast without reading the cast again for infinities, to numpy's bits;
    one whose bound is beyond it (or unknown) is checked, and refused if it does not fit."""
    value = np.linspace(-65504, 65504, CACHE_FROM, dtype=np.float32)
    checked = []
    real = casts.to_float16

    def counting(src: np.ndarray, out: np.ndarray) -> bool:
        checked.append(src.size)
        return real(src, out)

    monkeypatch.setattr(casts, "to_float16", counting)
    for bound, looked in ((65504.0, False), (65520.0, True), (math.inf, True), (None, True)):
        checked.clear()
        rows = _rows(value)
        asked = None if bound is None else (lambda name, b=bound: b)
        assert asyncio.run(narrow_pull(rows, "float16", NarrowedCache(0), asked)) == [0]
        assert rows.dtypes == ["<f2"]
        assert np.array_equal(
            rows.values[0].view(np.uint16), value.astype(np.float16).view(np.uint16)
        )
        assert (sum(checked) == value.size) is looked, bound
    beyond = value.copy()
    beyond[-1] = 65520.0  # an infinity in float16
    with pytest.raises(ShardError, match="float16"):
        asyncio.run(narrow_pull(_rows(beyond), "float16", NarrowedCache(0), lambda name: math.inf))
