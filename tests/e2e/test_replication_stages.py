"""Cut-through: a big body streamed to the backups while it arrives at the primary, as a stage
its log entry names (server/replication/stages.py, docs/PROTOCOL.md §6).

Each test starts a static group of two real shard processes on loopback
(tests/helpers/replicas.py) and talks HTTP to it:

* a big push travels as a stage: the backup applies it from the stage, and holds the
  primary's values at the primary's lsn;
* a backup that does not hold the stage an entry names (it lost it, as a restart would) is
  sent the entry again with its bytes, and applies it;
* a worker that sends half a big body and leaves: the stream to the backup ends, and the
  backup lets go of the bytes it got;
* a big push the primary refuses was streamed, but nothing applies it on the backup, and the
  backup lets go of it after ``--replica-timeout``.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import numpy as np
import pytest

from client_sdk import PSClient, PSError
from client_sdk.optimizers import Add
from tests.helpers.eventually import eventually
from tests.helpers.replicas import cluster

#: Elements of the big variable: 4 MB of float32, above the 1 MiB a body is streamed from.
N = 1_000_000

#: Run in each replica before it serves: a backup forgets each stage as soon as it has it
#: whole, as one restarted between the stage and the entry would.
FORGETTING = """
import server.replication.stages as stages
receive = stages.StageStore.receive
async def forgetting(self, request, read):
    answer = await receive(self, request, read)
    self._held.clear()
    return answer
stages.StageStore.receive = forgetting
"""


def _values(url: str, worker: str) -> np.ndarray:
    with PSClient([url], worker_id=worker) as ps:
        return ps.pull(["w"], allow_backup=True)["w"]


def _pushes(ps: PSClient, count: int) -> None:
    ps.init({"w": np.zeros(N, np.float32)}, Add())
    for i in range(count):
        ps.push({"w": np.full(N, i + 1, np.float32)})


def test_a_big_push_travels_as_a_stage(groups):
    group = groups(2)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w-stage") as ps:
        _pushes(ps, 4)  # the first connects the stream; the next ones go through it
    shown, behind = cluster(primary), cluster(backup)
    assert shown["stages"]["sent"] >= 2, shown["stages"]
    assert behind["stages"]["taken"] == shown["stages"]["sent"], behind["stages"]
    assert behind["stages"]["missing"] == 0 and behind["stages"]["held"] == 0
    assert behind["lsn"] == shown["lsn"] == 5 and behind["refused"] == 0
    np.testing.assert_array_equal(_values(backup, "r"), np.full(N, 10, np.float32))
    np.testing.assert_array_equal(_values(primary, "r"), np.full(N, 10, np.float32))


def test_a_backup_without_the_stage_is_sent_the_bytes(groups):
    group = groups(2, "--replica-timeout", "2", prelude=FORGETTING)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w-miss") as ps:
        _pushes(ps, 3)
        shown = cluster(primary)
        assert shown["in_sync"] == [backup]  # not dropped: the entries were sent again
    behind = cluster(backup)
    assert shown["stages"]["sent"] >= 1 and behind["stages"]["missing"] >= 1
    assert shown["stages"]["resent"] == behind["stages"]["missing"]
    assert behind["stages"]["taken"] == 0
    assert behind["lsn"] == shown["lsn"] == 4
    np.testing.assert_array_equal(_values(backup, "r"), np.full(N, 6, np.float32))


def test_a_worker_that_leaves_mid_body_pins_nothing_on_the_backup(groups):
    group = groups(2)
    primary, backup = group.urls
    with PSClient([primary], worker_id="w-leave") as ps:
        _pushes(ps, 2)
        sent = cluster(primary)["stages"]["sent"]
        assert sent >= 1
        at = urlsplit(primary)
        size = 8 * N
        with socket.create_connection((at.hostname, at.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/push HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                + f"content-length: {size}\r\n\r\n".encode()
                + bytes(size // 2)
            )
            eventually(
                lambda: cluster(primary)["stages"]["sent"] == sent + 1, "the body streamed", 20
            )
            eventually(lambda: cluster(backup)["stages"]["bytes"] > 0, "the stage arriving", 20)
        eventually(
            lambda: cluster(backup)["stages"]["bytes"] == 0, "the backup let the stage go", 20
        )
        ps.push({"w": np.ones(N, np.float32)})  # and the next big push still goes through
    shown, behind = cluster(primary), cluster(backup)
    assert behind["stages"]["held"] == 0 and behind["lsn"] == shown["lsn"] == 4
    np.testing.assert_array_equal(_values(backup, "r"), np.full(N, 4, np.float32))


def test_a_stage_applies_nothing_without_its_entry(groups):
    group = groups(2, "--replica-timeout", "1")
    primary, backup = group.urls
    with PSClient([primary], worker_id="w-refused") as ps:
        _pushes(ps, 2)
        before = cluster(backup)
        with pytest.raises(PSError):  # refused by the primary once it has the body
            ps.push({"w": np.ones(N + 1, np.float32)})
        # The refusal can reach the worker before the stream's last bytes reach the backup.
        received = before["stages"]["received"] + 1
        eventually(
            lambda: cluster(backup)["stages"]["received"] == received, "the stage arriving", 20
        )
        after = cluster(backup)
        assert after["stages"]["taken"] == before["stages"]["taken"]
        assert after["lsn"] == before["lsn"] == 3
        np.testing.assert_array_equal(_values(backup, "r"), np.full(N, 3, np.float32))
        eventually(lambda: cluster(backup)["stages"]["held"] == 0, "the stage let go", 20)
        assert cluster(backup)["stages"]["evicted"] >= 1
