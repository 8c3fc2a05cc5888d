"""Workers ride out a primary's death: replicas electing their primary in a real etcd, the SDK
given the group (``URL|URL``), real processes.

Workers (a ``PSClient`` on threads and an ``AsyncPSClient``) keep incrementing one counter while
the primary is killed with SIGKILL. Every call returns (the SDK finds the new primary and sends
the same request again, same ``seq``), no worker restarts, and the increments are applied exactly
once: the values the workers got are 1..N, each once, and the counter ends at N.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

from client_sdk import AsyncPSClient, PSClient
from tests.e2e.test_leadership import one_primary
from tests.helpers.eventually import eventually
from tests.helpers.replicas import start_group


def test_workers_keep_incrementing_across_a_kill_of_the_primary_exactly_once(tmp_path, etcd):
    prefix = f"/test-{uuid.uuid4().hex[:8]}"
    group = start_group(
        tmp_path / "group", 2, "--etcd", etcd.url, "--etcd-prefix", prefix, "--lease-ttl", "2"
    )
    try:
        p, _ = one_primary(group)
        shards = "|".join(group.urls)
        got: list[int] = []
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[BaseException] = []

        def sync_worker(k: int) -> None:
            try:
                with PSClient(shards, worker_id=f"w{k}", retry_deadline=60) as ps:
                    while not stop.is_set():
                        value = ps.increment("steps")
                        with lock:
                            got.append(int(value))
            except BaseException as exc:  # the test fails with it below
                errors.append(exc)

        async def async_worker() -> None:
            async with AsyncPSClient(shards, worker_id="w-async", retry_deadline=60) as ps:
                while not stop.is_set():
                    value = await ps.increment("steps")
                    with lock:
                        got.append(int(value))

        def run_async() -> None:
            try:
                asyncio.run(async_worker())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=sync_worker, args=(k,)) for k in range(3)]
        threads.append(threading.Thread(target=run_async))
        for t in threads:
            t.start()
        try:
            eventually(lambda: len(got) >= 50, "the workers incrementing")
            group.kill(p)
            before = len(got)
            eventually(lambda: len(got) >= before + 50, "the workers incrementing after the kill")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=90)
        assert not errors, errors
        q, _ = one_primary(group, among=[1 - p])
        assert q == 1 - p
        assert sorted(got) == list(range(1, len(got) + 1))  # each once, none lost
        with PSClient(group.urls[q], worker_id="checker") as ps:
            assert ps.increment("steps", 0) == len(got)
    finally:
        group.close()
