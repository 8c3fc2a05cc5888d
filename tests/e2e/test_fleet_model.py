"""Workers and a real 2-shard fleet against a model: random sequences of SDK calls.

Three workers (a ``PSClient`` over the SDK's own connection pools, one over an httpx2
transport, an ``AsyncPSClient``) share variables on two shard processes. Hypothesis has them init,
push (same-shaped gradients that go as packed tables, mixed ones, cast ones, in the background too),
pull, assign, increment and send refused pushes in any order, and checks every reply against a dict
of numpy arrays: what the fast paths keep (each worker's version cache, packed rows, slabs on the
shards, the protocol's immediate answers) must never show, so a pull returns exactly what the last
writes made, whichever worker made them.

A second run does the same on a fleet with a data dir, with fleet checkpoints and shard
restarts among the steps: graceful ones, and crashes that take a shard back to its newest
snapshot, after which a version a worker cached may name another value.

The optimizers' math is the shard's own ``server.optim.apply`` on the model's copies (its rules
are tested elsewhere), with small whole-number gradients, so values compare bit for bit.
"""

from __future__ import annotations

import itertools
from typing import ClassVar

import httpx2
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from client_sdk import AsyncPSClient, BadTensorError, PSClient
from client_sdk.optimizers import SGD, Adagrad, Adam, Add, Cosine
from client_sdk.placement import shard_for
from server import optim
from tests.conftest import OnLoop, examples

SHAPES = [(4,), (2, 3), (300,)]
RESTARTS = 2  # shard restarts per run of RestartingFleetMachine
DTYPES = [np.float32, np.float64]
OPTIMIZERS = [
    Add(),
    SGD(lr=0.5),
    Adagrad(lr=0.25),
    SGD(lr=0.5, momentum=0.5, schedule=Cosine(total=6, warmup=2)),
    Adam(lr=0.25),
]
_runs = itertools.count()


