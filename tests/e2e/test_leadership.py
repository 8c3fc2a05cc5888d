"""Leadership through etcd (server/replication/leadership.py): replicas of one shard index, real
processes, a real etcd (the module's ``etcd`` fixture), each test under a key prefix of its own.

One replica becomes primary at epoch = its key's create_revision, the other its backup; after
a kill -9 of the primary the backup takes over at a higher epoch; a primary frozen (SIGSTOP)
past its lease acknowledges nothing once it runs again and comes back as a backup; a primary
that loses etcd stops acknowledging; a replica restarted after writes may not campaign; a whole
group restarted (stopped cleanly, or killed after snapshots) elects its most complete replica.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid

import httpx2
import numpy as np
import pytest

from client_sdk import PSClient
from server.replication.etcd import EtcdClient
from tests.conftest import http_json
from tests.helpers.eventually import eventually
from tests.helpers.replicas import Group, start_group

TTL = 2


def elected_group(tmp_path, etcd, n=2, *extra, data=False):
    """``n`` replicas of shard 0 electing their primary in ``etcd``, under a prefix of their
    own (``data``: each with a data dir); the group and the prefix."""
    prefix = f"/test-{uuid.uuid4().hex[:8]}"
    group = start_group(
        tmp_path / prefix[1:],
        n,
        *("--etcd", etcd.url, "--etcd-prefix", prefix, "--lease-ttl", str(TTL), *extra),
        data=data,
    )
    return group, prefix


def replication(url: str) -> dict | None:
    """A replica's role, with ``eligible`` from its leadership (``None``: no answer)."""
    try:
        info = http_json(url + "/v1/cluster")
    except OSError:
        return None
    campaign = info["leadership"]
    return {
        **info["replication"],
        "eligible": campaign["eligible"],
        "resyncing": campaign["resyncing"],
    }


def roles(group: Group, among=None) -> dict[int, dict]:
    out = {}
    for r in among if among is not None else range(group.n):
        info = replication(group.urls[r])
        if info is not None:
            out[r] = info
    return out


def one_primary(group: Group, among=None, eligible=True) -> tuple[int, dict]:
    """Wait until exactly one replica (of ``among``) is primary and the others its backups at
    its epoch, each eligible to take over (unless not ``eligible``); the primary's index and
    view."""

    def settled():
        seen = roles(group, among)
        primaries = [r for r, v in seen.items() if v["role"] == "primary"]
        if len(seen) != len(among if among is not None else range(group.n)):
            return None
        if len(primaries) != 1 or (eligible and not all(v["eligible"] for v in seen.values())):
            return None
        p = primaries[0]
        view = seen[p]
        for r, v in seen.items():
            if r != p and (v["role"], v["primary"], v["epoch"]) != (
                "backup",
                group.urls[p],
                view["epoch"],
            ):
                return None
        return p, view

    return eventually(settled, "one primary and its backups", timeout=30)


def etcd_key(etcd, key: str):
    async def go():
        c = EtcdClient([etcd.url])
        try:
            return (await c.get(key))[0]
        finally:
            await c.close()

    return asyncio.run(go())


def increment(url: str, seq: int) -> httpx2.Response:
    import msgpack

    body = msgpack.packb({"name": "step", "delta": 1, "worker_id": "w", "seq": seq})
    return httpx2.post(
        url + "/v1/increment",
        content=body,
        headers={"content-type": "application/msgpack"},
        timeout=10,
    )


def test_one_replica_leads_at_the_keys_create_revision_and_a_kill_hands_over(tmp_path, etcd):
    group, prefix = elected_group(tmp_path, etcd)
    try:
        p, view = one_primary(group)
        held = etcd_key(etcd, f"{prefix}/shard/0/primary")
        assert held is not None and json.loads(held.value)["url"] == group.urls[p]
        assert view["epoch"] == held.create_revision
        in_sync = json.loads(etcd_key(etcd, f"{prefix}/shard/0/in-sync").value)
        assert sorted(in_sync["replicas"]) == sorted(group.urls)
        assert in_sync["epoch"] == view["epoch"]

        group.kill(p)
        other = 1 - p
        q, new = one_primary(group, among=[other])
        assert q == other and new["epoch"] > view["epoch"]
        held = etcd_key(etcd, f"{prefix}/shard/0/primary")
        assert json.loads(held.value)["url"] == group.urls[other]
        assert new["epoch"] == held.create_revision
    finally:
        group.close()


