"""The store's step groups (server/store/groups.py) without HTTP: what a delete does to the
groups holding a deleted variable. The groups over HTTP and the SDK: tests/e2e/test_groups.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from server.errors import ShardError
from server.store import ParameterStore


def test_a_delete_makes_the_groups_holding_the_variable_let_go_of_it():
    """In the store itself: no group keeps a deleted variable (its memory) alive, whether or
    not the group is used again; the group is refused as stale."""
    store = ParameterStore(0, 1)
    store.init({n: (np.zeros(4, np.float32), None) for n in ("a", "b", "c")})
    kept = store.groups.register(store, ["a", "b"], 16, 1 << 20)
    other = store.groups.register(store, ["c"], 16, 1 << 20)
    asyncio.run(store.delete("w", 1, names=["b"]))
    assert kept.variables == [] and kept.gone == ["b"]
    assert len(other.variables) == 1
    with pytest.raises(ShardError) as refused:
        store.groups.get(store, kept.id)
    assert refused.value.code == "group_stale"
    assert store.groups.get(store, other.id) is other
