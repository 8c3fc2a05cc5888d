"""The shard's data path under the hood: direct routes, body reading, updates off the loop.

Real shard processes (tests/conftest.py), and the store or the protocol in this process where a
test must hold a thread or a socket at a chosen point. Updates of at least
``server.store.apply.OFFLOAD_BYTES`` are checked and applied in a worker thread (in place while
readers wait, or into fresh buffers while a reader holds the value); these tests check that they
do the same math as small ones, are never seen half-done, never lose a concurrent update, and
refuse bad input without a trace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import socket
import threading
import time

import httpx2
import msgpack
import numpy as np
import pytest
import uvicorn
from fastapi import Depends, FastAPI, Request
from uvicorn.server import ServerState

from client_sdk import BadTensorError, PSClient, wire
from client_sdk.optimizers import SGD, Adagrad, Add, from_wire
from server import httptools_protocol as server_protocol
from server import optim
from server.bodies import coalesce, read_body
from server.direct_routes import direct_routes
from server.errors import ShardError
from server.headers import header, request_headers
from server.httptools_protocol import BODY_INTO, GATHER, Gathered, ShardHttpProtocol
from server.store import ParameterStore, Variable
from server.store import apply as store_apply
from server.store import slab as store_slab
from server.store.apply import OFFLOAD_BYTES, one_update
from server.store.checks import SMALL_CHECK, FiniteScan, all_finite, finite_rows
from tests.helpers.eventually import eventually
from tests.helpers.recorder import Recorder

BIG = OFFLOAD_BYTES // 4 + 1000  # float32 elements: just above the off-loop threshold


def reference(opt, value: np.ndarray, acc: np.ndarray | None, grad: np.ndarray):
    """The documented update rules (server/optim.py), step by step in float64."""
    v, g = value.astype(np.float64), grad.astype(np.float64)
    if isinstance(opt, Add):
        return v + g, acc
    g = g + opt.weight_decay * v
    if isinstance(opt, SGD):
        return v - opt.lr * g, acc
    acc = acc + g * g
    return v - opt.lr * g / (np.sqrt(acc) + opt.epsilon), acc


@pytest.mark.parametrize(
    "opt", [Add(), SGD(lr=0.1, weight_decay=0.01), Adagrad(lr=0.5, weight_decay=0.02)]
)
def test_big_and_small_updates_follow_the_same_math(fleet_factory, opt):
    fleet = fleet_factory(1)
    rng = np.random.default_rng(1)
    start = rng.standard_normal(BIG).astype(np.float32)
    grads = [rng.standard_normal(BIG).astype(np.float32) for _ in range(3)]
    with PSClient(fleet.urls) as ps:
        ps.init({"big": start, "small": start[:1000]}, optimizer=opt)
        value = start.astype(np.float64)
        acc = np.full(BIG, getattr(opt, "initial_accumulator_value", 0.0))
        for g in grads:
            ps.push({"big": g})  # computed off the event loop
            ps.push({"small": g[:1000]})  # on it
            value, acc = reference(opt, value, acc, g)
            ps.pull(["big", "small"])  # a reader in between: the next update moves the value
        got = ps.pull(["big", "small"])
    np.testing.assert_allclose(got["big"], value, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got["small"], got["big"][:1000])


def test_concurrent_big_pushes_are_never_seen_torn_and_never_lost(fleet_factory):
    fleet = fleet_factory(1)
    pushes_per_thread, pushers = 8, 4
    with PSClient(fleet.urls, worker_id="init") as ps:
        ps.init({"w": np.zeros(BIG, np.float32)}, optimizer=Add())
    seen: list[tuple[float, float]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def push(k: int) -> None:
        try:
            with PSClient(fleet.urls, worker_id=f"pusher{k}") as ps:
                for _ in range(pushes_per_thread):
                    ps.push({"w": np.ones(BIG, np.float32)})
        except BaseException as exc:  # reported below
            errors.append(exc)

    def pull() -> None:
        # Raw pulls without versions: every one transfers the value (the SDK's cache would
        # skip the ones that find the version unchanged, i.e. the ones during a computation).
        request = msgpack.packb({"names": ["w"]})
        headers = {"content-type": wire.MSGPACK, "accept": wire.FRAME}
        try:
            with httpx2.Client(timeout=30) as http:
                while not done.is_set():
                    r = http.post(fleet.urls[0] + "/v1/pull", content=request, headers=headers)
                    body = bytearray(r.content)
                    msg = wire.unpack(body, r.headers["content-type"])
                    w = wire.decode_tensor(msg["variables"]["w"]["value"], body)
                    seen.append((float(w.min()), float(w.max())))
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=pull)
    reader.start()
    threads = [threading.Thread(target=push, args=(k,)) for k in range(pushers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    assert not errors, errors
    assert seen and all(lo == hi for lo, hi in seen), [s for s in seen if s[0] != s[1]][:3]
    with PSClient(fleet.urls) as ps:
        final = ps.pull(["w"])["w"]
        version = next(s["version"] for s in ps.variables() if s["name"] == "w")
    total = pushes_per_thread * pushers
    assert version == total
    assert final.min() == final.max() == total


def test_a_refused_big_push_changes_nothing(fleet_factory):
    fleet = fleet_factory(1)
    with PSClient(fleet.urls) as ps:
        ps.init({"w": np.ones(BIG, np.float32), "v": np.ones(BIG, np.float32)}, optimizer=Add())
        bad = np.ones(BIG, np.float32)
        bad[-1] = np.nan
        with pytest.raises(BadTensorError, match="NaN or infinite"):
            ps.push({"v": np.ones(BIG, np.float32), "w": bad})
        got = ps.pull(["w", "v"])
        versions = {s["name"]: s["version"] for s in ps.variables()}
    assert versions == {"w": 0, "v": 0}
    assert got["w"].min() == got["w"].max() == 1 and got["v"].min() == got["v"].max() == 1


def test_an_update_writes_in_place_only_once_no_reader_holds_the_value():
    """The store, in this process: while a pulled view, a memoryview made from it or a
    snapshot holds the value, an update goes to fresh memory and what they hold never
    changes; once they are gone, updates write in place."""
    store = ParameterStore(0, 1)
    store.init({"w": (np.zeros(1000, np.float32), Add().to_wire())})
    var = store.get("w")
    ones = np.ones(1000, np.float32)

    def push_moves_value(seq: int) -> bool:
        before = var.value.ctypes.data
        store.push("worker", seq, {"w": ones.copy()})
        return var.value.ctypes.data != before

    assert not push_moves_value(0)  # never pulled
    pulled = store.pull(["w"])["w"]["value"]
    assert push_moves_value(1) and (pulled == 1).all()
    del pulled
    assert not push_moves_value(2)  # pulled before, but no reader left
    sent = memoryview(store.pull(["w"])["w"]["value"]).cast("B")  # as a reply in flight
    assert push_moves_value(3) and (np.frombuffer(sent, np.float32) == 3).all()
    del sent
    snapshot = store.capture()
    assert push_moves_value(4) and (snapshot.variables["w"][1]["value"] == 4).all()
    del snapshot
    assert not push_moves_value(5)
    # A training loop's pattern: each push comes after a pull whose reply is long gone.
    store.pull(["w"])
    assert not push_moves_value(6)
    store.pull_rows(["w"], [None])
    assert not push_moves_value(7)
    assert (var.value == 8).all() and var.version == 8


def test_values_made_together_lie_side_by_side_and_a_pull_of_all_sends_them_as_one_buffer():
    """The store, in this process: the same-shaped variables of one init get one block of
    memory, in the order named (a packed table's layout); a pull of all of them in that
    order has their bytes as one buffer (PullRows.whole), any other pull not. While that
    buffer lives (a reply being written), updates go to fresh memory and its bytes never
    change; the first update after it is gone brings each value back to its row."""
    store = ParameterStore(0, 1)
    names = ["a", "b", "c"]
    store.init(
        {
            **{n: (np.full(5, i, np.float32), Add().to_wire()) for i, n in enumerate(names)},
            "odd": (np.zeros(3, np.float32), Add().to_wire()),
        }
    )
    homes = [store.get(n).value.ctypes.data for n in names]
    assert homes == [homes[0] + 20 * i for i in range(3)]
    assert store.get("odd")._slab is None

    def whole(pulled=names, versions=None):
        return store.pull_rows(pulled, versions).whole

    def bump(seq: int, *which: str) -> None:
        store.push("worker", seq, {n: np.ones(5, np.float32) for n in which})

    sent = whole()
    assert sent is not None and not sent.flags.writeable
    assert sent.tobytes() == b"".join(np.full(5, i, np.float32).tobytes() for i in range(3))
    for other in (["a", "b"], ["b", "a", "c"], [*names, "odd"]):
        assert whole(other) is None
    assert whole(versions=[0, None, None]) is None  # a row held: not every value goes
    bump(1, "b")  # the buffer is still being written: b moves away, its bytes stay
    assert store.get("b").value.ctypes.data != homes[1] and (store.get("b").value == 2).all()
    assert sent.tobytes()[20:40] == np.full(5, 1, np.float32).tobytes()
    assert whole() is None  # a member is away: one buffer per value again
    del sent
    bump(2, "b")  # no reader of the row left: back home
    assert store.get("b").value.ctypes.data == homes[1] and (store.get("b").value == 3).all()
    again = whole()
    assert (
        again is not None
        and np.frombuffer(again, np.float32).tolist() == [0.0] * 5 + [3.0] * 5 + [2.0] * 5
    )
    del again
    snapshot = store.capture()  # a snapshot holds every value: all move away, then home
    bump(3, *names)
    assert [store.get(n).value.ctypes.data != h for n, h in zip(names, homes)] == [True] * 3
    assert (snapshot.variables["a"][1]["value"] == 0).all()
    del snapshot
    bump(4, *names)
    assert [store.get(n).value.ctypes.data for n in names] == homes
    assert np.frombuffer(whole(), np.float32).tolist() == [2.0] * 5 + [5.0] * 5 + [4.0] * 5


def test_a_push_to_all_of_a_slab_is_one_update_and_the_same_as_one_by_one(monkeypatch):
    """The store, in this process: a push whose gradients are one block, to every member of
    a slab in its order, with one optimizer without slots and no reader holding a value, is
    one update of the whole slab; any other push goes variable by variable. The values are
    the same either way."""
    calls = []
    apply = optim.apply

    def counted(opt, value, grad, *args, **kwargs):
        calls.append(value.shape)
        return apply(opt, value, grad, *args, **kwargs)

    monkeypatch.setattr(optim, "apply", counted)
    store = ParameterStore(0, 1)
    names = ["a", "b", "c"]
    store.init(
        {n: (np.full(4, 10.0 * i, np.float32), SGD(lr=0.5).to_wire()) for i, n in enumerate(names)}
    )
    expect = {n: np.full(4, 10.0 * i, np.float32) for i, n in enumerate(names)}
    seq = iter(range(100))

    def push(block, pushed=names, cast=False):
        calls.clear()
        for n, g in zip(pushed, block):  # (the store may use the gradients' memory)
            expect[n] -= np.float32(0.5) * g
        rows = block.astype(np.float64) if cast else block
        store.push("worker", next(seq), dict(zip(pushed, rows)), block=rows)
        for n in names:
            np.testing.assert_array_equal(store.get(n).value, expect[n])
        return list(calls)

    grads = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert push(grads.copy()) == [(3, 4)]  # one update of the whole slab
    store.pull_rows(names)  # pulled, and the reply gone: the training loop's pattern
    assert push(grads.copy()) == [(3, 4)]
    reply = store.pull_rows(names).whole  # a reply being written holds every value
    sent = np.concatenate([expect[n] for n in names])
    assert push(grads.copy()) == [(4,)] * 3
    np.testing.assert_array_equal(np.frombuffer(reply, np.float32), sent)
    del reply
    assert push(grads.copy()) == [(4,)] * 3  # the values come home one by one
    assert push(grads.copy()) == [(3, 4)]
    kept = store.pull(["b"])["b"]["value"]  # a reader of one member
    before = kept.copy()
    assert push(grads.copy()) == [(4,)] * 3
    np.testing.assert_array_equal(kept, before)
    del kept
    assert push(grads.copy()) == [(4,)] * 3  # b comes home
    assert push(grads.copy()) == [(3, 4)]
    assert push(grads[:2].copy(), names[:2]) == [(4,)] * 2  # not every member
    assert push(grads[::-1].copy(), names[::-1]) == [(4,)] * 3  # not in the slab's order
    assert push(grads.copy(), cast=True) == [(4,)] * 3  # cast first, one by one
    other = ParameterStore(0, 1)  # two optimizers among the members
    other.init(
        {
            "x": (np.zeros(4, np.float32), SGD(lr=0.5).to_wire()),
            "y": (np.zeros(4, np.float32), SGD(lr=0.25).to_wire()),
        }
    )
    calls.clear()
    two = grads[:2].copy()
    other.push("worker", 0, {"x": two[0], "y": two[1]}, block=two)
    assert calls == [(4,)] * 2 and other.get("y").value.tolist() == (-0.25 * grads[1]).tolist()


def test_big_values_get_no_slab_and_an_update_off_the_loop_brings_a_value_home(monkeypatch):
    """Variables of more than SLAB_ROW_BYTES each are made one by one; and a push applied off
    the event loop (a big one) takes a value that is away from its row back there once no
    reader holds the row, as one on the loop does."""
    monkeypatch.setattr(store_slab, "SLAB_ROW_BYTES", 16)
    store = ParameterStore(0, 1)
    store.init(
        {
            "big1": (np.zeros(5, np.float32), None),
            "big2": (np.zeros(5, np.float32), None),
            "a": (np.zeros(4, np.float32), Add().to_wire()),
            "b": (np.zeros(4, np.float32), Add().to_wire()),
        }
    )
    assert store.get("big1")._slab is None and store.get("big2")._slab is None
    a = store.get("a")
    home = a.value.ctypes.data
    assert a._slab is not None and store.get("b").value.ctypes.data == home + 16
    monkeypatch.setattr(store_apply, "OFFLOAD_BYTES", 1)  # every push off the loop

    async def run() -> None:
        reply = store.pull_rows(["a", "b"]).whole
        await store.push_async("worker", 1, {"a": np.ones(4, np.float32)})
        assert a.value.ctypes.data != home and a._slab.away == 1
        del reply
        await store.push_async("worker", 2, {"a": np.ones(4, np.float32)})
        assert a.value.ctypes.data == home and a._slab.away == 0 and (a.value == 2).all()

    asyncio.run(run())


def test_restored_variables_are_laid_out_as_their_init_made_them():
    """After a restore, runs of same-shaped tensors share a slab again (their values copied
    there, in order) and equal optimizers are one object: a pull of all of them is one
    buffer, a push to all one update, with the values the snapshot had."""
    first = ParameterStore(0, 1)
    first.init(
        {
            "a": (np.full(4, 1.0, np.float32), SGD(lr=0.5).to_wire()),
            "b": (np.full(4, 2.0, np.float32), SGD(lr=0.5).to_wire()),
            "n": (np.arange(3.0), None),
        }
    )
    captured = first.capture()
    restored = [
        Variable(
            name=name,
            value=np.array(arrays["value"]),
            optimizer=from_wire(meta["optimizer"]),
            state={},
        )
        for name, (meta, arrays) in captured.variables.items()
    ]
    store = ParameterStore(0, 1)
    store.restore(restored, first.dedup)
    a, b, n = (store.get(k) for k in ("a", "b", "n"))
    assert a._slab is b._slab is not None and n._slab is None
    assert b.value.ctypes.data == a.value.ctypes.data + 16 and a.optimizer is b.optimizer
    whole = store.pull_rows(["a", "b"]).whole
    assert np.frombuffer(whole, np.float32).tolist() == [1.0] * 4 + [2.0] * 4
    del whole
    block = np.ones((2, 4), np.float32)
    assert one_update([a, b], list(block), block) is not None
    store.push("worker", 1, {"a": block[0], "b": block[1]}, block=block)
    assert a.value.tolist() == [0.5] * 4 and b.value.tolist() == [1.5] * 4


def test_what_a_big_push_computed_is_no_reader_once_it_is_applied(monkeypatch):
    """A big push's worker thread drops its arguments only when it runs again, which may be
    well after the event loop applied the push and went on (the thread needs the GIL back).
    Until then those arguments must not keep the new values referenced: the next update
    after a pull whose reply is gone writes in place, as it does when no reader holds the
    value, rather than to fresh memory."""
    monkeypatch.setattr(store_apply, "OFFLOAD_BYTES", 1)  # every push_async off the loop
    store = ParameterStore(0, 1)
    store.init({"w": (np.zeros(8, np.float32), Adagrad(lr=0.5).to_wire())})
    kept = []

    class Lingering(concurrent.futures.ThreadPoolExecutor):
        """Holds every call's arguments for good, as a worker thread that has not run again
        since its call returned still does."""

        def submit(self, fn, /, *args, **kwargs):
            kept.append(args)
            return super().submit(fn, *args, **kwargs)

    async def run() -> None:
        asyncio.get_running_loop().set_default_executor(Lingering(1))
        # Adagrad's big update is computed into fresh buffers in the thread.
        await store.push_async("w0", 1, {"w": np.ones(8, np.float32)})
        var = store.get("w")
        made = var.value.ctypes.data
        reply = store.pull_rows(["w"])
        del reply  # the reply is written and gone
        assert not var.held()
        store.push("w0", 2, {"w": np.ones(8, np.float32)})
        assert var.value.ctypes.data == made  # updated in place

    asyncio.run(run())
    assert kept  # the push did go through the executor


@pytest.mark.parametrize("opt, in_place", [(Add(), True), (Adagrad(lr=0.5), False)])
def test_a_big_update_goes_in_place_only_when_cheap_and_no_reader_holds_the_value(opt, in_place):
    """push_async, in this process: a big Add update (one pass) is made in place while no
    reader holds the value, in fresh memory while one does (which then never changes); an
    Adagrad update (many passes) always in fresh memory, off the loop."""
    store = ParameterStore(0, 1)
    store.init({"w": (np.zeros(BIG, np.float32), opt.to_wire())})
    var = store.get("w")

    async def push_moves_value(seq: int) -> bool:
        before = var.value.ctypes.data
        await store.push_async("worker", seq, {"w": np.ones(BIG, np.float32)})
        return var.value.ctypes.data != before

    async def scenario() -> None:
        store.pull(["w"])  # pulled, and no longer held
        assert await push_moves_value(0) is not in_place
        pulled = store.pull(["w"])["w"]["value"]
        kept = pulled.copy()
        assert await push_moves_value(1)
        assert np.array_equal(pulled, kept)

    asyncio.run(scenario())
    assert var.version == 2


async def _settle() -> None:
    """Let every task on the loop run until it waits. The worker threads are held at gates, so
    nothing else can move: a task still not done after this waits for a gate."""
    for _ in range(100):
        await asyncio.sleep(0)


def test_readers_wait_while_a_big_update_is_written_in_place():
    """push_async, in this process, with its worker thread held at a gate: while a big Add
    update is written in place off the loop, readers of that variable wait (readable) and
    readers of others do not, a second writer waits; once the thread is done, readers get the
    new value, whole, in the same memory."""
    store = ParameterStore(0, 1)
    store.init(
        {
            "w": (np.zeros(BIG, np.float32), Add().to_wire()),
            "v": (np.zeros(10, np.float32), Add().to_wire()),
        }
    )
    var = store.get("w")
    where = var.value.ctypes.data
    gate, started = threading.Event(), threading.Event()

    class Gated(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            def held():
                started.set()
                assert gate.wait(10)
                return fn(*args, **kwargs)

            return super().submit(held)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(Gated(1))
        first = asyncio.create_task(store.push_async("worker", 0, {"w": np.ones(BIG, np.float32)}))
        while not started.is_set():  # noqa: ASYNC110 (a threading.Event, set by the executor)
            await asyncio.sleep(0.001)
        assert var.in_place and var.writing is not None
        await asyncio.wait_for(store.readable(["v", "unknown"]), 1)  # others: no wait
        reader = asyncio.create_task(store.readable(["v", "w"]))
        second = asyncio.create_task(store.push_async("worker", 1, {"w": np.ones(BIG, np.float32)}))
        await _settle()
        assert not reader.done() and not second.done()
        gate.set()
        assert (await first)["w"]["version"] == 1
        await asyncio.wait_for(reader, 5)
        assert (await asyncio.wait_for(second, 5))["w"]["version"] == 2
        assert not var.in_place and var.writing is None and store._off_loop.in_place == 0

    asyncio.run(scenario())
    assert var.value.ctypes.data == where and (var.value == 2).all()


class _Gates(concurrent.futures.ThreadPoolExecutor):
    """An executor whose n-th job waits for ``gates[n]`` (``started[n]`` set as it does)."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.gates = [threading.Event() for _ in range(count)]
        self.started = [threading.Event() for _ in range(count)]
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):
        gate, started = self.gates[self.jobs], self.started[self.jobs]
        self.jobs += 1

        def held():
            started.set()
            assert gate.wait(10)
            return fn(*args, **kwargs)

        return super().submit(held)


