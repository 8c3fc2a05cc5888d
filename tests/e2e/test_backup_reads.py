"""Reads a backup may answer: ``pull(..., allow_backup=True)`` and the shard's side of it
(server/replication/reads.py, client_sdk/_replicas.py ``reader``, docs/PROTOCOL.md §6).

Static groups of real shard processes on loopback (tests/helpers/replicas.py; no etcd: who
leads does not matter here):

* a backup refuses a read without ``x-paramshard-allow-backup: 1`` (421 ``not_primary``
  naming the primary), whether the shard's HTTP protocol would answer it itself (a small table
  pull) or the app would, and answers it with the flag; every reply of a replica says its role,
  epoch and lsn;
* the SDK's ``allow_backup=True`` reads (pull, ``out=``, ``min_version``, ``newer_than``,
  ``pull_rows``; sync and asyncio) are answered by the backup (its pull count grows, the
  primary's does not) with the primary's values after a write; a backup that does not answer
  sends the read to the primary;
* a backup cut off from its primary (a relay between them, cut) answers with the older value it
  holds: the value and the version the client returns always match, and alternating with the
  primary's newer value is never taken for a restart of the shard.

Which replica answers which read, role by role (etcd's in-sync set included), is
tests/shard/test_read_refusal.py.
"""

from __future__ import annotations

import logging
import socket
import threading

import httpx2
import msgpack
import numpy as np
import pytest

from client_sdk import AsyncPSClient, NotPrimaryError, PSClient, wire
from client_sdk.optimizers import SGD
from server.launcher import LaunchError
from tests.conftest import OnLoop, http_json
from tests.helpers.replicas import Group, free_ports, start_group


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    g = start_group(tmp_path_factory.mktemp("reads"), 2)
    yield g
    g.close()


def pulls(url: str) -> int:
    """Reads (pull, poll, pull_rows) replica ``url`` answered 200 (its ``/metrics``)."""
    text = httpx2.get(url + "/metrics", timeout=30).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("paramshard_requests_total{")
        and 'status="200"' in line
        and any(f'verb="{v}"' in line for v in ("pull", "poll", "pull_rows"))
    )


def raw_pull(url: str, table: bool, allow: bool) -> httpx2.Response:
    """A pull of ``x`` as the SDK sends a small one (table layout, framed reply: answered by
    the shard's HTTP protocol itself) or in the map layout (answered by the app)."""
    msg = {"names": ["x"], "layout": "table"} if table else {"names": ["x"]}
    headers = {
        "content-type": wire.MSGPACK,
        "accept": f"{wire.FRAME}, {wire.MSGPACK}" if table else wire.MSGPACK,
        wire.HEADER_FLEET: "0/1",
    }
    if allow:
        headers[wire.HEADER_ALLOW_BACKUP] = "1"
    return httpx2.post(url + "/v1/pull", content=msgpack.packb(msg), headers=headers, timeout=30)


@pytest.mark.parametrize("table", [True, False], ids=["answered-by-the-protocol", "by-the-app"])
def test_a_backup_answers_a_read_only_when_the_request_allows_it(group, table):
    primary, backup = group.urls
    with PSClient(f"{primary}|{backup}", worker_id="w-raw") as ps:
        ps.init({"x": np.zeros(3, np.float32)}, SGD(lr=1.0))
        ps.push({"x": np.ones(3, np.float32)})
    lsn = http_json(primary + "/v1/cluster")["replication"]["lsn"]
    refused = raw_pull(backup, table, allow=False)
    assert refused.status_code == 421, refused.text
    error = msgpack.unpackb(refused.content)["error"]
    assert error["code"] == "not_primary" and error["details"]["primary"] == primary
    assert wire.HEADER_ALLOW_BACKUP in error["message"]
    answered = raw_pull(backup, table, allow=True)
    assert answered.status_code == 200, answered.text
    h = answered.headers
    assert (h[wire.HEADER_ROLE], h[wire.HEADER_EPOCH]) == ("backup", "1")
    assert int(h[wire.HEADER_LSN]) >= lsn  # it had every acknowledged write when asked
    mine = raw_pull(primary, table, allow=False)
    assert mine.status_code == 200 and mine.headers[wire.HEADER_ROLE] == "primary"
    assert answered.content == mine.content  # the same values and versions


def test_allow_backup_reads_are_the_backups_and_equal_the_primarys(group):
    primary, backup = group.urls
    with PSClient(f"{primary}|{backup}", worker_id="w-sdk") as ps:
        ps.init({"y": np.zeros(4, np.float32), "n": np.zeros((), np.int64)}, SGD(lr=1.0))
        ps.create_table("t", 4)
        ps.push({"y": np.arange(4, dtype=np.float32)})
        ps.push_rows("t", np.array([1, 2]), np.ones((2, 4), np.float32))
        ps.increment("n", 5)
        want = ps.pull(["y", "n"])
        rows = ps.pull_rows("t", [1, 2, 3])
        with PSClient(f"{primary}|{backup}", worker_id="r-sdk") as reader:
            before = pulls(primary), pulls(backup)
            got = reader.pull(["y", "n"], allow_backup=True)
            buf = np.empty(4, np.float32)
            into = reader.pull(["y"], out={"y": buf}, allow_backup=True)
            ready = reader.pull(["y"], min_version=1, timeout=5, allow_backup=True)
            assert reader.pull(["y"], newer_than="cached", timeout=0.2, allow_backup=True) == {}
            got_rows = reader.pull_rows("t", [1, 2, 3], allow_backup=True)
            after = pulls(primary), pulls(backup)
        assert after[0] == before[0], "the primary answered a read the backup could"
        assert after[1] == before[1] + 5
        np.testing.assert_array_equal(got["y"], want["y"])
        assert int(got["n"]) == int(want["n"]) == 5
        np.testing.assert_array_equal(into["y"], want["y"])
        np.testing.assert_array_equal(buf, want["y"])
        np.testing.assert_array_equal(ready["y"], want["y"])
        np.testing.assert_array_equal(got_rows, rows)
        # the next write, then at once a read from the backup: acknowledged => on the backup
        ps.push({"y": np.ones(4, np.float32)})
        after_write = ps.pull(["y"])["y"]
        with PSClient(f"{primary}|{backup}", worker_id="r-sdk2") as reader:
            np.testing.assert_array_equal(reader.pull(["y"], allow_backup=True)["y"], after_write)