class FleetMachine(RuleBasedStateMachine):
    urls: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"model{next(_runs)}"
        self.workers = [
            PSClient(self.urls, worker_id=f"{self.prefix}-a"),
            PSClient(self.urls, worker_id=f"{self.prefix}-b", transport=httpx2.HTTPTransport()),
            OnLoop(AsyncPSClient(self.urls, worker_id=f"{self.prefix}-c")),
        ]
        self.checker = PSClient(self.urls, worker_id=f"{self.prefix}-check")
        self.values: dict[str, np.ndarray] = {}
        self.state: dict[str, dict[str, np.ndarray]] = {}
        #: Gradients applied by each variable's optimizer (its next update is number steps + 1).
        self.steps: dict[str, int] = {}
        self.optimizer: dict[str, object] = {}
        self.counters: dict[str, int | float] = {}
        self.groups: list[list[str]] = []
        self.made = 0

    def teardown(self) -> None:
        for ps in [*self.workers, self.checker]:
            ps.close()

    # -- helpers ----------------------------------------------------------------------------

    def placed(self, base: str, shard: int) -> str:
        """A name of this run, from ``base``, that shard ``shard`` owns. Which shard owns what
        must not depend on the run's prefix: Hypothesis replays a failing run under another
        one, and a name placed on the other shard would make it another run."""
        k = 0
        while shard_for(f"{self.prefix}/{base}-{k}", 2) != shard:
            k += 1
        return f"{self.prefix}/{base}-{k}"

    def new_name(self) -> str:
        self.made += 1
        return self.placed(f"v{self.made}", self.made * 5 // 3 % 2)

    def names(self) -> list[str]:
        return list(self.values)

    def grads(self, data, names: list[str], cast: bool) -> dict[str, np.ndarray]:
        out = {}
        for name in names:
            value = self.values[name]
            ints = data.draw(st.lists(st.integers(-3, 3), min_size=1, max_size=4))
            grad = np.resize(np.array(ints, np.float64), value.size).reshape(value.shape)
            out[name] = grad if cast and value.dtype == np.float32 else grad.astype(value.dtype)
        return out

    def apply(self, grads: dict[str, np.ndarray]) -> None:
        for name, grad in grads.items():
            value = self.values[name]
            self.steps[name] += 1
            optim.apply(
                self.optimizer[name],
                value,
                grad.astype(value.dtype),
                self.state[name],
                step=self.steps[name],
                scratch=True,
            )

    def settle(self) -> None:
        for ps in self.workers:
            ps.flush()

    # -- rules ------------------------------------------------------------------------------

    @rule(
        worker=st.integers(0, 2),
        count=st.integers(1, 5),
        shape=st.sampled_from(SHAPES),
        dtype=st.sampled_from(DTYPES),
        opt=st.sampled_from(OPTIMIZERS),
        odd_one=st.sampled_from([False, False, True]),
    )
    def init(self, worker, count, shape, dtype, opt, odd_one):
        """One worker inits a group of same-shaped variables (spread over both shards), with
        one optimizer, perhaps with one of another shape among them."""
        values = {self.new_name(): np.full(shape, float(self.made), dtype) for _ in range(count)}
        if odd_one:
            values[self.new_name()] = np.arange(5.0, dtype=np.float32)
        result = self.workers[worker].init(values, optimizer=opt)
        assert all(r == {"version": 0, "created": True} for r in result.values())
        for name, value in values.items():
            self.values[name] = value.copy()
            self.optimizer[name] = opt
            self.state[name] = optim.init_state(opt, value)
            self.steps[name] = 0
        self.groups.append(list(values))

    @precondition(lambda self: self.groups)
    @rule(
        data=st.data(),
        worker=st.integers(0, 2),
        how=st.sampled_from(["group", "group", "part", "any"]),
        cast=st.sampled_from([False, False, True]),
        background=st.sampled_from([False, True]),
    )
    def push(self, data, worker, how, cast, background):
        """A push of a whole group (all same-shaped: a packed table), part of one, or any
        names; gradients cast or not; in the background (flushed before the next read)."""
        group = data.draw(st.sampled_from(self.groups))
        if how == "group":
            names = list(group)
        else:
            pool = group if how == "part" else self.names()
            names = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
        grads = self.grads(data, names, cast)
        ps = self.workers[worker]
        if background:
            ps.push_async(grads)
        else:
            result = ps.push(grads)
            assert sorted(result) == sorted(names)
            assert all(r["status"] == "applied" for r in result.values())
        self.apply(grads)

    @precondition(lambda self: self.values)
    @rule(data=st.data(), worker=st.integers(0, 2), whole_group=st.booleans())
    def pull(self, data, worker, whole_group):
        """Either worker pulls a group (in its order, as a training step does) or any names
        in any order: exactly the model's values, read-only."""
        self.settle()
        if whole_group and self.groups:
            names = list(data.draw(st.sampled_from(self.groups)))
        else:
            names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        pulled = self.workers[worker].pull(names)
        assert list(pulled) == names
        for name in names:
            assert pulled[name].dtype == self.values[name].dtype
            np.testing.assert_array_equal(pulled[name], self.values[name], err_msg=name)
            assert not pulled[name].flags.writeable

    @precondition(lambda self: self.values)
    @rule(data=st.data(), worker=st.integers(0, 2))
    def assign(self, data, worker):
        self.settle()
        names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        values = {
            n: np.full(self.values[n].shape, data.draw(st.integers(-9, 9)), np.float64)
            for n in names
        }
        self.workers[worker].assign(values)
        for name, value in values.items():
            self.values[name][...] = value

    @rule(worker=st.integers(0, 2), which=st.integers(0, 2), delta=st.integers(-5, 5))
    def increment(self, worker, which, delta):
        name = self.placed(f"counter{which}", which % 2)
        expect = self.counters.get(name, 0) + delta
        assert self.workers[worker].increment(name, delta) == expect
        self.counters[name] = expect

    @precondition(lambda self: self.values)
    @rule(data=st.data(), worker=st.integers(0, 2))
    def refused_push(self, data, worker):
        """A push with one non-finite gradient is refused by its shard, which applies none of
        its part; the other shard's part is applied (the error says where)."""
        self.settle()
        names = data.draw(st.lists(st.sampled_from(self.names()), min_size=1, unique=True))
        grads = self.grads(data, names, False)
        bad = data.draw(st.sampled_from(names))
        grads[bad] = grads[bad].copy()
        grads[bad].flat[0] = np.inf
        ps = self.workers[worker]
        with pytest.raises(BadTensorError) as info:
            ps.push(grads)
        assert bad in str(info.value)
        # The other shard's part was applied (each shard checks its own part whole).
        applied = [n for n in names if shard_for(n, 2) != shard_for(bad, 2)]
        self.apply({n: grads[n] for n in applied})

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def every_value_is_the_models(self):
        """Checked after every step by a client of its own: the workers' caches are left as
        their own calls made them (a worker that pulled before a shard crashed holds versions
        of its old incarnation until it pulls again)."""
        if self.values:
            self.settle()
            self.check(self.checker)

    @precondition(lambda self: self.values)
    @rule()
    def every_worker_pulls_everything(self):
        self.settle()
        for ps in self.workers:
            self.check(ps)

    def check(self, ps) -> None:
        names = self.names()
        pulled = ps.pull(names)
        for name in names:
            np.testing.assert_array_equal(pulled[name], self.values[name], err_msg=name)


class RestartingFleetMachine(FleetMachine):
    """The same, on a fleet with a data dir (and no periodic snapshots), plus fleet
    checkpoints and shard restarts: a graceful one (SIGTERM: its final snapshot keeps every
    value) or a crash (SIGKILL: the shard comes back as its newest snapshot had it, a
    checkpoint's or a graceful stop's, and what was made since is gone). Either way the shard
    is a new incarnation: a worker must not offer it the versions it cached of the old one,
    which after a crash may name other values."""

    fleet = None

    def __init__(self) -> None:
        super().__init__()
        #: Per shard, what its newest snapshot holds of this run's variables and counters.
        self.saved: list[dict[str, tuple]] = [{}, {}]
        # Restarts take ~1 s each (a shard process started and restored) where the other steps
        # take milliseconds: at most RESTARTS per run, at least 4 steps apart, whichever rules
        # Hypothesis favours (two cover a restart of a shard that had already restarted).
        self.quiet = 0  # steps since the last restart
        self.restarts = 0

    def snapshot_of(self, shard: int) -> dict[str, tuple]:
        out = {}
        for name in self.values:
            if shard_for(name, 2) == shard:
                out[name] = (
                    self.values[name].copy(),
                    {k: a.copy() for k, a in self.state[name].items()},
                    self.steps[name],
                )
        for name, value in self.counters.items():
            if shard_for(name, 2) == shard:
                out[name] = (value, None, None)
        return out

    @invariant()
    def count_steps(self):
        self.quiet += 1

    @rule(worker=st.integers(0, 2))
    def checkpoint(self, worker):
        self.settle()
        self.workers[worker].checkpoint()
        self.saved = [self.snapshot_of(0), self.snapshot_of(1)]

    @precondition(lambda self: self.quiet >= 4 and self.restarts < RESTARTS)
    @rule(shard=st.integers(0, 1), crash=st.booleans())
    def restart(self, shard, crash):
        self.settle()
        if crash:
            self.fleet.kill(shard)
            saved = self.saved[shard]
            for name in [n for n in self.values if shard_for(n, 2) == shard]:
                if name in saved:
                    value, state, steps = saved[name]
                    self.values[name] = value.copy()
                    self.state[name] = {k: a.copy() for k, a in state.items()}
                    self.steps[name] = steps
                else:
                    del self.values[name], self.state[name], self.optimizer[name]
                    del self.steps[name]
            for name in [n for n in self.counters if shard_for(n, 2) == shard]:
                if name in saved:
                    self.counters[name] = saved[name][0]
                else:
                    del self.counters[name]
            self.groups = [
                kept for g in self.groups if (kept := [n for n in g if n in self.values])
            ]
        else:
            self.fleet.stop(shard)
            self.saved[shard] = self.snapshot_of(shard)
        self.fleet.start(shard)
        self.quiet = 0
        self.restarts += 1

    @precondition(lambda self: self.quiet >= 4 and self.restarts < RESTARTS and self.values)
    @rule(data=st.data(), worker=st.integers(0, 2), shard=st.integers(0, 1))
    def crash_between_two_histories(self, data, worker, shard):
        """The case a worker's cache must survive: after a checkpoint, one push; the worker
        pulls (and caches the value at that version); the shard crashes and comes back at
        the checkpoint; another push, other gradients, brings the version back to the one
        the worker holds, with another value. Its next pull must give that value."""
        self.checkpoint(worker=(worker + 1) % 3)
        names = self.names()
        first = self.grads(data, names, False)
        second = {n: g + 1 for n, g in first.items()}  # every value differs from the first
        self.workers[(worker + 1) % 3].push(first)
        self.apply(first)
        self.check(self.workers[worker])
        self.restart(shard, crash=True)
        names = self.names()
        self.workers[(worker + 2) % 3].push({n: second[n] for n in names})
        self.apply({n: second[n] for n in names})
        self.check(self.workers[worker])


def test_workers_against_a_model(fleet2):
    FleetMachine.urls = fleet2.urls
    run_state_machine_as_test(
        FleetMachine,
        settings=settings(
            max_examples=examples(60),
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )


def test_workers_against_a_model_while_shards_restart(fleet_factory):
    fleet = fleet_factory(2, "--snapshot-interval", "0", data=True)
    RestartingFleetMachine.urls = fleet.urls
    RestartingFleetMachine.fleet = fleet
    run_state_machine_as_test(
        RestartingFleetMachine,
        settings=settings(
            max_examples=examples(8),
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
