"""Background pushes (client_sdk/_pusher.py): one policy, :class:`Slots`, and the two shells
that drive it, the thread pusher of ``PSClient`` and the asyncio one of ``AsyncPSClient``.

The policy is tested alone (pure state), then each shell runs the same scenarios with pushes
that are lists of gradients' names and finish when the test lets them: no shard, no timing.
A push's "merge" appends the later push's names, so the order in which pushes ran and what
each carried are plain lists to compare.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from client_sdk._exceptions import PSError, PushError
from client_sdk._pusher import AsyncPusher, Decision, Pusher, Slots

#: Generous bound on any wait in these tests (they finish in milliseconds).
WAIT = 30.0


def merge(into: list[str], new: list[str]) -> None:
    into.extend(new)


# -- the policy alone --------------------------------------------------------------------------


def test_slots_start_wait_merge_and_hand_a_freed_slot_to_the_waiting_push():
    slots: Slots[str] = Slots(2)
    assert slots.offer(False) is Decision.START
    slots.started("a")
    assert slots.offer(True) is Decision.START  # a free slot: coalescing changes nothing
    slots.started("b")
    assert slots.running == 2
    assert slots.offer(False) is Decision.FULL  # the caller blocks
    assert slots.offer(True) is Decision.WAIT
    slots.wait_as(["c"], "c")
    assert slots.offer(True) is Decision.MERGE and slots.waiting == (["c"], "c")
    assert slots.offer(False) is Decision.FULL  # a blocking push never joins the waiting one
    assert slots.finished() == (["c"], "c")  # a's slot goes to the waiting push
    assert slots.running == 2 and slots.waiting is None
    slots.done("a")
    assert slots.finished() is None and slots.running == 1  # b's slot is free
    assert slots.pending == {"b", "c"}
    slots.done("b", PSError("b failed"))
    error = slots.flushed()
    assert isinstance(error, PushError) and [e.message for e in error.errors] == ["b failed"]
    assert slots.flushed() is None  # each failure is raised by one flush
    slots.closed = True
    with pytest.raises(PSError, match="closed"):
        slots.offer(True)


def test_a_waiting_push_done_before_it_started_waits_no_more():
    slots: Slots[str] = Slots(1)
    assert slots.offer(False) is Decision.START
    slots.started("a")
    assert slots.offer(True) is Decision.WAIT
    slots.wait_as(["w"], "w")
    slots.done("w", PSError("cancelled"))  # cancelled while it waited
    assert slots.waiting is None and slots.pending == {"a"}
    assert slots.offer(True) is Decision.WAIT  # the next coalescing push waits afresh
    assert slots.flushed() is not None


# -- the thread pusher -------------------------------------------------------------------------


class Gated:
    """Pushes that each wait for the test to let them finish, recording what ran."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.gates: dict[str, threading.Event] = {}
        self.started = threading.Semaphore(0)

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def run(self, job: list[str]) -> list[str]:
        self.ran.append(list(job))
        self.started.release()
        assert self.gate(job[0]).wait(WAIT)
        if job[0].startswith("bad"):
            raise PSError(f"{job[0]} refused")
        if job[0].startswith("bug"):
            raise RuntimeError("not a PSError")
        return job

    def let(self, name: str) -> None:
        self.gate(name).set()

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=WAIT)


def test_threads_coalesce_and_hand_a_freed_slot_to_the_waiting_push_first():
    gated = Gated()
    pusher = Pusher(1, gated.run, merge)
    a = pusher.submit(["a"])
    gated.wait_started()
    blocked: concurrent.futures.Future = concurrent.futures.Future()
    thread = threading.Thread(target=lambda: blocked.set_result(pusher.submit(["d"])))
    thread.start()  # blocks: the one slot is a's
    b = pusher.submit(["b"], coalesce=True)
    c = pusher.submit(["c"], coalesce=True)
    assert c is b and not b.done() and pusher.inflight == 1
    gated.let("a")
    gated.wait_started()
    assert gated.ran == [["a"], ["b", "c"]]  # the waiting push ran before the blocked one
    gated.let("b")
    gated.wait_started()
    gated.let("d")
    thread.join(WAIT)
    pusher.flush()
    assert a.result() == ["a"] and b.result() == ["b", "c"]
    assert blocked.result(WAIT).result() == ["d"]
    assert gated.ran == [["a"], ["b", "c"], ["d"]]
    pusher.close()


def test_threads_keep_every_failure_for_one_flush():
    gated = Gated()
    pusher = Pusher(2, gated.run, merge)
    for name in ("bad1", "bug2", "ok3"):
        gated.let(name)
    futures = [pusher.submit([name]) for name in ("bad1", "bug2", "ok3")]
    with pytest.raises(PushError) as caught:
        pusher.flush()
    assert sorted(type(e).__name__ for e in caught.value.errors) == ["PSError", "PSError"]
    with pytest.raises(PSError, match="bad1 refused"):
        futures[0].result()
    with pytest.raises(PSError, match="inside the SDK"):
        futures[1].result()
    assert futures[2].result() == ["ok3"]
    pusher.flush()  # raised once
    gated.let("bad4")
    pusher.submit(["bad4"])
    with pytest.raises(PushError, match="bad4 refused"):
        pusher.close()  # never flushed: close raises it