async def _until(event: threading.Event) -> None:
    while not event.is_set():  # noqa: ASYNC110 (a threading.Event: no awaitable to wait on)
        await asyncio.sleep(0.001)


def test_a_reader_waits_for_every_in_place_write_of_its_names_begun_while_it_waited():
    """push_async, in this process, worker threads held at gates: a reader of x and y waits
    for a big push writing x in place; meanwhile another push begins writing y in place. When
    the first is done the reader must still wait for the second (it read y half-written
    before), and then sees both new values whole."""
    store = ParameterStore(0, 1)
    store.init(
        {
            "x": (np.zeros(BIG, np.float32), Add().to_wire()),
            "y": (np.zeros(BIG, np.float32), Add().to_wire()),
        }
    )
    gates = _Gates(2)

    async def scenario() -> None:
        asyncio.get_running_loop().set_default_executor(gates)
        one = np.ones(BIG, np.float32)
        first = asyncio.create_task(store.push_async("a", 0, {"x": one.copy()}))
        await _until(gates.started[0])
        reader = asyncio.create_task(store.readable(["x", "y"]))
        await _settle()  # the reader waits for x
        second = asyncio.create_task(store.push_async("b", 0, {"y": one.copy()}))
        await _until(gates.started[1])
        assert store.get("y").in_place  # nobody waited for y when it began
        gates.gates[0].set()
        await first
        await _settle()
        assert not reader.done()  # y is still being written
        gates.gates[1].set()
        await asyncio.wait_for(reader, 5)
        assert store.get("y").writing is None
        assert [e["version"] for e in store.pull(["x", "y"]).values()] == [1, 1]
        await second

    asyncio.run(scenario())
    assert (store.get("x").value == 1).all() and (store.get("y").value == 1).all()


