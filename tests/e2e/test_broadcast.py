"""Learner -> actors broadcast through the SDK: ``pull(..., newer_than=...)`` and
``pull(..., min_version=...)`` (docs/PROTOCOL.md §3 poll), sync and asyncio, against real shard
processes.

A learner pushes; actors block in a pull until a newer version exists and get only what
changed. How many polls a shard holds is read from the shard (``polls_waiting`` in
``GET /v1/cluster``), never guessed with a sleep; the one bound on time here is a generous one
against a poll that would wait for its whole timeout. The CPU test reads the shard process's
own CPU time from ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable

import httpx2
import numpy as np
import pytest

from client_sdk import AsyncPSClient, BadRequestError, NotReadyError, PSClient
from client_sdk.optimizers import Add
from client_sdk.placement import shard_for
from tests.conftest import OnLoop, http_json
from tests.helpers.names import fresh


def named_on(shard: int, num_shards: int, prefix: str) -> str:
    """A fresh name that places on ``shard`` of ``num_shards``."""
    while True:
        name = fresh(prefix)
        if shard_for(name, num_shards) == shard:
            return name


def polls_waiting(urls: list[str]) -> int:
    return sum(http_json(f"{u}/v1/cluster")["polls_waiting"] for u in urls)


def until(predicate: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.02)


@pytest.fixture(params=["sync", "sync-httpx2", "async"])
def client(request, fleet2):
    """A client of the 2-shard fleet: ``PSClient`` (over its own HTTP pool, or over httpx2's
    transport, whose streams a race cuts short differently), or ``AsyncPSClient`` driven on a
    loop."""
    if request.param == "sync":
        ps = PSClient(fleet2.urls, worker_id=fresh("actor"))
    elif request.param == "sync-httpx2":
        ps = PSClient(fleet2.urls, worker_id=fresh("actor"), transport=httpx2.HTTPTransport())
    else:
        ps = OnLoop(AsyncPSClient(fleet2.urls, worker_id=fresh("actor")))
    yield ps
    ps.close()


@pytest.fixture
def learner(fleet2):
    with PSClient(fleet2.urls, worker_id=fresh("learner")) as ps:
        yield ps


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        yield ex


def wait_for_polls(urls: list[str], count: int, future: concurrent.futures.Future) -> None:
    until(lambda: future.done() or polls_waiting(urls) >= count, f"{count} poll(s) wait")
    assert not future.done(), future.result()


# -- newer_than --------------------------------------------------------------------------------


def test_newer_than_cached_returns_only_what_changed(client, learner, fleet2, pool):
    a, b = named_on(0, 2, "a"), named_on(0, 2, "b")
    learner.init({a: np.zeros(3, np.float32), b: np.zeros(2, np.float32)}, optimizer=Add())
    client.pull([a, b])  # the actor holds version 0 of both
    before = polls_waiting(fleet2.urls)
    future = pool.submit(client.pull, [a, b], newer_than="cached", timeout=25)
    wait_for_polls(fleet2.urls, before + 1, future)
    learner.push({a: np.ones(3, np.float32)})
    got = future.result(timeout=20)
    assert list(got) == [a]
    np.testing.assert_array_equal(got[a], np.ones(3))
    # The cache now holds the new version: nothing is newer than it.
    assert client.pull([a, b], newer_than="cached", timeout=0.2) == {}


def test_newer_than_returns_an_empty_dict_at_the_timeout(client, learner):
    a = fresh()
    learner.init({a: np.zeros(2, np.float32)})
    client.pull([a])
    assert client.pull([a], newer_than="cached", timeout=0.3) == {}


def test_newer_than_without_a_cached_value_returns_it_at_once(client, learner):
    a = fresh()
    learner.init({a: np.arange(4, dtype=np.float32)})
    got = client.pull([a], newer_than="cached", timeout=25)
    np.testing.assert_array_equal(got[a], np.arange(4))


def test_newer_than_a_map_of_versions(client, learner):
    a, b = fresh("a"), fresh("b")
    learner.init({a: np.zeros(2, np.float32), b: np.zeros(2, np.float32)}, optimizer=Add())
    version = learner.push({b: np.ones(2, np.float32)})[b]["version"]
    got = client.pull([a, b], newer_than={a: 0, b: version - 1}, timeout=25)
    assert list(got) == [b]
    np.testing.assert_array_equal(got[b], np.ones(2))
    assert client.pull([a, b], newer_than={a: 0, b: version}, timeout=0.2) == {}


def test_a_change_on_one_shard_ends_a_wait_across_two(client, learner, fleet2, pool):
    """Names on two shards; only one shard's variable changes: the call returns with it, long
    before its timeout (the other shard's poll is not waited for)."""
    a, b = named_on(0, 2, "a"), named_on(1, 2, "b")
    learner.init({a: np.zeros(2, np.float32), b: np.zeros(2, np.float32)}, optimizer=Add())
    client.pull([a, b])
    before = polls_waiting(fleet2.urls)
    started = time.monotonic()
    future = pool.submit(client.pull, [a, b], newer_than="cached", timeout=30)
    wait_for_polls(fleet2.urls, before + 2, future)
    learner.push({b: np.ones(2, np.float32)})
    got = future.result(timeout=25)
    assert list(got) == [b]
    assert time.monotonic() - started < 25  # not the 30 s the other shard would have waited
    # The shard that saw no change holds no poll for this client any more.
    until(lambda: polls_waiting(fleet2.urls) == before, "the other shard's poll ends", 15.0)


def test_changes_on_two_shards_all_come_back_not_the_first_shards_alone(client, learner):
    """Names on two shards, both newer than the client holds: the call returns both, each
    time (the first shard to answer wins the race; the other is then asked without waiting)."""
    a, b = named_on(0, 2, "a"), named_on(1, 2, "b")
    learner.init({a: np.zeros(2, np.float32), b: np.zeros(3, np.float32)}, optimizer=Add())
    client.pull([a, b])
    for step in range(1, 6):
        pushed = learner.push({a: np.ones(2, np.float32), b: np.ones(3, np.float32)})
        got = client.pull([a, b], newer_than="cached", timeout=25)
        assert sorted(got) == sorted([a, b]), f"push {step}: got only {list(got)}"
        np.testing.assert_array_equal(got[a], np.full(2, step))
        np.testing.assert_array_equal(got[b], np.full(3, step))
        held = {a: pushed[a]["version"] - 1, b: pushed[b]["version"] - 1}
        got = client.pull([a, b], newer_than=held, timeout=25)
        assert sorted(got) == sorted([a, b]), f"push {step}, a map: got only {list(got)}"


# -- min_version -----------------------------------------------------------------------------


def test_min_version_blocks_until_every_variable_reached_it(client, learner, fleet2, pool):
    a, b = named_on(0, 2, "a"), named_on(1, 2, "b")
    learner.init({a: np.zeros(2, np.float32), b: np.zeros(2, np.float32)}, optimizer=Add())
    before = polls_waiting(fleet2.urls)
    future = pool.submit(client.pull, [a, b], min_version=1, timeout=25)
    wait_for_polls(fleet2.urls, before + 1, future)
    learner.push({a: np.ones(2, np.float32)})
    learner.push({b: np.full(2, 2, np.float32)})
    got = future.result(timeout=20)
    assert list(got) == [a, b]
    np.testing.assert_array_equal(got[a], np.ones(2))
    np.testing.assert_array_equal(got[b], np.full(2, 2))


def test_min_version_not_reached_raises_not_ready(client, learner):
    a = fresh()
    learner.init({a: np.zeros(2, np.float32)})
    with pytest.raises(NotReadyError) as info:
        client.pull([a], min_version=3, timeout=0.3)
    assert info.value.missing == [a]
    assert "min_version" in str(info.value)


def test_bad_blocking_arguments_are_refused_before_anything_is_sent(client, learner):
    a = fresh()
    learner.init({a: np.zeros(2, np.float32)})
    for kwargs in (
        {"newer_than": "newest"},
        {"newer_than": {a: -1}},
        {"newer_than": {a: 1.5}},
        {"min_version": -1},
        {"min_version": "3"},
        {"newer_than": "cached", "min_version": 1},
        {"newer_than": "cached", "timeout": -1},
        {"min_version": 1, "timeout": float("nan")},
    ):
        with pytest.raises(BadRequestError):
            client.pull([a], **kwargs)


def test_min_version_far_ahead_is_refused_naming_the_field(client, learner):
    a = fresh()
    learner.init({a: np.zeros(2, np.float32)})
    with pytest.raises(BadRequestError) as info:
        client.pull([a], min_version=10**7, timeout=1)
    assert "min_version" in str(info.value)


# -- many actors ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (``/proc/<pid>/stat``), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_fifty_waiting_actors_cost_the_shard_no_cpu_and_all_get_the_push(fleet_factory):
    fleet = fleet_factory(1)
    url = fleet.urls[0]
    pid = fleet.procs[0].pid
    model = fresh("policy")
    n = 50

    async def main() -> tuple[float, list[dict[str, np.ndarray]]]:
        learner = AsyncPSClient([url], worker_id="learner")
        actors = [AsyncPSClient([url], worker_id=f"actor-{i}") for i in range(n)]
        try:
            await learner.init({model: np.zeros(1000, np.float32)}, optimizer=Add())
            for actor in actors:
                await actor.pull([model])
            waits = [
                asyncio.ensure_future(actor.pull([model], newer_than="cached", timeout=25))
                for actor in actors
            ]
            deadline = time.monotonic() + 20
            while await asyncio.to_thread(polls_waiting, [url]) < n:
                assert time.monotonic() < deadline, "50 polls never all waited"
                assert not any(w.done() for w in waits)
                await asyncio.sleep(0.05)
            start = cpu_seconds(pid)
            await asyncio.sleep(2.0)
            spent = cpu_seconds(pid) - start
            assert not any(w.done() for w in waits)
            await learner.push({model: np.ones(1000, np.float32)})
            got = await asyncio.wait_for(asyncio.gather(*waits), 20)
            return spent, got
        finally:
            for actor in actors:
                await actor.close()
            await learner.close()

    spent, got = asyncio.run(main())
    assert spent < 0.2, f"the shard spent {spent:.3f} CPU-s while 50 polls waited for 2 s"
    assert len(got) == n
    for result in got:
        assert list(result) == [model]
        np.testing.assert_array_equal(result[model], np.ones(1000))