def test_the_async_client_reads_from_the_backup_too(group):
    primary, backup = group.urls
    with PSClient(f"{primary}|{backup}", worker_id="w-async") as ps:
        ps.init({"z": np.full(2, 3.0, np.float32)})

    reader = OnLoop(AsyncPSClient(f"{primary}|{backup}", worker_id="r-async"))
    try:
        before = pulls(primary), pulls(backup)
        got = reader.pull(["z"], allow_backup=True)
        rows = reader.pull(["z"], min_version=0, timeout=5, allow_backup=True)
        after = pulls(primary), pulls(backup)
    finally:
        reader.close()
    assert got["z"].tolist() == rows["z"].tolist() == [3.0, 3.0]
    assert after == (before[0], before[1] + 2)


def test_a_read_the_backup_does_not_answer_goes_to_the_primary(tmp_path):
    g = start_group(tmp_path, 2)
    try:
        primary, backup = g.urls
        with PSClient(f"{primary}|{backup}", worker_id="w-fall", timeout=5) as ps:
            ps.init({"f": np.full(2, 7.0, np.float32)})
            g.kill(1)
            assert ps.pull(["f"], allow_backup=True)["f"].tolist() == [7.0, 7.0]
            assert ps._core.replicas.reader(0) is None  # passed over meanwhile
    finally:
        g.close()


def test_without_the_flag_a_client_listing_only_the_backup_is_refused(group):
    primary, backup = group.urls
    with PSClient(f"{primary}|{backup}", worker_id="w-only") as ps:
        ps.init({"o": np.zeros(2, np.float32)})
    with PSClient([backup], worker_id="r-only") as pb:
        with pytest.raises(NotPrimaryError, match="allow_backup"):
            pb.pull(["o"])
        assert pb.pull(["o"], allow_backup=True)["o"].tolist() == [0.0, 0.0]


# -- a backup cut off from its primary ---------------------------------------------------------


class Relay:
    """A TCP relay to ``127.0.0.1:port`` on a port of its own; :meth:`cut` closes every
    connection through it and every one made after (the backup behind it is cut off)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.cut_off = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.cut_off.set()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.cut()
        self.server.close()


class RelayedGroup(Group):
    """A static group of two whose primary reaches its backup through ``relay_url`` (the
    backup's URL in ``--replica-group``); clients reach the backup directly."""

    relay_url = ""

    def serve_args(self, i: int) -> list[str]:
        args = super().serve_args(i)
        group = args.index("--replica-group") + 1
        args[group] = f"{self.group_urls[0]}|{self.relay_url}"
        if i == 1:
            args[args.index("--advertise-url") + 1] = self.relay_url
        return args


def test_a_lagging_backups_older_value_comes_with_its_own_version(tmp_path, caplog):
    for attempt in range(4):
        ports = free_ports(2)
        relay = Relay(ports[1])
        RelayedGroup.relay_url = relay.url
        where = tmp_path / f"g{attempt}"
        where.mkdir()
        try:
            g = RelayedGroup(2, where, ports, ("--replica-timeout", "0.5"))
            break
        except LaunchError:
            relay.close()
    else:
        pytest.fail("a relayed group did not start")
    caplog.set_level(logging.WARNING, logger="client_sdk")
    try:
        primary, backup = g.urls
        with PSClient(f"{primary}|{backup}", worker_id="w-lag", retry_deadline=30) as ps:
            ps.init({"x": np.zeros(2, np.float32), "still": np.full(2, 5.0, np.float32)}, SGD(1.0))
            ps.push({"x": np.ones(2, np.float32)})  # version 1 (-1, -1): on the backup
            relay.cut()
            ps.push({"x": np.ones(2, np.float32)})  # version 2 (-2, -2): the backup is dropped
            assert http_json(primary + "/v1/cluster")["replication"]["in_sync"] == []
            for _ in range(3):  # alternating: the primary's newer value, the backup's older
                new = ps.pull(["x", "still"])
                assert (new["x"].tolist(), ps.versions(["x"])["x"]) == ([-2.0, -2.0], 2)
                old = ps.pull(["x", "still"], allow_backup=True)
                assert (old["x"].tolist(), ps.versions(["x"])["x"]) == ([-1.0, -1.0], 1)
                assert old["still"].tolist() == [5.0, 5.0]
        restarts = [r for r in caplog.records if "restarted" in r.getMessage()]
        assert not restarts, [r.getMessage() for r in restarts]
    finally:
        g.close()
        relay.close()