def test_a_push_after_a_waited_for_write_goes_to_fresh_memory_so_readers_wait_once():
    """While a reader waits for a big in-place write of x, the next big push of x (queued
    behind the first) is computed into fresh memory, not in place: the reader goes on after
    the first write and reads its value while the second one is computed; it is not kept
    waiting by a stream of writers."""
    store = ParameterStore(0, 1)
    store.init({"x": (np.zeros(BIG, np.float32), Add().to_wire())})
    var = store.get("x")
    home = var.value.ctypes.data
    gates = _Gates(2)
    read: list[int] = []

    async def reader() -> None:
        await store.readable(["x"])
        rows = store.pull_rows(["x"])
        read.append(rows.versions[0])
        assert (rows.values[0] == rows.versions[0]).all()

    async def scenario() -> None:
        asyncio.get_running_loop().set_default_executor(gates)
        one = np.ones(BIG, np.float32)
        first = asyncio.create_task(store.push_async("a", 0, {"x": one.copy()}))
        await _until(gates.started[0])
        second = asyncio.create_task(store.push_async("b", 0, {"x": one.copy()}))
        await _settle()  # second waits for first, as writers of x do
        task = asyncio.create_task(reader())
        await _settle()
        assert var.readers_waiting == 1
        gates.gates[0].set()
        await first
        await _until(gates.started[1])
        await asyncio.wait_for(task, 5)  # not held up by the second push
        assert read == [1] and not var.in_place and var.writing is not None
        gates.gates[1].set()
        assert (await second)["x"]["version"] == 2

    asyncio.run(scenario())
    assert var.value.ctypes.data != home and (var.value == 2).all()