def test_threads_a_cancelled_waiting_push_is_a_failure_and_frees_the_wait():
    gated = Gated()
    pusher = Pusher(1, gated.run, merge)
    pusher.submit(["a"])
    gated.wait_started()
    waiting = pusher.submit(["w"], coalesce=True)
    assert waiting.cancel()
    later = pusher.submit(["x"], coalesce=True)
    assert later is not waiting
    gated.let("a")
    gated.wait_started()
    gated.let("x")
    with pytest.raises(PushError, match="cancelled"):
        pusher.flush()
    assert later.result() == ["x"] and gated.ran == [["a"], ["x"]]
    pusher.close()


def test_threads_a_caller_blocked_for_a_slot_learns_the_pusher_closed():
    gated = Gated()
    pusher = Pusher(1, gated.run, merge)
    pusher.submit(["a"])
    gated.wait_started()
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def blocked() -> None:
        try:
            pusher.submit(["d"])
        except PSError as exc:
            outcome.set_result(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    closing = threading.Thread(target=pusher.close)
    closing.start()
    assert "closed" in str(outcome.result(WAIT))  # before a finished
    gated.let("a")
    closing.join(WAIT)
    thread.join(WAIT)
    assert not closing.is_alive() and gated.ran == [["a"]]


# -- the asyncio pusher ------------------------------------------------------------------------


class AsyncGated:
    """:class:`Gated` for the asyncio pusher."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.started: asyncio.Queue[str] = asyncio.Queue()

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def run(self, job: list[str]) -> list[str]:
        self.ran.append(list(job))
        self.started.put_nowait(job[0])
        await asyncio.wait_for(self.gate(job[0]).wait(), WAIT)
        if job[0].startswith("bad"):
            raise PSError(f"{job[0]} refused")
        return job

    def let(self, name: str) -> None:
        self.gate(name).set()

    async def wait_started(self) -> str:
        return await asyncio.wait_for(self.started.get(), WAIT)


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_tasks_coalesce_and_hand_a_freed_slot_to_the_waiting_push_first():
    async def main() -> None:
        gated = AsyncGated()
        pusher = AsyncPusher(1, gated.run, merge)
        a = await pusher.submit(["a"])
        assert await gated.wait_started() == "a"
        blocked = asyncio.ensure_future(pusher.submit(["d"]))
        await settle()  # d's caller waits for the slot before b and c come
        assert not blocked.done()
        b = await pusher.submit(["b"], coalesce=True)
        c = await pusher.submit(["c"], coalesce=True)
        assert c is b and not b.done() and pusher.inflight == 1
        gated.let("a")
        assert await gated.wait_started() == "b"  # the waiting push before the blocked one
        gated.let("b")
        d = await asyncio.wait_for(blocked, WAIT)
        assert await gated.wait_started() == "d"
        gated.let("d")
        await pusher.flush()
        assert await a == ["a"] and await b == ["b", "c"] and await d == ["d"]
        assert gated.ran == [["a"], ["b", "c"], ["d"]]
        await pusher.close()

    asyncio.run(main())


def test_tasks_keep_every_failure_and_a_cancelled_waiting_push():
    async def main() -> None:
        gated = AsyncGated()
        pusher = AsyncPusher(1, gated.run, merge)
        bad = await pusher.submit(["bad1"])
        await gated.wait_started()
        waiting = await pusher.submit(["w"], coalesce=True)
        waiting.cancel()
        await settle()
        later = await pusher.submit(["x"], coalesce=True)
        assert later is not waiting
        gated.let("bad1")
        assert await gated.wait_started() == "x"
        gated.let("x")
        with pytest.raises(PushError) as caught:
            await pusher.flush()
        assert sorted(e.message.split()[0] for e in caught.value.errors) == ["an", "bad1"]
        with pytest.raises(PSError, match="bad1 refused"):
            await bad
        assert await later == ["x"] and gated.ran == [["bad1"], ["x"]]
        await pusher.flush()  # raised once
        await pusher.close()

    asyncio.run(main())


def test_tasks_a_caller_blocked_for_a_slot_learns_the_pusher_closed():
    async def main() -> None:
        gated = AsyncGated()
        pusher = AsyncPusher(1, gated.run, merge)
        await pusher.submit(["a"])
        await gated.wait_started()
        blocked = asyncio.ensure_future(pusher.submit(["d"]))
        await settle()
        closing = asyncio.ensure_future(pusher.close())
        with pytest.raises(PSError, match="closed"):
            await asyncio.wait_for(blocked, WAIT)  # before a finished
        gated.let("a")
        await asyncio.wait_for(closing, WAIT)
        assert gated.ran == [["a"]]

    asyncio.run(main())
