"""A primary's write on its way to the backups (server/store/journal.py, server/replication/log.py,
server/replication/forward.py): a push is logged at the point it can no longer be refused and
before it writes, its entry keeps the request's gradient memory uncopied and unchanged, and a
link waiting for entries is sent the entry at once, with no turn of the event loop.

The store runs in this process with a journal; the backup of the last test is a small HTTP
responder on a thread (a socket the test reads), so that what reaches it can be seen while the
event loop is held.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import msgpack
import numpy as np
import pytest

from client_sdk import wire
from client_sdk.optimizers import SGD, Add
from server.errors import ShardError
from server.replication import Role
from server.replication.forward import Forwarder
from server.replication.log import TENSOR, ReplicationLog
from server.store import ParameterStore

A = "http://a:7100"


class Recording:
    """A journal that records, at each commit, the value of ``name`` the store holds then."""

    def __init__(self, store: ParameterStore, name: str) -> None:
        self.store, self.name = store, name
        self.begun: list[str] = []
        self.committed: list[np.ndarray] = []

    def begin(self, method, args, kwargs):
        self.begun.append(method)
        return method

    def commit(self, begun) -> None:
        self.committed.append(np.array(self.store.pull([self.name])[self.name]["value"]))


def test_a_push_is_committed_before_it_writes_and_a_refused_one_never():
    store = ParameterStore(0, 1)
    store.init({"v": (np.ones(4, np.float32), Add().to_wire())})
    store.init({"big": (np.full(4, 3e38, np.float32), Add().to_wire())})
    store.journal = journal = Recording(store, "v")
    store.push("w", 1, {"v": np.full(4, 2, np.float32)})
    # Taken once it could no longer be refused, and before the write: the value then was 1.
    assert [c.tolist() for c in journal.committed] == [[1.0] * 4]
    assert store.pull(["v"])["v"]["value"].tolist() == [3.0] * 4

    with pytest.raises(ShardError) as refused:  # 3e38 + 3e38 overflows float32
        store.push("w", 2, {"big": np.full(4, 3e38, np.float32)})
    assert refused.value.code == "bad_tensor"
    assert journal.begun[-1] == "Writes.push" and len(journal.committed) == 1  # never logged
    assert store.pull(["big"])["big"]["value"].tolist() == [np.float32(3e38)] * 4


def test_an_entry_keeps_the_gradients_memory_uncopied_and_the_write_leaves_it_as_it_came():
    store = ParameterStore(0, 1)
    store.init({"v": (np.zeros(1000, np.float32), SGD(lr=0.5).to_wire())})
    log = ReplicationLog(Role.from_config((A, "http://b:7100"), A), 1 << 20)
    store.journal = log
    body = np.arange(1000, dtype=np.float32)  # as a request's framed body holds it: writable
    grad = body[:]
    store.push("w", 1, {"v": grad})
    entry = log.since(0, 1 << 20)[0]
    kept = entry.args[2]["v"][TENSOR]
    assert np.shares_memory(kept, body) and not grad.flags.writeable
    # SGD would have used a writable gradient as scratch space: the bytes are as they came.
    assert kept.tolist() == np.arange(1000, dtype=np.float32).tolist()
    assert store.pull(["v"])["v"]["value"].tolist() == (-0.5 * np.arange(1000)).tolist()


class Backup:
    """An HTTP/1.1 responder on a thread: reads each request whole (its body by
    ``Content-Length``), answers the ``applied_lsn`` and ``lsn_epoch`` of its last entry, and
    sets ``got`` once a request holding an entry has arrived whole."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.got = threading.Event()
        self.applied = self.applied_epoch = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(1 << 16)
                    if not more:
                        return
                    data += more
                head, data = data.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(data) < length:
                    data += conn.recv(1 << 20)
                body, data = data[:length], data[length:]
                msg = wire.unpack(body, wire.FRAME)
                if msg["entries"]:
                    self.applied, self.applied_epoch = msg["entries"][-1][:2]
                reply = msgpack.packb(
                    {
                        "applied_lsn": self.applied,
                        "lsn_epoch": self.applied_epoch,
                        "epoch": msg["epoch"],
                    }
                )
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                    % (wire.MSGPACK.encode(), len(reply))
                    + reply
                )
                if msg["entries"]:
                    self.got.set()

    def close(self) -> None:
        self.listener.close()


def test_a_waiting_link_is_sent_a_write_as_it_commits_without_a_turn_of_the_loop():
    backup = Backup()

    async def main() -> None:
        role = Role.from_config((A, backup.url), A)
        store = ParameterStore(0, 1)
        store.init({"v": (np.zeros(100_000, np.float32), Add().to_wire())})
        log = ReplicationLog(role, 64 << 20)
        store.journal = log
        forwarder = Forwarder(role, log, timeout=10.0, batch_bytes=32 << 20)
        forwarder.start()
        try:
            link = forwarder.links[backup.url]
            for _ in range(500):  # its first (empty) batch answered, it waits for entries
                if link.idle:
                    break
                await asyncio.sleep(0.01)
            assert link.idle and link.acked == 0
            store.push("w", 1, {"v": np.ones(100_000, np.float32)})
            # No await since the push: only a send made as it committed can have reached it.
            assert backup.got.wait(10), "the entry was not sent until the loop turned"
            await forwarder.synced(log.head)
            assert link.acked == 1
        finally:
            await forwarder.stop()

    try:
        asyncio.run(main())
    finally:
        backup.close()
