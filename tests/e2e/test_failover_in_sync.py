"""A new primary's in-sync set lists only the replicas at its own (epoch, lsn)
(server/replication/leadership.py): a replica that lags is left out at the election, so it can
never be elected without the writes the new primary holds (acknowledged ones among them); the
forwarder lets it back in once it has them.

Three replicas elect their primary in a real etcd, ``--replica-timeout`` long enough that no
backup is dropped meanwhile. One backup (the laggard) is frozen (SIGSTOP); two writes reach the
primary and the other backup (neither acknowledged: each waits for the frozen one). The
primary forwards one batch at a time to each backup, so only the first write is on its way to
the laggard (in its socket's buffer) when the primary is killed. The laggard is let go only
then: nobody can send it the second write before the other backup is elected, so at that
election it answers the survey at least one write behind. The set the new primary
wrote at its election is read back from etcd's history (the key at the revisions after the new
epoch), one answer, whatever the forwarder did since.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import threading
import uuid

import httpx2
import msgpack

from server.replication.etcd import EtcdClient
from tests.e2e.test_leadership import TTL, one_primary
from tests.helpers.eventually import eventually
from tests.helpers.replicas import cluster, start_group


def _in_sync_at(etcd_url: str, key: str, revision: int) -> dict | None:
    """The in-sync key as etcd held it at ``revision`` (``None``: absent)."""

    async def go():
        client = EtcdClient([etcd_url])
        try:
            body = {"key": base64.b64encode(key.encode()).decode(), "revision": str(revision)}
            return await client.call("/v3/kv/range", body)
        finally:
            await client.close()

    kvs = asyncio.run(go()).get("kvs") or []
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def _set_written_at_election(etcd_url: str, key: str, epoch: int) -> list[str]:
    """The replicas of the first in-sync set written at ``epoch`` (its primary's first write
    of the set, right after it won the key at revision ``epoch``)."""
    for revision in range(epoch, epoch + 1000):
        doc = _in_sync_at(etcd_url, key, revision)
        if doc is not None and doc.get("epoch") == epoch:
            return list(doc["replicas"])
    raise AssertionError(f"no in-sync set of epoch {epoch} in etcd's history")


def _increment(url: str, seq: int) -> None:
    body = msgpack.packb({"name": "steps", "delta": 1, "worker_id": "w", "seq": seq})
    try:
        httpx2.post(
            url + "/v1/increment",
            content=body,
            headers={"content-type": "application/msgpack"},
            timeout=60,
        )
    except httpx2.HTTPError:
        pass  # its primary was killed before it could answer: it was never acknowledged


def test_a_replica_that_lags_at_an_election_is_not_in_the_new_primarys_in_sync_set(tmp_path, etcd):
    prefix = f"/test-{uuid.uuid4().hex[:8]}"
    group = start_group(
        tmp_path / "group",
        3,
        *("--etcd", etcd.url, "--etcd-prefix", prefix, "--lease-ttl", str(TTL)),
        "--replica-timeout",
        "60",
    )
    try:
        p, view = one_primary(group)
        b, lag = [r for r in range(3) if r != p]
        _increment(group.urls[p], 1)  # acknowledged: on all three
        lsn = cluster(group.urls[p])["lsn"]
        eventually(lambda: cluster(group.urls[lag])["lsn"] == lsn, "the laggard holding it")

        group.send(lag, signal.SIGSTOP)
        pending = []
        try:
            for k in (1, 2):  # each waits for the frozen laggard's ack: never acknowledged
                pending.append(
                    threading.Thread(target=_increment, args=(group.urls[p], 1 + k), daemon=True)
                )
                pending[-1].start()
                eventually(
                    lambda k=k: all(cluster(group.urls[r])["lsn"] == lsn + k for r in (p, b)),
                    f"write {k} on the primary and the other backup",
                )
            group.kill(p)
        finally:
            group.send(lag, signal.SIGCONT)
        for t in pending:
            t.join(timeout=60)

        q, new = one_primary(group, among=[b, lag], eligible=False)
        assert q == b and new["epoch"] > view["epoch"]
        listed = _set_written_at_election(etcd.url, f"{prefix}/shard/0/in-sync", new["epoch"])
        # The laggard answered the survey one write behind (it was frozen, its primary dead):
        # it is not listed, however soon it catches up afterwards.
        assert listed == [group.urls[b]], listed
        # The forwarder catches it up and lets it back in.
        eventually(
            lambda: group.urls[lag] in cluster(group.urls[b])["in_sync"],
            "the laggard back in the in-sync set",
        )
        assert cluster(group.urls[lag])["lsn"] == cluster(group.urls[b])["lsn"]
    finally:
        group.close()