def test_a_body_that_trickles_in_is_read_whole(fleet_factory):
    fleet = fleet_factory(1)
    n = 30_000  # 120 KB: a framed body, received in many pieces
    with PSClient(fleet.urls) as ps:
        ps.init({"t": np.zeros(n, np.float32)}, optimizer=Add())
    grad = np.arange(n, dtype=np.float32)
    body = wire.encode({"worker_id": "trickle", "seq": 1, "grads": {"t": grad}}, frame=True)
    data = body.join()
    host, port = fleet.urls[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(
            f"POST /v1/push HTTP/1.1\r\nhost: x\r\ncontent-type: {wire.FRAME}\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
        )
        for start in range(0, len(data), 4000):
            sock.sendall(data[start : start + 4000])
            time.sleep(0.002)  # let each piece arrive on its own
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    with PSClient(fleet.urls) as ps:
        np.testing.assert_array_equal(ps.pull(["t"])["t"], grad)


def test_data_plane_routes_go_direct_and_stay_documented(fleet2):
    spec = httpx2.get(fleet2.urls[0] + "/openapi.json").json()
    for verb in ("init", "pull", "push", "assign", "increment", "wait"):
        assert "post" in spec["paths"][f"/v1/{verb}"]

    def needs_auth() -> None:
        pass

    app = FastAPI()

    @app.post("/v1/plain")
    async def plain(request: Request) -> None:
        pass

    @app.post("/v1/guarded", dependencies=[Depends(needs_auth)])
    async def guarded(request: Request) -> None:
        pass

    @app.post("/v1/typed")
    async def typed(request: Request, limit: int = 3) -> None:
        pass

    @app.post("/v1/blocking")
    def blocking(request: Request) -> None:
        pass

    assert set(direct_routes(app)) == {"/v1/plain"}


def test_the_direct_path_keeps_the_apps_middleware():
    """Admission and the shard headers apply to data-plane requests that skip FastAPI's
    routing exactly as to the others (the app is driven in this process, its lifespan not run,
    so its gate stays where the test puts it)."""
    import asyncio

    from server.app import create_app, serving_app
    from server.config import ShardConfig

    app = create_app(ShardConfig())
    served = serving_app(app)

    async def main() -> None:
        transport = httpx2.ASGITransport(app=served)
        async with httpx2.AsyncClient(transport=transport, base_url="http://shard") as c:

            async def pull() -> httpx2.Response:
                return await c.post(
                    "/v1/pull",
                    content=msgpack.packb({"names": ["w"]}),
                    headers={"content-type": wire.MSGPACK},
                )

            r = await pull()  # restoring: the gate refuses it before the handler runs
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            app.state.gate.set_phase("ready")
            r = await pull()
            assert r.status_code == 404  # the handler ran: no such variable
            assert r.headers["x-paramshard-shard"] == "0/1"
            assert (await c.get("/healthz")).status_code == 200  # the rest: FastAPI's way

    asyncio.run(main())


def test_small_response_chunks_are_joined_and_big_ones_kept():
    big = memoryview(bytes(100_000))
    out = coalesce([b"head", b"", b"pad", big, b"a", b"b"], below=1000)
    assert out == [b"headpad", big, b"ab"]
    assert out[1] is big


def test_a_pull_of_many_small_variables_is_one_framed_reply(fleet_factory):
    fleet = fleet_factory(1)
    names = [f"v{i}" for i in range(100)]
    values = {n: np.full(1000, i, np.float32) for i, n in enumerate(names)}
    with PSClient(fleet.urls) as ps:
        ps.init(values)
        got = ps.pull(names)
    assert all(np.array_equal(got[n], values[n]) for n in names)
    # the same through the raw protocol, as another language's client would see it
    r = httpx2.post(
        fleet.urls[0] + "/v1/pull",
        content=msgpack.packb({"names": names}),
        headers={"content-type": wire.MSGPACK, "accept": wire.FRAME},
    )
    assert r.headers["content-type"] == wire.FRAME
    body = bytearray(r.content)
    msg = wire.unpack(body, wire.FRAME)
    assert np.array_equal(wire.decode_tensor(msg["variables"]["v7"]["value"], body), values["v7"])


def read_responses(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` HTTP responses with Content-Length off ``sock``: (status, body) each."""
    out, buf = [], b""
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            assert data, "the shard closed the connection"
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            int(v)
            for k, _, v in (ln.partition(":") for ln in lines[1:])
            if k.strip().lower() == "content-length"
        )
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((int(lines[0].split()[1]), buf[:length]))
        buf = buf[length:]
    return out


def test_requests_after_a_big_body_on_the_same_connection(fleet_factory):
    """A big body is read past the HTTP parser (server/httptools_protocol.py): whatever follows it
    on the connection, sent at once, in pieces, or after an early refusal, is still parsed."""
    fleet = fleet_factory(1)
    n = 200_000  # 800 KB: more than the shard reads at once, so most comes after the head
    with PSClient(fleet.urls) as ps:
        ps.init({"t": np.zeros(n, np.float32)}, optimizer=Add())
    grad = np.ones(n, np.float32)

    def push(seq: int) -> bytes:
        return wire.encode(
            {"worker_id": "pipe", "seq": seq, "grads": {"t": grad}}, frame=True
        ).join()

    pull = msgpack.packb({"names": ["t"]})

    def request(body: bytes, ctype: str = wire.MSGPACK, path: str = "/v1/pull") -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body

    host, port = fleet.urls[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        # a big push and a pull in one write: the pull starts inside the push's last piece
        sock.sendall(request(push(1), wire.FRAME, "/v1/push") + request(pull))
        (s1, _), (s2, body) = read_responses(sock, 2)
        assert (s1, s2) == (200, 200)
        msg = wire.unpack(body, wire.MSGPACK)
        assert wire.decode_tensor(msg["variables"]["t"]["value"]).min() == 1
        # a big body refused before it is read (wrong content type), then a pull
        sock.sendall(request(push(2), "text/plain", "/v1/push"))
        sock.sendall(request(pull))
        (s3, _), (s4, _) = read_responses(sock, 2)
        assert (s3, s4) == (415, 200)
        # a big push whose last byte comes alone, then a pull
        data = request(push(3), wire.FRAME, "/v1/push")
        sock.sendall(data[:-1])
        time.sleep(0.05)
        sock.sendall(data[-1:] + request(pull))
        (s5, _), (s6, body) = read_responses(sock, 2)
        assert (s5, s6) == (200, 200)
        msg = wire.unpack(body, wire.MSGPACK)
        assert wire.decode_tensor(msg["variables"]["t"]["value"]).min() == 2


class _BodyEcho:
    """An ASGI app that reads each body the way server/bodies.py does when the server offers
    ``BODY_INTO`` and answers ``b"direct "`` or ``b"pieces "`` and the body's SHA-256."""

    def __init__(self) -> None:
        self.disconnects = 0
        self.bodies = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        size = int(dict(scope["headers"]).get(b"content-length", b"0"))
        buf = memoryview(bytearray(size))
        into = scope.get("extensions", {}).get(BODY_INTO)
        self.bodies += 1
        seen: list[int] = []
        failing = self.bodies == 3  # every third body: a watch that fails on its 2nd call

        def watch(received: int) -> None:
            seen.append(received)
            if failing and len(seen) == 2:
                raise RuntimeError("a watch that fails")

        direct = into is not None and into.receive_into(buf, watch)
        pos, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            body, more = message.get("body", b""), message.get("more_body", False)
            assert not (direct and body)
            buf[pos : pos + len(body)] = body
            pos += len(body)
        if direct:  # the watch saw the bytes arrive, then was let go (it may hold buf)
            assert into.received == size and into.watch is None
            assert seen == sorted(seen) and seen[-1] == (seen[1] if failing else size)
        reply = (b"direct " if direct else b"pieces ") + hashlib.sha256(buf).hexdigest().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(reply)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": reply})


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_big_body_is_written_straight_into_the_apps_buffer(loop):
    """server/httptools_protocol.py on its own, in a uvicorn server in this process: a big body is
    received into the app's buffer (BODY_INTO), whole and unchanged, whether it comes in
    pieces or together with the next request on the connection; a client leaving mid-body is
    reported to the app and the server serves on."""
    app = _BodyEcho()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            loop=loop,
            http=ShardHttpProtocol,
            lifespan="off",
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        eventually(lambda: server.started or not thread.is_alive(), "the server starts")
        assert server.started, "the server did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        rng = np.random.default_rng(2)
        big = rng.bytes(3 << 20)
        small = b"tiny"

        def request(body: bytes) -> bytes:
            return (
                f"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                + body
            )

        def expect(kind: bytes, body: bytes) -> tuple[int, bytes]:
            return 200, kind + b" " + hashlib.sha256(body).hexdigest().encode()

        with socket.create_connection(("127.0.0.1", port)) as sock:
            data = request(big)
            sock.sendall(data[:100_000])  # the head and some of the body, then the rest
            time.sleep(0.05)
            sock.sendall(data[100_000:] + request(small) + request(big))
            assert read_responses(sock, 3) == [
                expect(b"direct", big),
                expect(b"pieces", small),
                expect(b"direct", big),
            ]
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request(big)[: 2 << 20])  # and goes away, once the app reads it
            eventually(lambda: app.bodies == 4, "the app starts reading the fourth body")
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request(big))
            assert read_responses(sock, 1) == [expect(b"direct", big)]
        eventually(lambda: app.disconnects, "the app hears of the client leaving")
        assert app.disconnects == 1
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("dtype", ["<f2", "<f4", ">f4", "<f8"])
@pytest.mark.parametrize("shape", [(SMALL_CHECK + 7,), (300, 301)])
def test_the_finiteness_check_is_exact(dtype, shape):
    """all_finite (the check every gradient and value goes through): exactly
    np.isfinite(a).all(), also where its fast reduction overflows on finite values."""
    rng = np.random.default_rng(hash((dtype, shape)) % 2**32)
    base = rng.standard_normal(shape).astype(dtype)
    huge = np.finfo(np.dtype(dtype)).max
    cases = {"normal": base}
    for label, bad in (
        ("nan", np.nan),
        ("inf", np.inf),
        ("-inf", -np.inf),
        ("huge", huge),
        ("-huge", -huge),
    ):
        a = base.copy()
        a.reshape(-1)[rng.integers(a.size)] = bad
        cases[label] = a
    cases["all huge"] = np.full(shape, huge, dtype)
    with np.errstate(all="ignore"):  # as its callers do (its reduction may overflow)
        for label, a in cases.items():
            assert all_finite(a) == bool(np.isfinite(a).all()), label


def _scan_in_pieces(body: bytes, seed: int) -> dict[str, float]:
    """Feed a FiniteScan the body as a socket would: into one buffer, in random pieces."""
    buf = memoryview(np.empty(len(body), np.uint8))
    scan = FiniteScan(buf)
    rng = np.random.default_rng(seed)
    pos = 0
    scan(0)
    while pos < len(body):
        end = min(len(body), pos + int(rng.integers(1, 600_000)))
        buf[pos:end] = body[pos:end]
        pos = end
        scan(pos)
    return scan.finite


@pytest.mark.parametrize("layout", ["map", "table"])
def test_the_arrival_scan_names_exactly_the_finite_float_gradients(layout):
    """FiniteScan, fed a framed push body piece by piece: it names a gradient only when it
    read every byte of it and found no NaN or infinity; anything it cannot vouch for (f2,
    overflow of its reduction, non-float) is left to the store's exact check."""
    n = 300_000
    grads = {
        "ok32": np.ones(n, np.float32),
        "ok64": np.full((300, 500), 0.5),
        "nan-last": np.ones(n, np.float32),
        "inf-first": np.ones(n, np.float32),
        "huge": np.full(n, 3e38, np.float32),  # finite, but its squares overflow
        "half": np.ones(n, np.float16),
        "ints": np.ones(n, np.int32),
        "small": np.ones(10, np.float32),
    }
    grads["nan-last"][-1] = np.nan
    grads["inf-first"][0] = np.inf
    msg = {"worker_id": "w", "seq": 1}
    if layout == "table":
        table = msg["grads"] = {"names": list(grads)}
        body = wire.encode_table({**msg, "layout": "table"}, table, list(grads.values())).join()
    else:
        body = wire.encode({**msg, "grads": grads}, frame=True).join()
    for seed in range(3):
        found = _scan_in_pieces(body, seed)
        assert set(found) == {"ok32", "ok64", "small"}
        for name, squares in found.items():  # each with its sum of squares
            assert squares == pytest.approx(float(np.sum(grads[name].astype(np.float64) ** 2)))
    # Not a framed push, or a header that does not parse: nothing named, nothing raised.
    assert _scan_in_pieces(wire.encode({**msg, "grads": {"a": np.ones(3)}}).join(), 0) == {}
    broken = bytearray(body)
    broken[8:12] = b"\xc1\xc1\xc1\xc1"  # msgpack's never-used byte
    assert _scan_in_pieces(bytes(broken), 0) == {}


def _same_shaped_push(
    rows: list[np.ndarray], big: bool = False
) -> tuple[list[str], np.ndarray | None]:
    """A push table of ``rows`` encoded and decoded as a shard does: the names and the
    gradients as one block (or None). ``big``: the body in a buffer of ``np.empty`` memory, as
    a shard reads a body of 64 KiB or more (the rows' ``base`` is then that buffer)."""
    table = {"names": [f"g{i}" for i in range(len(rows))]}
    body = wire.encode_table({"grads": table}, table, rows).join()
    buffer = memoryview(np.frombuffer(body, np.uint8).copy()) if big else bytearray(body)
    grads = wire.unpack(buffer, wire.FRAME)["grads"]
    names, arrays, block = wire.table_rows(grads, buffer, with_block=True)
    if block is not None:  # the block's rows are the rows table_rows gives
        assert all(
            np.shares_memory(a, b) and np.array_equal(a, b, equal_nan=True)
            for a, b in zip(arrays, block)
        )
    return names, block


@pytest.mark.parametrize("big", [False, True])
def test_same_shaped_gradients_are_checked_in_one_pass_exactly(big):
    """finite_rows names exactly the rows with no NaN or infinity that its one reduction can
    vouch for (an overflow of finite values is left to the store's exact check), and nothing
    at all for gradients that are not the rows of one float block; whatever memory the body
    is in."""
    rows = [np.ones((3, 5), np.float32) for _ in range(6)]
    rows[1][2, 4] = np.nan
    rows[3][0, 0] = -np.inf
    rows[4][1, 1] = 3e38  # finite, but its square overflows
    names, block = _same_shaped_push(rows, big)
    found = finite_rows(names, block)
    assert set(found) == {"g0", "g2", "g5"}
    assert all(found[n] >= 15 for n in found)  # at least each row's sum of squares
    assert finite_rows(names[:1], block[:1]) == {}  # one row: the store's check
    assert finite_rows(names[:5], block) == {}  # names and rows do not match
    assert finite_rows(names, None) == {}
    halves = _same_shaped_push([np.ones(8, np.float16)] * 3, big)
    assert halves[1] is not None and finite_rows(*halves) == {}
    mixed = _same_shaped_push([np.ones(8, np.float32), np.ones(9, np.float32)], big)
    assert mixed[1] is None and finite_rows(*mixed) == {}


def test_finite_rows_first_reduces_the_whole_span_padding_and_all():
    """The one reduction over the rows' whole span (finite rows, the usual case) vouches for
    every row; when the padding between rows is not finite, or a row is not, the rows are
    told apart one by one, so finite rows are still named and a bad one never is."""
    n, width = 5, 15  # 60-byte rows at a 64-byte stride: 4 bytes of padding after each
    memory = np.zeros(n * 16, np.float32)
    block = np.ndarray((n, width), np.float32, memory, 0, (64, 4))
    names = [f"g{i}" for i in range(n)]
    assert set(finite_rows(names, block)) == set(names)
    memory[15::16] = np.nan  # every row's padding
    assert not np.isfinite(memory).all() and np.isfinite(block).all()
    assert set(finite_rows(names, block)) == set(names)
    memory[3 * 16 + 7] = np.inf  # inside row 3
    assert set(finite_rows(names, block)) == set(names) - {"g3"}
    assert set(finite_rows(names[1:], block[1:])) == set(names[1:]) - {"g3"}
    memory[:] = 0
    memory[(n - 1) * 16 + width - 1] = np.nan  # the very last element of the span
    assert set(finite_rows(names, block)) == set(names) - {f"g{n - 1}"}


@pytest.mark.parametrize("count", [8, 100])  # a 32 KB body, and a 400 KB one (read into
def test_a_same_shaped_push_with_a_bad_row_changes_nothing(fleet_factory, count):  # np.empty)
    """Through a real shard: a table of same-shaped gradients (checked in one pass) with a NaN
    in one row is refused naming that variable, and no variable moves; huge finite values
    (whose squares overflow the one-pass check) are applied."""
    fleet = fleet_factory(1)
    names = [f"same/{i}" for i in range(count)]
    with PSClient(fleet.urls) as ps:
        ps.init({n: np.zeros(1000, np.float32) for n in names}, optimizer=Add())
        grads = {n: np.ones(1000, np.float32) for n in names}
        grads[names[5]] = grads[names[5]].copy()
        grads[names[5]][999] = np.nan
        with pytest.raises(BadTensorError) as err:
            ps.push(grads)
        assert names[5] in str(err.value)
        assert all(not v.any() for v in ps.pull(names).values())
        grads[names[5]][999] = 3e38
        ps.push(grads)
        pulled = ps.pull(names)
        assert pulled[names[5]][999] == np.float32(3e38) and pulled[names[0]].sum() == 1000


def test_a_gradient_found_finite_as_received_is_checked_again_once_cast():
    """The store skips its check for gradients named finite, except when it casts them: a
    finite f8 gradient can overflow f4."""
    store = ParameterStore(0, 1)
    store.init({"w": (np.zeros(4, np.float32), Add().to_wire())})
    with pytest.raises(ShardError) as err:
        store.push("worker", 0, {"w": np.full(4, 1e39)}, finite={"w": 0.0})
    assert err.value.code == "bad_tensor"
    assert store.get("w").version == 0
    store.push("worker", 1, {"w": np.full(4, 2.0, np.float32)}, finite={"w": 16.0})
    assert (store.get("w").value == 2).all()


# -- how a response is written (server/httptools_protocol.py, _HeadWithBody) -----------------------

BIG_REPLY = server_protocol.JOIN_BELOW  # bytes: a reply its pieces are not joined for


async def _replies(scope, receive, send) -> None:
    """Answers by path, the way the shard's responses are made (EncodedResponse) and ways a
    response could be made."""
    path = scope["path"]
    if path == "/expect":
        while (await receive()).get("more_body"):
            pass
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (
                b"content-length",
                str({"/gather": 9, "/gather-big": BIG_REPLY + 6}.get(path, 3)).encode(),
            )
        ],
    }
    await send(start)
    if path == "/fail":
        raise RuntimeError("fails after the head")
    if path == "/stream":
        for piece, more in ((b"a", True), (b"b", True), (b"c", False)):
            await send({"type": "http.response.body", "body": piece, "more_body": more})
    elif path == "/gather":
        assert GATHER in scope["extensions"]
        pieces = [b"ab", np.arange(3, dtype=np.uint8), memoryview(b"cdef")]
        await send({"type": "http.response.body", "body": Gathered(pieces, 9)})
    elif path == "/gather-big":
        pieces = [b"ab", np.full(BIG_REPLY, 7, dtype=np.uint8), memoryview(b"cdef")]
        await send({"type": "http.response.body", "body": Gathered(pieces, BIG_REPLY + 6)})
    else:
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else b"xyz"}
        )


def _writes(
    request: bytes | list[bytes],
    vectored: bool = True,
    app=_replies,
    protocol=ShardHttpProtocol,
    default_headers=(),
) -> Recorder:
    """Feed ``request`` (or each of a list, once the one before is answered) to ``protocol``
    (a ShardHttpProtocol) serving ``app`` (:func:`_replies`), with no access log (as a shard
    serves); the recorded writes."""

    async def run() -> Recorder:
        config = uvicorn.Config(
            app,
            http=protocol,
            lifespan="off",
            log_level="critical",
            access_log=False,
            proxy_headers=False,
        )
        config.load()
        state = ServerState()
        state.default_headers = list(default_headers)
        proto = protocol(config=config, server_state=state, app_state={})
        transport = Recorder()
        proto.connection_made(transport)
        for data in [request] if isinstance(request, bytes) else request:
            before = proto.cycle
            proto.data_received(data)
            for _ in range(200):  # until answered (an upgrade makes no cycle: all 200)
                cycle = proto.cycle
                if transport.closed or (cycle is not before and cycle.response_complete):
                    break
                await asyncio.sleep(0)
        proto.connection_lost(None)
        return transport

    original = server_protocol._vectored
    server_protocol._vectored = lambda transport: vectored
    try:
        return asyncio.run(run())
    finally:
        server_protocol._vectored = original


def _req(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def _head_and_body(sent: bytes) -> tuple[bytes, bytes]:
    head, sep, body = sent.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 200")
    return head, body


@pytest.mark.parametrize("vectored", [True, False])
def test_a_response_goes_out_in_one_write(vectored):
    """The head is held and written with the body (one system call, one wake-up of the
    client): joined to a small body; with a big gathered body's pieces in one vectored write
    where the transport has one (else joined)."""
    for path, body in (("/small", b"xyz"), ("/gather", b"ab\x00\x01\x02cdef")):
        t = _writes(_req("POST", path), vectored)
        assert [kind for kind, _ in t.calls] == ["write"], path
        assert _head_and_body(t.sent())[1] == body
    t = _writes(_req("POST", "/gather-big"), vectored)
    if vectored:
        assert [kind for kind, _ in t.calls] == ["writelines"]
        assert len(t.calls[0][1]) == 4  # the head and the three pieces, none joined
    else:
        assert [kind for kind, _ in t.calls] == ["write"]
    assert _head_and_body(t.sent())[1] == b"ab" + bytes([7]) * BIG_REPLY + b"cdef"


def test_a_streamed_response_sends_its_head_with_the_first_piece():
    t = _writes(_req("POST", "/stream"))
    assert [kind for kind, _ in t.calls] == ["write"] * 3
    assert t.calls[0][1].endswith(b"\r\n\r\na") and [d for _, d in t.calls[1:]] == [b"b", b"c"]
    assert _head_and_body(t.sent())[1] == b"abc"


_HEADS = [  # (status, response headers, body): each head built as uvicorn builds it
    (200, [(b"content-length", b"3")], b"xyz"),
    (200, [(b"Content-Length", b"3"), (b"X-Mixed-Case", b"Value")], b"xyz"),
    (200, [(b"content-length", b"3"), (b"content-length", b"3")], b"xyz"),
    (200, [(b"transfer-encoding", b"chunked")], b"xyz"),
    (200, [(b"content-type", b"text/plain")], b"xyz"),  # no length: chunked
    (200, [(b"content-length", b"3"), (b"connection", b"Keep-Alive, Close")], b"xyz"),
    (200, [(b"connection", b"close"), (b"content-length", b"3")], b"xyz"),
    (204, [], b""),
    (200, [(b"bad name", b"x"), (b"content-length", b"3")], b"xyz"),
    (200, [(b"content-length", b"3"), (b"x-bad-value", b"a\nb")], b"xyz"),
    (200, [(b"content-length", b"3"), (b"x-ok-value", b"a\tb")], b"xyz"),
]


@pytest.mark.parametrize("status,headers,body", _HEADS)
@pytest.mark.parametrize("closing", [False, True])
def test_a_response_head_is_what_uvicorn_would_write(status, headers, body, closing):
    """The shard's cycle, which holds a response's head to write it with the body, writes
    byte for byte what uvicorn's own protocol writes, with the same effect on the connection
    (kept, or closed after a Connection: close either way, or after a refused header)."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    request = _req("POST", "/", extra="connection: close\r\n" if closing else "")
    date = [(b"date", b"Tue, 24 Nov 2026 10:00:00 GMT")]
    theirs = _writes(request, app=app, protocol=HttpToolsProtocol, default_headers=date)
    ours = _writes(request, app=app, default_headers=date)
    assert ours.sent() == theirs.sent() and ours.closed == theirs.closed
    assert (ours.sent() == b"") == any(b" " in n or b"\n" in v for n, v in headers)


_UPGRADE = (
    b"GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
)


@pytest.mark.parametrize("first", [b"", _req("POST", "/small")])
def test_a_websocket_upgrade_is_handed_on_as_uvicorn_does(first):
    """An upgrade request makes no request cycle: what answers it is uvicorn's websocket
    handling, as under uvicorn's own protocol (first on a connection: a 403, the app closes
    the socket), not a 400 from a write-holding cycle that is not there."""

    async def app(scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close"})
        else:
            await _replies(scope, receive, send)

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    def status_lines(protocol) -> list[bytes]:
        sent = _writes([r for r in (first, _UPGRADE) if r], app=app, protocol=protocol).sent()
        return [line for line in sent.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]

    ours = status_lines(ShardHttpProtocol)
    assert ours == status_lines(HttpToolsProtocol)
    if not first:
        assert ours == [b"HTTP/1.1 403 Forbidden"]


def test_head_requests_interim_responses_and_failures_are_written_as_before():
    """A HEAD response (no body message to wait for) is written at once; a 100 Continue goes
    out before the app reads the body; an app that fails after its head leaves a closed
    connection with nothing half-written, as uvicorn would after such a failure."""
    t = _writes(_req("HEAD", "/small"))
    assert [kind for kind, _ in t.calls] == ["write"]
    assert _head_and_body(t.sent())[1] == b""
    t = _writes(_req("POST", "/expect", b"hello", "expect: 100-continue\r\n"))
    assert t.calls[0] == ("write", b"HTTP/1.1 100 Continue\r\n\r\n")
    assert _head_and_body(t.sent()[len(t.calls[0][1]) :])[1] == b"xyz"
    t = _writes(_req("POST", "/fail"))
    assert t.calls == [] and t.closed


# -- reading a small body (bodies.read_body, the piece by piece path) ----------------------


@pytest.mark.parametrize(
    "pieces,declared,expect",
    [
        ([b"\x81\xa1a", b"\x01"], 4, b"\x81\xa1a\x01"),
        ([b"\x81\xa1a\x01"], 4, b"\x81\xa1a\x01"),
        ([b"\x81\xa1", b""], 4, "body ended after 2 of 4 bytes"),
        ([b"\x81\xa1a\x01\x02"], 4, "longer than its Content-Length"),
        ([b"\x81\xa1", None], 4, "went away"),  # None: the client leaves
    ],
)
def test_a_small_body_is_read_whole_or_refused(pieces, declared, expect):
    """Each ``http.request`` message's body in turn (an empty last one ends it); a body
    shorter or longer than its Content-Length, or cut off by a client that leaves, is a 400
    ``bad_request`` saying which."""
    messages = [
        {"type": "http.disconnect"}
        if p is None
        else {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]

    async def receive():
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/pull",
        "headers": [
            (b"content-type", wire.MSGPACK.encode()),
            (b"content-length", str(declared).encode()),
        ],
    }
    request = Request(scope, receive)
    if isinstance(expect, bytes):
        body, kind = asyncio.run(read_body(request, 1 << 20))
        assert bytes(body) == expect and kind == wire.MSGPACK and not messages
    else:
        with pytest.raises(ShardError) as refused:
            asyncio.run(read_body(request, 1 << 20))
        assert refused.value.code == "bad_request" and expect in refused.value.message


# -- a request's headers (server/headers.py) -----------------------------------------------------


def test_request_headers_give_the_first_of_repeats_from_any_iterable_once_per_request():
    pairs = [
        (b"accept", b"a"),
        (b"content-length", b"12"),
        (b"accept", b"b"),
        (b"x-name", "caf\u00e9".encode("latin-1")),
    ]
    for given in (pairs, tuple(pairs), (p for p in pairs)):
        scope = {"type": "http", "headers": given}
        assert header(scope, b"accept") == "a" and header(scope, b"content-length") == "12"
        assert header(scope, b"x-name") == "caf\u00e9"
        assert header(scope, b"missing") is None and header(scope, b"missing", "") == ""
        made = request_headers(scope)
        assert request_headers(scope) is made  # once per request
    assert request_headers({"type": "http"}) == {}