def test_a_primary_frozen_past_its_lease_acknowledges_nothing_and_comes_back_as_backup(
    tmp_path, etcd
):
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, view = one_primary(group)
        other = 1 - p
        group.send(p, signal.SIGSTOP)
        try:
            eventually(
                lambda: (roles(group, [other]).get(other) or {}).get("role") == "primary",
                "the backup taking over while the primary is frozen",
            )
        finally:
            group.send(p, signal.SIGCONT)
        # The first thing the old primary is asked once it runs again: a write. Its lease
        # ended while it was frozen, so it must refuse it (not_primary), whatever its own
        # tasks had time to notice.
        refused = increment(group.urls[p], 1)
        assert refused.status_code == 421, refused.content
        # Its log is on the new primary's (it took no write of its own): once the new primary
        # confirmed it in-sync it may take over again, in this process.
        q, new = one_primary(group)
        assert q == other and new["epoch"] > view["epoch"]
    finally:
        group.close()


def test_a_primary_that_loses_etcd_stops_acknowledging(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, view = one_primary(group)
        etcd.pause()
        try:
            eventually(
                lambda: (roles(group, [p]).get(p) or {}).get("role") != "primary",
                "the primary stepping down without etcd",
            )
            assert increment(group.urls[p], 2).status_code == 421
        finally:
            etcd.resume()
        _, new = one_primary(group, eligible=False)
        assert new["epoch"] > view["epoch"]
    finally:
        group.close()


@pytest.mark.parametrize("ttl", ["0", "x"])
def test_a_bad_lease_ttl_is_refused_at_start(tmp_path, etcd, ttl):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--etcd", etcd.url, "--lease-ttl", ttl],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--lease-ttl" in out.stderr


def test_a_backup_restarted_after_writes_campaigns_only_once_caught_up(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, _ = one_primary(group)
        b = 1 - p
        with PSClient(group.urls[p], worker_id="w-restart") as ps:
            for _ in range(5):
                ps.increment("restart_steps")
            held = http_json(group.urls[p] + "/v1/cluster")["replication"]["lsn"]
            group.kill(b)
            group.start(b)  # still in the in-sync set (no write waited for it meanwhile)
            # It lost the writes it held: listed or not, it may campaign only once it holds
            # them again. No write comes for a while; the primary's survey finds it behind and
            # feeds it, and writes the in-sync set again every TTL when its backups hold every
            # write — from what the restarted process holds, never from what the one before
            # it acknowledged. What holds whatever the timing is the implication, read from
            # one answer at a time, over a few TTLs.
            for _ in range(int(3 * TTL / 0.2)):
                info = http_json(group.urls[b] + "/v1/cluster")
                rep, lead = info["replication"], info["leadership"]
                assert not lead["eligible"] or rep["lsn"] >= held, (lead, rep["lsn"], held)
                time.sleep(0.2)
            ps.increment("restart_steps")
        # fed the log by the primary, it is confirmed in the set and may campaign again
        one_primary(group)
        with PSClient(group.urls[b], worker_id="w-restart-check") as backup:
            assert backup.pull(["restart_steps"], allow_backup=True)["restart_steps"] == 6
    finally:
        group.close()


def test_a_backup_restarted_becomes_eligible_while_writes_keep_coming(tmp_path, etcd):
    """A backup killed and restarted while 4 workers write without pause: once it has caught
    up, the primary confirms its new process in the in-sync set although each survey of it
    finds writes newer than those the primary held when it asked (so that, the primary killed
    next, it takes over)."""
    group, _ = elected_group(tmp_path, etcd)
    stop, wrote, errors = threading.Event(), [0], []
    writers: list[threading.Thread] = []
    try:
        p, _ = one_primary(group)
        b = 1 - p

        def write(k: int) -> None:
            with PSClient(group.urls[p], worker_id=f"w-busy{k}", timeout=30) as ps:
                ps.init({f"busy{k}": np.zeros(1000, np.float32)})
                grads = {f"busy{k}": np.ones(1000, np.float32)}
                while not stop.is_set():
                    try:  # as a worker does: the next push leaves before the last is answered
                        ps.push_async(grads)
                    except Exception as exc:
                        errors.append(exc)
                        return
                    wrote[0] += 1

        writers = [threading.Thread(target=write, args=(k,)) for k in range(4)]
        for w in writers:
            w.start()
        eventually(lambda: wrote[0] >= 50, "writes going")
        group.kill(b)
        group.start(b)
        start = wrote[0]

        def eligible() -> bool:
            time.sleep(0.05)
            info = replication(group.urls[b])  # None while it starts
            return info is not None and info["eligible"] and wrote[0] > start + 50

        eventually(eligible, "the restarted backup confirmed while writes come", timeout=8 * TTL)
        assert not errors, errors  # the writes never stopped for it
    finally:
        stop.set()
        for w in writers:
            w.join(timeout=60)
        group.close()


def test_an_idle_backup_restarted_is_fed_with_no_write_coming(tmp_path, etcd):
    """A backup killed and restarted empty while no worker writes: its link still counts it as
    holding every write, but the primary's survey of its backups finds it behind and feeds it,
    with no write coming. Within a bound it holds every acknowledged write, and the in-sync set
    names its new process (it may take over again)."""
    group, prefix = elected_group(tmp_path, etcd)
    try:
        p, _ = one_primary(group)
        b = 1 - p
        with PSClient(group.urls[p], worker_id="w-idle") as ps:
            for _ in range(5):
                ps.increment("idle_steps")
        held = http_json(group.urls[p] + "/v1/cluster")["replication"]["lsn"]
        group.kill(b)
        group.start(b)  # empty, still listed in the in-sync set: no write waited for it
        process = http_json(group.urls[b] + "/v1/cluster")["incarnation"]
        seen = []

        def fed():
            time.sleep(0.1)
            info = http_json(group.urls[b] + "/v1/cluster")
            in_sync = json.loads(etcd_key(etcd, f"{prefix}/shard/0/in-sync").value)
            seen[:] = [info["replication"]["lsn"], in_sync]
            return (
                info["replication"]["lsn"] >= held
                and in_sync["processes"].get(group.urls[b]) == process
                and info["leadership"]["eligible"]
            )

        try:
            eventually(fed, "the restarted backup fed and confirmed with no write", timeout=20)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; held {held}, seen {seen}") from None
        with PSClient(group.urls[b], worker_id="w-idle-check") as backup:
            assert backup.pull(["idle_steps"], allow_backup=True)["idle_steps"] == 5
    finally:
        group.close()


def _steps(url: str) -> int:
    with PSClient([url], worker_id="reader") as ps:
        return int(ps.pull(["steps"], allow_backup=True)["steps"])


def test_a_whole_group_stopped_cleanly_elects_a_primary_holding_every_write(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd, 2, data=True)
    try:
        p, _ = one_primary(group)
        with PSClient("|".join(group.urls), worker_id="w-stop") as ps:
            for _ in range(5):
                ps.increment("steps")
        for r in (p, 1 - p):  # SIGTERM: each writes a final snapshot
            assert group.stop(r) == 0
        for r in range(group.n):
            group.start(r)
        q, _ = one_primary(group)  # every replica listed before it started: none was eligible
        assert [_steps(u) for u in group.urls] == [5, 5]
        with PSClient("|".join(group.urls), worker_id="w-after") as ps:
            assert ps.increment("steps") == 6
        assert _steps(group.urls[1 - q]) == 6
    finally:
        group.close()


def test_a_whole_group_killed_elects_a_primary_with_its_snapshots_state(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd, 2, "--snapshot-interval", "3600", data=True)
    try:
        p, _ = one_primary(group)
        with PSClient("|".join(group.urls), worker_id="w-kill") as ps:
            for _ in range(3):
                ps.increment("steps")
            for url in group.urls[p : p + 1]:  # the backup has none: it restarts empty
                answer = httpx2.post(
                    url + "/v1/snapshot",
                    content=b"\x80",  # {}: snapshot now
                    timeout=30,
                    headers={"content-type": "application/msgpack"},
                )
                assert answer.status_code == 200, answer.content
            for _ in range(2):  # after the snapshots: lost with every replica (documented)
                ps.increment("steps")
        for r in range(group.n):
            group.kill(r)
        for r in range(group.n):
            group.start(r)
        one_primary(group)
        assert [_steps(u) for u in group.urls] == [3, 3]
        with PSClient("|".join(group.urls), worker_id="w-after") as ps:
            assert ps.increment("steps") == 4
    finally:
        group.close()
