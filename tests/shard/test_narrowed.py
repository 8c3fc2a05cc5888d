"""The shard's cache of narrowed values (server/narrowed.py) lends its float16 array to the
next version's narrowing only once nothing but the cache refers to it: a reply still sending
it holds it or a view of it (a memoryview, a slice), and then a new array is made.
End to end (a fleet pulling new versions in float16): tests/sdk/test_half_precision.py.
"""

from __future__ import annotations

import numpy as np

from server.narrowed import NarrowedCache


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
