"""The store against a model of it: random sequences of what the shard's routes do.

:class:`server.store.ParameterStore` keeps a variable's value where it costs least: in a slab
row shared with the other same-shaped variables of its init, in fresh memory while a reader
holds the row, back home once none does; in place or into new buffers, on the event loop or
off it. None of that may show. Hypothesis drives the store (in this process, as the routes
call it: the async verbs on an event loop, reads after ``readable``) through inits, pushes of
every shape of request (whole slabs as one block, parts of them, reordered, cast, duplicate,
refused, big enough to go off the loop, two at once), pulls whose replies stay alive for a
while, snapshots written and restored, and after every step checks it against a plain dict of
numpy arrays:

* every value and version is the model's, and ``PullRows.whole`` is the pulled values' bytes;
* nothing a reader was handed (a pulled array, a reply's whole-slab buffer, a snapshot's
  arrays) ever changes while it is held;
* a read that overlaps pushes sees each variable before or after each of them, never torn;
* a refused request changes nothing, and its seq can still be used;
* each slab's count of members away from their rows is the truth.

The math of each optimizer is tested against its documented rule elsewhere
(tests/shard/test_datapath.py); here the model applies the same ``server.optim.apply`` to its own
copies, so any difference is the store's bookkeeping, not rounding.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from client_sdk.optimizers import SGD, Adagrad, Adam, Add, Cosine, from_wire
from server import optim, persistence
from server.errors import ShardError
from server.store import DEFAULT_OPTIMIZER, ParameterStore
from server.store import apply as store_apply
from tests.conftest import examples

SHAPES = [(3,), (2, 2), (5,)]
DTYPES = [np.float32, np.float64]
OPTIMIZERS = [
    Add(),
    SGD(lr=0.5),
    Adagrad(lr=0.25),
    SGD(lr=0.5, momentum=0.5, schedule=Cosine(total=6, warmup=2)),
    Adam(lr=0.25),
]
WORKERS = ["w0", "w1"]


class Model:
    """What the store should hold: per name a value, optimizer slots and a version."""

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.state: dict[str, dict[str, np.ndarray]] = {}
        self.optimizer: dict[str, object] = {}
        self.version: dict[str, int] = {}
        #: Gradients applied by each variable's optimizer (its next update is number steps + 1).
        self.steps: dict[str, int] = {}

    def copy(self) -> Model:
        other = Model()
        other.values = {k: v.copy() for k, v in self.values.items()}
        other.state = {k: {s: a.copy() for s, a in st_.items()} for k, st_ in self.state.items()}
        other.optimizer = dict(self.optimizer)
        other.version = dict(self.version)
        other.steps = dict(self.steps)
        return other

    def push(self, grads: dict[str, np.ndarray]) -> None:
        for name, grad in grads.items():
            value = self.values[name]
            grad = grad.astype(value.dtype)  # a fresh copy, as the store's cast
            self.steps[name] += 1
            optim.apply(
                self.optimizer[name],
                value,
                grad,
                self.state[name],
                step=self.steps[name],
                scratch=True,
            )
            self.version[name] += 1


def gradient(shape: tuple[int, ...], dtype: type, draw_ints: list[int]) -> np.ndarray:
    """Small whole numbers: every optimizer's update of them is the same bits in any layout."""
    return np.array(draw_ints[: int(np.prod(shape))], dtype=dtype).reshape(shape)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = ParameterStore(0, 1)
        self.model = Model()
        self.loop = asyncio.new_event_loop()
        self.held: list[tuple[object, bytes]] = []  # (what a reader holds, its bytes then)
        self.seq = dict.fromkeys(WORKERS, 0)
        self.groups: list[list[str]] = []  # each init's names, in order
        self.counter = 0
        self.tmp = tempfile.TemporaryDirectory()
        self.snapshots = 0

    def teardown(self) -> None:
        self.held.clear()
        self.loop.close()
        self.tmp.cleanup()

    # -- helpers ----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.model.values)

    def next_seq(self, worker: str) -> int:
        self.seq[worker] += 1
        return self.seq[worker]

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def hold(self, thing: object) -> None:
        self.held.append((thing, bytes(memoryview(thing).cast("B"))))

    def grads_for(self, data, names: list[str], cast: bool) -> dict[str, np.ndarray]:
        out = {}
        for name in names:
            value = self.model.values[name]
            ints = data.draw(st.lists(st.integers(-4, 4), min_size=value.size, max_size=value.size))
            dtype = np.float64 if cast and value.dtype == np.float32 else value.dtype
            out[name] = gradient(value.shape, dtype, ints)
        return out

    def assert_unchanged(self, before: Model) -> None:
        for name in self.names():
            var = self.store.get(name)
            assert var.version == before.version[name], name
            np.testing.assert_array_equal(var.value, before.values[name], err_msg=name)

    # -- rules ------------------------------------------------------------------------------

    @rule(
        count=st.integers(1, 4),
        shape=st.sampled_from(SHAPES),
        dtype=st.sampled_from(DTYPES),
        opts=st.lists(st.sampled_from(OPTIMIZERS), min_size=4, max_size=4),
        same_opt=st.sampled_from([True, True, False]),
        odd_one=st.sampled_from([False, False, True]),
    )
    def init(self, count, shape, dtype, opts, same_opt, odd_one):
        """One init of ``count`` same-shaped variables (a slab when two or more), one
        optimizer for all or one each, perhaps followed by one of another shape."""
        names, entries = [], {}
        for i in range(count):
            self.counter += 1
            name = f"v{self.counter}"
            value = np.full(shape, float(self.counter), dtype)
            opt = opts[0] if same_opt else opts[i]
            entries[name] = (value, opt.to_wire())
            names.append(name)
        if odd_one:
            self.counter += 1
            name = f"v{self.counter}"
            entries[name] = (np.arange(7, dtype=np.float32), opts[1].to_wire())
            names.append(name)
        result = self.store.init(entries)
        assert all(r == {"version": 0, "created": True} for r in result.values())
        for name, (value, spec) in entries.items():
            self.model.values[name] = value.copy()
            opt = from_wire(spec)
            self.model.optimizer[name] = opt
            self.model.state[name] = optim.init_state(opt, value.copy())
            self.model.version[name] = 0
            self.model.steps[name] = 0
        self.groups.append(names)

    @precondition(lambda self: self.model.values)
    @rule(data=st.data())
    def init_again_or_conflict(self, data):
        """An init of an existing name: the same shape is a no-op, another one a conflict that
        creates nothing (not even the request's new names)."""
        name = data.draw(st.sampled_from(self.names()))
        value = self.model.values[name]
        same = data.draw(st.booleans())
        before = self.model.copy()
        self.counter += 1
        fresh = f"v{self.counter}"
        entries = {
            fresh: (np.zeros(3, np.float32), None),
            name: (np.zeros(value.shape if same else (*value.shape, 1), value.dtype), None),
        }
        if same:
            result = self.store.init(entries)
            assert result[name] == {"version": before.version[name], "created": False}
            self.model.values[fresh] = np.zeros(3, np.float32)
            self.model.optimizer[fresh] = DEFAULT_OPTIMIZER
            self.model.state[fresh] = optim.init_state(DEFAULT_OPTIMIZER, self.model.values[fresh])
            self.model.version[fresh] = 0
            self.model.steps[fresh] = 0
        else:
            with pytest.raises(ShardError) as info:
                self.store.init(entries)
            assert info.value.code == "conflict" and fresh not in self.store
            self.assert_unchanged(before)

    @precondition(lambda self: self.groups)
    @rule(
        data=st.data(),
        how=st.sampled_from(["whole", "whole", "whole", "part", "reversed", "mixed"]),
        block=st.sampled_from([True, True, False]),
        cast=st.sampled_from([False, False, True]),
        off_loop=st.sampled_from([False, False, True]),
        worker=st.sampled_from(WORKERS),
    )
    def push(self, data, how, block, cast, off_loop, worker):
        """A push as the routes make it: one init's names (all, some, reversed) or any names,
        the gradients as the rows of one block when they are same-shaped (a packed table),
        cast or not, small or (the threshold lowered) applied off the event loop."""
        group = data.draw(st.sampled_from(self.groups))
        if how == "whole":
            names = list(group)
        elif how == "part":
            names = data.draw(st.lists(st.sampled_from(group), min_size=1, unique=True))
        elif how == "reversed":
            names = group[::-1]
        else:
            names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        self.apply_push(worker, names, self.grads_for(data, names, cast), block, off_loop)

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), keep_reply=st.booleans(), off_loop=st.sampled_from([False, False, True]))
    def training_step(self, data, keep_reply, off_loop):
        """A worker's step on one init's variables: pull them all, then push all their
        gradients as one block, the reply gone by then or (a slow socket) still being
        written."""
        group = list(data.draw(st.sampled_from(self.groups)))
        self.run(self.store.readable(group))
        rows = self.store.pull_rows(group)
        if keep_reply:
            for value in rows.values:
                self.hold(value)
            if rows.whole is not None:
                self.hold(rows.whole)
        del rows
        self.apply_push("w0", group, self.grads_for(data, group, False), True, off_loop)

    def apply_push(self, worker, names, grads, block, off_loop):
        rows = None
        kinds = {(g.dtype, g.shape) for g in grads.values()}
        if block and len(kinds) == 1:
            rows = np.stack(list(grads.values()))
            grads = dict(zip(names, rows))
        expected = {k: v.copy() for k, v in grads.items()}
        # No garbage collection between the prediction and the push: unreachable objects in
        # a reference cycle (a caught refusal's traceback) may hold a view of a value until
        # the collector runs, which the prediction would otherwise race with.
        gc.disable()
        try:
            homes = self.homes_after_update(names, off_loop=off_loop)
            seq = self.next_seq(worker)
            result = self.push_now(worker, seq, grads, rows, off_loop)
            now = self.homes_after_update(names, now=True)
        finally:
            gc.enable()
        self.model.push(expected)
        assert {k: (r["status"], r["version"]) for k, r in result.items()} == {
            k: ("applied", self.model.version[k]) for k in names
        }
        assert now == homes
        again = self.push_now(
            worker, seq, {k: v.copy() for k, v in expected.items()}, None, off_loop
        )
        assert all(r["status"] == "duplicate" for r in again.values())

    def homes_after_update(self, names, now=False, off_loop=False):
        """Per slab member of ``names``, whether it is in its row: ``now``, or as it must be
        after one update: a value at home stays there unless a reader holds it or the update
        is one computed into new memory off the loop (a big Adagrad one, while readers go on
        reading the old value); a value away comes home once no reader holds the row."""
        out = {}
        for name in names:
            var = self.store.get(name)
            slab = var._slab
            if slab is None:
                continue
            home = var.value.ctypes.data == slab.address + var._row * slab.stride
            if now:
                out[name] = home
            elif home:
                out[name] = not var.held() and not (off_loop and not optim.stateless(var.optimizer))
            else:
                out[name] = var._gone() is None
        return out

    def push_now(self, worker, seq, grads, rows, off_loop):
        if not off_loop:
            return self.run(self.store.push_async(worker, seq, grads, block=rows))
        saved = store_apply.OFFLOAD_BYTES
        store_apply.OFFLOAD_BYTES = 1
        try:
            return self.run(self.store.push_async(worker, seq, grads, block=rows))
        finally:
            store_apply.OFFLOAD_BYTES = saved

    @precondition(lambda self: self.model.values)
    @rule(
        data=st.data(),
        fault=st.sampled_from(["nan", "shape", "int", "unknown"]),
        off_loop=st.booleans(),
        worker=st.sampled_from(WORKERS),
    )
    def refused_push(self, data, fault, off_loop, worker):
        """A push with one bad gradient among good ones changes nothing, and the seq it
        used is still free."""
        names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        grads = self.grads_for(data, names, False)
        bad = data.draw(st.sampled_from(names))
        if fault == "nan":
            grads[bad] = grads[bad].copy()
            grads[bad].flat[-1] = np.nan
        elif fault == "shape":
            grads[bad] = np.zeros(grads[bad].size + 1, grads[bad].dtype)
        elif fault == "int":
            grads[bad] = grads[bad].astype(np.int32)
        else:
            grads["nope"] = np.zeros(3, np.float32)
        before = self.model.copy()
        seq = self.next_seq(worker)
        with pytest.raises(ShardError):
            self.push_now(worker, seq, grads, None, off_loop)
        self.assert_unchanged(before)
        good = {n: np.zeros_like(self.model.values[n]) for n in names}
        result = self.push_now(worker, seq, good, None, off_loop)
        assert all(r["status"] == "applied" for r in result.values())
        self.model.push(good)

    @precondition(lambda self: self.model.values)
    @rule(data=st.data(), versions=st.sampled_from(["none", "current", "some"]))
    def pull(self, data, versions):
        """A pull as the routes make it (after ``readable``), of one init's names or any;
        the reply's arrays and whole-slab buffer are held for a while."""
        if data.draw(st.booleans()) and self.groups:
            names = list(data.draw(st.sampled_from(self.groups)))
        else:
            names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        if versions == "none":
            seen = None
        elif versions == "current":
            seen = [self.model.version[n] for n in names]
        else:
            seen = [data.draw(st.sampled_from([None, self.model.version[n]])) for n in names]
        self.run(self.store.readable(names))
        rows = self.store.pull_rows(names, seen)
        assert rows.versions == [self.model.version[n] for n in names]
        for name, known, value in zip(names, seen or [None] * len(names), rows.values):
            if known == self.model.version[name]:
                assert value is None
                continue
            np.testing.assert_array_equal(value, self.model.values[name])
            assert not value.flags.writeable
            self.hold(value)
        if rows.whole is not None:
            assert rows.whole.tobytes() == b"".join(self.model.values[n].tobytes() for n in names)
            self.hold(rows.whole)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def reader_done(self, data):
        """A reply finished writing (or a snapshot): what it held is let go."""
        i = data.draw(st.integers(0, len(self.held) - 1))
        del self.held[i]

    @precondition(lambda self: self.model.values)
    @rule(data=st.data())
    def assign(self, data):
        names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        values = {
            n: np.full_like(self.model.values[n], data.draw(st.integers(-9, 9))) for n in names
        }
        self.run(self.store.settled(names))
        result = self.store.assign(values)
        for name, value in values.items():
            self.model.values[name][...] = value
            self.model.version[name] += 1
            assert result[name] == {"status": "applied", "version": self.model.version[name]}

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), off_loop=st.booleans())
    def two_pushes_and_a_read(self, data, off_loop):
        """Two workers' pushes at once (their names overlapping) and a read between them:
        the read sees each variable before or after each push, never half of one, and the end
        is the two pushes applied one after the other."""
        group = data.draw(st.sampled_from(self.groups))
        first = data.draw(st.lists(st.sampled_from(group), min_size=1, unique=True))
        second = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        grads_a = self.grads_for(data, first, False)
        grads_b = self.grads_for(data, second, False)
        states = [self.model.copy()]  # before, after a, after a then b
        for grads in (grads_a, grads_b):
            states.append(states[-1].copy())
            states[-1].push({k: v.copy() for k, v in grads.items()})
        only_b = states[0].copy()
        only_b.push({k: v.copy() for k, v in grads_b.items()})
        seen: list[tuple[str, int, np.ndarray]] = []
        names = list(dict.fromkeys(first + second))

        async def read() -> None:
            for _ in range(3):
                await self.store.readable(names)
                rows = self.store.pull_rows(names)
                seen.extend((n, v, a.copy()) for n, v, a in zip(names, rows.versions, rows.values))
                await asyncio.sleep(0)

        async def both():
            seq_a, seq_b = self.next_seq("w0"), self.next_seq("w1")
            return await asyncio.gather(
                self.store.push_async("w0", seq_a, grads_a),
                read(),
                self.store.push_async("w1", seq_b, grads_b),
            )

        saved = store_apply.OFFLOAD_BYTES
        if off_loop:
            store_apply.OFFLOAD_BYTES = 1
        try:
            self.run(both())
        finally:
            store_apply.OFFLOAD_BYTES = saved
        for name, version, value in seen:
            possible = [s.values[name] for s in (*states, only_b) if s.version[name] == version]
            assert any(np.array_equal(value, p) for p in possible), (
                f"{name} read at version {version} as {value}: none of {possible}"
            )
        self.model = states[-1]

    @precondition(lambda self: self.model.values)
    @rule(keep=st.booleans())
    def snapshot_and_restore(self, keep):
        """A snapshot (its arrays held while it is written), and perhaps a restart from it:
        the values, versions and dedup table come back, laid out as their inits made them."""
        capture = self.store.capture()
        for _, arrays in capture.variables.values():
            for a in arrays.values():
                self.hold(a)
        self.snapshots += 1
        path = Path(self.tmp.name)
        persistence.write_snapshot(path, self.snapshots, capture, incarnation="model")
        if keep:
            return
        found = persistence.find_restorable(path, 0, 1)
        store = ParameterStore(0, 1)
        store.restore(found.variables, found.dedup)
        self.store = store
        self.groups = [[n for n in names if n in self.model.values] for names in self.groups]

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def values_and_versions_are_the_models(self):
        assert sorted(v.name for v in self.store) == sorted(self.model.values)
        for name, value in self.model.values.items():
            var = self.store.get(name)
            assert var.version == self.model.version[name], name
            assert var.steps == self.model.steps[name], name
            assert var.value.dtype == value.dtype and var.value.flags.c_contiguous
            np.testing.assert_array_equal(var.value, value, err_msg=name)
            for slot, a in self.model.state[name].items():
                np.testing.assert_array_equal(var.state[slot], a, err_msg=f"{name}.{slot}")

    @invariant()
    def what_readers_hold_never_changes(self):
        for thing, then in self.held:
            assert bytes(memoryview(thing).cast("B")) == then

    @invariant()
    def slabs_know_who_is_away(self):
        slabs = {id(v._slab): v._slab for v in self.store if v._slab is not None}
        for slab in slabs.values():
            away = [
                m.value.ctypes.data != slab.address + m._row * slab.stride for m in slab.members
            ]
            assert slab.away == sum(away)
            assert all(m._slab is slab and m.name in self.store for m in slab.members)
            for m, is_away in zip(slab.members, away):
                assert (m._gone is not None) == is_away


TestStoreModel = StoreMachine.TestCase
TestStoreModel.settings = settings(
    max_examples=examples(200),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
