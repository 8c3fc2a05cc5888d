"""The store keeps Python's cycle collector off the variables it holds
(server/store/collector.py): after every `Freezer.every` variables made, what the shard holds
goes to the collector's permanent generation, which no full collection walks; a delete hands
it back, so that a variable let go is collected even when caught in a reference cycle.

In process, on a store of its own (the collector is the process's: each test unfreezes what it
froze). Small `every` so that a few variables stand for thousands.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from server.store import ParameterStore


@pytest.fixture
def store():
    s = ParameterStore(0, 1)
    s.collector.every = 16
    yield s
    gc.unfreeze()


def _init(store, prefix: str, count: int) -> None:
    store.init({f"{prefix}/{i}": (np.zeros(3, np.float32), None, None) for i in range(count)})


def _in_full_collections(obj) -> bool:
    """Whether a full collection walks ``obj`` (it is in one of the three generations)."""
    return any(o is obj for gen in range(3) for o in gc.get_objects(gen))


def test_variables_made_leave_the_collectors_generations(store):
    gc.unfreeze()
    _init(store, "few", 15)  # fewer than `every`: nothing frozen yet
    assert store.collector.freezes == 0 and gc.get_freeze_count() == 0
    _init(store, "more", 2)
    assert store.collector.freezes == 1 and gc.get_freeze_count() > 0
    var = store.get("more/0")
    assert not _in_full_collections(var) and not _in_full_collections(var.training)
    pushed = store.push("w", 1, {"few/0": np.ones(3, np.float32)})
    assert pushed["few/0"]["status"] == "applied"  # frozen variables work as before


def test_a_deleted_variable_is_collected_though_a_cycle_holds_it(store):
    _init(store, "gone", 16)
    var = store.get("gone/3")
    var.trap = [var]  # a reference cycle through the variable
    alive = weakref.ref(var)
    del var
    assert gc.get_freeze_count() > 0
    result = asyncio.run(store.delete("w", 1, names=[f"gone/{i}" for i in range(16)]))
    assert len(result["deleted"]) == 16
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
