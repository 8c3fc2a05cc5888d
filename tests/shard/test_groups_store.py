"""The store's step groups (server/store/groups.py) without HTTP: what a delete does to the
groups holding a deleted variable; a group push taken whole equals a push by name. The groups
over HTTP and the SDK: tests/e2e/test_groups.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from server.errors import ShardError
from server.store import ParameterStore, finite_rows
from server.store.groups import GroupVersions, RowsApplied


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


def _group_push(store, group, seq, flat, held=None, hinted=True):
    """A group push as the shard's routes make it (server/routes_groups.py), with the group
    as the store's hint or without it (each gradient looked up and checked)."""
    grads, block = group.split(flat)
    versions = None if held is None else GroupVersions(group, np.array(held, np.int64))
    finite = finite_rows(group.names, block) if block is not None else {}
    return store.push(
        "w", seq, grads, versions, finite=finite, block=block, group=group if hinted else None
    )


@pytest.mark.parametrize("shapes", [[(3,)] * 4, [(3,), (2, 2), (1,), (5,)]], ids=["rows", "mixed"])
def test_a_group_push_with_its_group_does_what_a_push_by_name_does(shapes):
    """The store takes a current group's gradients without looking at them one by one: its
    answer, the versions, values and the workers' staleness figures equal those of the same
    pushes made by name on a twin store (a refusal included: an integer group gets 422)."""
    names = [f"v{i}" for i in range(len(shapes))]
    stores, groups = [], []
    for _ in range(2):
        store = ParameterStore(0, 1)
        store.init(
            {
                n: (np.arange(np.prod(s), dtype=np.float32).reshape(s), None)
                for n, s in zip(names, shapes)
            }
        )
        store.init({"i": (np.zeros(2, np.int32), None), "j": (np.zeros(2, np.int32), None)})
        stores.append(store)
        groups.append(store.groups.register(store, names, 16, 1 << 20))
    size = sum(int(np.prod(s)) for s in shapes)
    answers = []
    for (store, group), hinted in zip(zip(stores, groups), (True, False)):
        got = []
        for seq, held in enumerate([None, [0] * len(names), [0, 1, 0, 2][: len(names)]], 1):
            flat = np.full(size, 0.5 * seq, np.float32)
            result = _group_push(store, group, seq, flat, held, hinted)
            assert isinstance(result, RowsApplied) is hinted  # the group's way was taken
            got.append({name: dict(entry) for name, entry in result.items()})
        got.append(_group_push(store, group, 2, np.ones(size, np.float32), None, hinted))
        ints = store.groups.register(store, ["i", "j"], 16, 1 << 20)
        with pytest.raises(ShardError) as refused:
            _group_push(store, ints, 9, np.ones(4, np.int32), None, hinted)
        got.append(refused.value.code)
        got.append({n: (v.version, v.value.tolist()) for n, v in store._vars.items()})
        totals = store.dedup.totals
        got.append((totals.pushes, totals.staleness, totals.staleness_sum, totals.gradients))
        answers.append(got)
    assert answers[0] == answers[1]
    assert answers[0][2]["v0"]["staleness"] == 2 and answers[0][3]["v0"]["status"] == "duplicate"
    assert answers[0][4] == "bad_tensor"


@pytest.mark.parametrize("shapes", [[(3,)] * 4, [(3,), (2, 2), (1,), (5,)]], ids=["rows", "mixed"])
def test_a_group_pull_reply_is_what_encoding_it_whole_gives(shapes):
    """A group pull's reply keeps its header from the first pull: every later pull, with other
    versions and values, is byte for byte what encoding the reply whole gives."""
    from client_sdk.wire import groups as group_wire
    from server.routes_groups import group_pull_reply

    names = [f"v{i}" for i in range(len(shapes))]
    store = ParameterStore(0, 1)
    store.init({n: (np.ones(s, np.float32), None) for n, s in zip(names, shapes)})
    group = store.groups.register(store, names, 16, 1 << 20)
    flat = np.full(group.nbytes // 4, 0.5, np.float32)
    for seq in range(3):
        for as_arrays in (True, False):
            got = group_pull_reply(store, group, as_arrays)
            versions, pieces = group.read(as_arrays)
            whole = group_wire.encode(
                {"group": group.id}, versions, "values", "<f4", pieces, group.nbytes
            )
            assert got.join() == whole.join() and got.nbytes == whole.nbytes
            assert got.nbytes == len(got.join())
        _group_push(store, group, seq, flat)
    assert group.pull_head is not None


def test_a_group_pull_reply_being_written_keeps_its_bytes_through_pushes():
    """A group pull's reply holds its values' memory while it is written: a group push
    meanwhile writes elsewhere, so the reply's bytes do not change; once the reply is gone
    the values go on from what the pushes made."""
    from server.routes_groups import group_pull_reply

    names = [f"v{i}" for i in range(4)]
    store = ParameterStore(0, 1)
    store.init({n: (np.ones(3, np.float32), None) for n in names})
    group = store.groups.register(store, names, 16, 1 << 20)
    flat = np.full(12, 0.5, np.float32)
    group_pull_reply(store, group, True)  # pulled, the reply gone: the training loop
    _group_push(store, group, 0, flat.copy())  # in place (the store may use its memory)
    reply = group_pull_reply(store, group, True)
    sent = b"".join(bytes(memoryview(c).cast("B")) for c in reply.chunks)
    for seq in (1, 2):
        _group_push(store, group, seq, flat.copy())
        assert b"".join(bytes(memoryview(c).cast("B")) for c in reply.chunks) == sent
    del reply
    _group_push(store, group, 3, flat.copy())
    got = store.pull(names)
    assert all(np.allclose(got[n]["value"], 1 - 0.01 * 0.5 * 4) for n in names)  # SGD, lr 0.01
