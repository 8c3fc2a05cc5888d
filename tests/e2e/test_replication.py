"""Replica groups: every write a primary takes reaches its backups, in order, before the
worker hears of it (server/replication, docs/DEPLOYMENT.md Replicas).

Each test starts a static group of real shard processes on loopback
(tests/helpers/replicas.py: the first replica primary at epoch 1, the others its backups) and
talks to it over HTTP: with the SDK, or by hand where the protocol itself is the subject. A
backup is read through its own pulls (``allow_backup=True``: a backup answers those) and
``GET /v1/cluster``.

* every write verb of the data plane, and the close of a sync round by its timeout, leave the
  backup in the primary's state (the same variables, values, versions, state version and count
  of changes): a write path that bypassed the log would leave them apart, and a write verb
  added without a test here fails :func:`test_every_write_verb_is_driven_here`;
* a backup refuses workers' writes (421 ``not_primary`` naming the primary), and forwarded
  entries of a lower epoch (409 ``stale_epoch``); a primary told so by its backup steps down
  and acknowledges nothing more;
* a backup that stops answering is dropped from the in-sync set after ``--replica-timeout``,
  and sent the tail it missed when it answers again, then rejoins; one that needs writes the
  primary's log let go (``--replication-log-bytes``) gets a snapshot of the primary's state;
* a replica restarted from its own snapshot resumes the log where the snapshot was taken;
* a link whose task fails (a bug, injected into the primary's process: no reply a backup can
  send makes it fail) is logged with the backup's URL and traceback and starts over; the
  backup stays in the in-sync set and is fed;
* history (tests/helpers/history.py): 4 workers pushing and incrementing; the primary is
  killed with SIGKILL; the backup holds every write they saw acknowledged, exactly once.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid

import httpx2
import msgpack
import numpy as np
import pytest

from client_sdk import PSClient, PSError, ShardUnavailableError
from client_sdk.modes import Sync
from client_sdk.optimizers import SGD
from server import admission
from server.app import DATA_PLANE_VERBS, create_app
from server.config import ShardConfig
from server.direct_routes import direct_routes
from server.embedding import EmbeddingTables
from server.store import ParameterStore
from server.store.journal import journaled_methods
from tests.conftest import http_json
from tests.helpers.eventually import eventually
from tests.helpers.history import History
from tests.helpers.replicas import cluster

#: The data plane's write verbs this module drives through a group (each must be one of the
#: shard's write verbs, and each of those must be here).
DRIVEN = (
    "init",
    "push",
    "assign",
    "increment",
    "set_optimizer",
    "delete",
    "create_table",
    "push_rows",
    "group_push",
)
#: The store's journaled writes (server/store/journal.py): the verbs above, the big push's
#: off-loop twin, and the close of sync rounds a clock found due.
JOURNALED = {
    "ParameterStore": [
        "assign",
        "close_rounds",
        "delete",
        "increment",
        "init",
        "push",
        "push_async",
        "set_optimizer",
    ],
    "EmbeddingTables": ["create", "push"],
}


def test_every_write_verb_is_driven_here():
    assert set(DRIVEN) == admission.WRITES
    assert set(DATA_PLANE_VERBS) == (
        admission.WRITES | admission.READS | admission.LONG | admission.CONTROL
    )
    app = create_app(ShardConfig())
    posts = {path[len("/v1/") :] for path in direct_routes(app)}
    assert posts == set(DATA_PLANE_VERBS) | admission.REPLICATION
    assert journaled_methods(ParameterStore) == JOURNALED["ParameterStore"]
    assert journaled_methods(EmbeddingTables) == JOURNALED["EmbeddingTables"]


def _version(url: str, name: str) -> int | None:
    return http_json(f"{url}/v1/variables/{name}").get("version")  # None: partitioned


def _listing(url: str) -> dict[str, tuple]:
    return {
        v["name"]: (v.get("version"), v.get("optimizer_version"), v.get("partitions"))
        for v in http_json(url + "/v1/variables")["variables"]
    }


def _state(url: str, names: list[str]) -> dict[str, tuple[int, bytes]]:
    with PSClient([url], worker_id="reader-" + uuid.uuid4().hex[:8]) as ps:
        values = ps.pull(names, allow_backup=True)
    return {n: (_version(url, n), np.asarray(values[n]).tobytes()) for n in names}


def _same_state(primary: str, backup: str, names: list[str], changes: bool = True) -> None:
    """The two replicas hold the same writes: lsn, state version, variables (values, versions,
    optimizers), and, unless one restarted from a snapshot since, the same count of changes."""
    p, b = cluster(primary), cluster(backup)
    assert b["lsn"] == p["lsn"] and b["refused"] == 0
    assert (
        http_json(backup + "/v1/cluster")["state_version"]
        == http_json(primary + "/v1/cluster")["state_version"]
    )
    assert b["changes"] == p["changes"] or not changes
    assert _listing(backup) == _listing(primary)
    assert _state(backup, names) == _state(primary, names)


def test_every_write_reaches_the_backup_before_its_answer(groups):
    group = groups(2, "--partition-bytes", "0")
    primary, backup = group.urls
    with PSClient([primary], worker_id="w-all") as ps:
        ps.init({"a": np.arange(6, dtype=np.float32), "b": np.zeros(3, np.float64)}, SGD(lr=0.5))
        ps.init({"big": np.zeros((4, 8), np.float32)}, partitions=2)
        ps.init({"s": np.zeros(2, np.float32)}, SGD(lr=1.0), sync=Sync(replicas=2, timeout=0.3))
        ps.push({"a": np.ones(6, np.float32), "b": np.full(3, 2.0)})
        ps.push({"big": np.ones((4, 8), np.float32)})
        ps.init({"huge": np.zeros(1 << 22, np.float32)})  # 16 MiB: pushed off the loop
        ps.push({"huge": np.ones(1 << 22, np.float32) + 0.5})
        ps.assign({"b": np.array([7.0, 8.0, 9.0])})
        assert ps.increment("step", 2) == 2
        ps.increment("f", 0.5)
        ps.set_optimizer(["a"], SGD(lr=0.1))
        ps.push({"a": np.ones(6, np.float32)})
        g = ps.group(["a"])  # a step group's push: a push of its variables
        g.pull()
        g.push({"a": np.full(6, 2.0, np.float32)})
        ps.create_table("emb", 4)
        ps.push_rows("emb", np.array([3, 5, 3]), np.ones((3, 4), np.float32))
        ps.pull(["s"])
        ps.push({"s": np.ones(2, np.float32)})  # opens a round; its timeout closes it
        eventually(lambda: _version(primary, "s") == 1, "the round closed by its timeout", 20)
        ps.init({"gone": np.zeros(2, np.float32)})
        assert ps.delete(["gone"]) == ["gone"]
        names = ["a", "b", "big", "huge", "s", "step", "f"]
        # Answered means the backup has it: no waiting for it here.
        _same_state(primary, backup, names)
        with PSClient([backup], worker_id="reader") as pb:
            np.testing.assert_array_equal(
                pb.pull_rows("emb", [3, 5, 9], allow_backup=True), ps.pull_rows("emb", [3, 5, 9])
            )
            assert "gone" not in {v["name"] for v in pb.variables()}


def test_a_backup_refuses_writes_and_stale_epochs_changing_nothing(groups):
    group = groups(2)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w") as ps:
        ps.increment("c", 1)
    body = msgpack.packb({"name": "c", "delta": 5, "worker_id": "x", "seq": 1})
    refused = httpx2.post(
        backup + "/v1/increment", content=body, headers={"content-type": "application/msgpack"}
    )
    assert refused.status_code == 421
    error = msgpack.unpackb(refused.content)["error"]
    assert error["code"] == "not_primary"
    assert error["details"] == {"role": "backup", "epoch": 1, "primary": primary}
    stale = {"epoch": 0, "primary": "http://elsewhere:1", "entries": []}
    answer = httpx2.post(
        backup + "/v1/replicate",
        content=msgpack.packb(stale),
        headers={"content-type": "application/msgpack"},
    )
    assert answer.status_code == 409
    assert msgpack.unpackb(answer.content)["error"]["code"] == "stale_epoch"
    for bad in ({"epoch": "1"}, {"epoch": 1, "primary": primary, "entries": [[1, 1, "os.system"]]}):
        answer = httpx2.post(
            backup + "/v1/replicate",
            content=msgpack.packb(bad),
            headers={"content-type": "application/msgpack"},
        )
        assert answer.status_code == 400, answer.content
    with PSClient([backup], worker_id="r") as pb:
        assert int(pb.pull(["c"], allow_backup=True)["c"]) == 1
    assert cluster(backup)["primary"] == primary  # the stale sender did not take over


def test_a_fleet_checkpoint_is_taken_by_the_primary_only(groups):
    """A backup refuses a checkpoint's rounds (421), so a client listing it first follows the
    primary: the checkpoint holds the primary's state and pauses the primary's writes."""
    group = groups(2, data=True)
    primary, backup = group.urls
    pause = msgpack.packb({"checkpoint": "by-hand", "lease": 5})
    refused = httpx2.post(
        backup + "/v1/pause", content=pause, headers={"content-type": "application/msgpack"}
    )
    assert refused.status_code == 421, refused.content
    assert msgpack.unpackb(refused.content)["error"]["code"] == "not_primary"
    with PSClient(f"{backup}|{primary}", worker_id="w-ckpt") as ps:
        ps.increment("c", 3)
        taken = ps.checkpoint(timeout=60)
    listed = {url: http_json(url + "/v1/checkpoints") for url in group.urls}
    assert taken in str(listed[primary]), listed
    assert taken not in str(listed[backup]), listed
    own = httpx2.post(  # a replica's own snapshot, no checkpoint: any replica takes it
        backup + "/v1/snapshot",
        content=msgpack.packb({}),
        headers={"content-type": "application/msgpack"},
        timeout=60,
    )
    assert own.status_code == 200, own.content


def test_a_primary_whose_backup_saw_a_newer_epoch_acknowledges_nothing_more(groups):
    group = groups(2)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w") as ps:
        ps.increment("c", 1)
        newer = {"epoch": 2, "primary": "http://127.0.0.1:9/elsewhere", "entries": []}
        answer = httpx2.post(
            backup + "/v1/replicate",
            content=msgpack.packb(newer),
            headers={"content-type": "application/msgpack"},
        )
        assert answer.status_code == 200 and cluster(backup)["epoch"] == 2
        with pytest.raises(ShardUnavailableError):  # 421 not_primary
            ps.increment("c", 1)  # applied here, but never acknowledged
    shown = cluster(primary)
    assert shown["role"] == "unknown" and shown["epoch"] == 1
    with PSClient([backup], worker_id="r") as pb:
        assert int(pb.pull(["c"], allow_backup=True)["c"]) == 1


def test_a_backup_that_stops_is_dropped_then_sent_the_tail_and_rejoins(groups):
    group = groups(2, "--replica-timeout", "1")
    primary, backup = group.urls
    with PSClient([primary], worker_id="w", retry_deadline=60) as ps:
        ps.increment("c", 1)
        os.kill(group.pids[1], signal.SIGSTOP)
        try:
            for _ in range(5):  # the first waits --replica-timeout, then the backup is out
                ps.increment("c", 1)
            shown = cluster(primary)
            assert shown["in_sync"] == []
            # The log let go of what the backup had applied, and keeps what it lacks.
            assert (shown["log"]["first_lsn"], shown["log"]["entries"]) == (2, 5)
        finally:
            os.kill(group.pids[1], signal.SIGCONT)
        eventually(lambda: cluster(primary)["in_sync"] == [backup], "the backup rejoined", 30)
        ps.increment("c", 1)
    shown, behind = cluster(primary), cluster(backup)
    assert behind["lsn"] == shown["lsn"] == 7
    assert shown["backups"][0]["installs"] == 0  # sent the tail, not a snapshot
    # Once the backup has a write, neither log keeps it but for the backup's newest write (its
    # primary said so with the next batch).
    assert shown["log"]["entries"] == 0 and behind["log"]["entries"] == 1
    _same_state(primary, backup, ["c"])


def test_a_backup_that_needs_writes_the_log_let_go_catches_up_from_a_snapshot(groups):
    group = groups(2, "--replication-log-bytes", "8KiB", "--replica-timeout", "1")
    primary, backup = group.urls
    with PSClient([primary], worker_id="w", retry_deadline=60) as ps:
        ps.init({"v": np.zeros(1000, np.float32)}, SGD(lr=1.0))
        ps.create_table("emb", 4)
        group.kill(1)
        for _ in range(5):  # 4 KB each: the log lets the first ones go
            ps.push({"v": np.ones(1000, np.float32)})
        ps.increment("c", 5)
        ps.push_rows("emb", np.array([1, 2]), np.ones((2, 4), np.float32))
        assert cluster(primary)["log"]["first_lsn"] > 2
        group.start(1)  # empty, on the same port
        eventually(lambda: cluster(primary)["in_sync"] == [backup], "the backup rejoined", 60)
        ps.increment("c", 1)  # and the log goes on from the snapshot
        with PSClient([backup], worker_id="reader") as pb:
            np.testing.assert_array_equal(
                pb.pull_rows("emb", [1, 2, 3], allow_backup=True), ps.pull_rows("emb", [1, 2, 3])
            )
    (link,) = cluster(primary)["backups"]
    assert link["installs"] == 1 and cluster(backup)["installed"] == 1
    _same_state(primary, backup, ["v", "c"])


def test_a_replica_restarted_from_its_snapshot_resumes_the_log_there(groups):
    group = groups(2, data=True)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w", retry_deadline=60) as ps:
        for _ in range(3):
            ps.increment("c", 1)
        group.stop(0)  # its final snapshot holds lsn 3
        group.start(0)
        assert cluster(primary)["lsn"] == 3
        ps.increment("c", 1)
    assert cluster(backup)["lsn"] == 4
    _same_state(primary, backup, ["c"], changes=False)


#: Run in each replica before it serves: the first answer of a backup its forwarder handles
#: raises, as a bug in it would (no reply a backup can send does).
FAILING_LINK = """
import server.replication.forward as forward
answered = forward.Forwarder._answered
failed = []
async def failing(self, link, *args):
    if not failed:
        failed.append(link.url)
        raise RuntimeError("injected failure of a link")
    return await answered(self, link, *args)
forward.Forwarder._answered = failing
"""


def test_a_link_whose_task_fails_is_logged_and_starts_over(groups):
    group = groups(2, "--replica-timeout", "30", prelude=FAILING_LINK)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w-link") as ps:
        assert ps.increment("c", 2) == 2
        # Acknowledged with the backup holding it, not after the backup was dropped.
        shown = cluster(primary)
        assert shown["in_sync"] == [backup], shown
        assert ps.pull(["c"])["c"] == 2
    with PSClient([backup], worker_id="w-read") as reader:
        assert reader.pull(["c"], allow_backup=True)["c"] == 2
    (link,) = shown["backups"]
    assert link["failures"] >= 1 and link["state"] == "streaming", link
    log = group.tail(0, 400)
    assert f"forwarding to backup {backup} failed" in log, log
    assert "RuntimeError: injected failure of a link" in log and "Traceback" in log, log


def test_no_acknowledged_write_is_lost_when_the_primary_is_killed(groups):
    group = groups(2)
    primary, backup = group.urls
    workers, per_worker = 4, 10_000
    with PSClient([primary], worker_id="chief") as ps:
        ps.init({"v": np.zeros(workers * per_worker, np.float32)}, SGD(lr=1.0))
    history = History()
    stop = threading.Event()

    def work(w: int) -> None:
        name = f"worker-{w}"
        with PSClient([primary], worker_id=name, timeout=5, retry_deadline=2) as ps:
            for k in range(per_worker):
                if stop.is_set():
                    return
                try:
                    if k % 2:
                        history.sent(name, "increment", k)
                        history.acked(name, "increment", k, ps.increment("counter", 1))
                    else:
                        at = w * per_worker + k
                        grad = np.zeros(workers * per_worker, np.float32)
                        grad[at] = 1.0
                        history.sent(name, "push", at)
                        ps.push({"v": grad})
                        history.acked(name, "push", at, None)
                except PSError:
                    return  # the primary is gone: what this write became is unknown

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    try:
        eventually(lambda: history.count("increment")[1] >= 40, "40 increments acknowledged", 60)
        group.kill(0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    with PSClient([backup], worker_id="checker") as pb:
        state = pb.pull(["v", "counter"], allow_backup=True)
    assert history.check(np.asarray(state["v"]), int(state["counter"])) == []
    sent, acked = history.count("push")
    assert acked >= 20 and sent >= acked
