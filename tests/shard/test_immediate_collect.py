"""push, push_rows and group_push bodies that come over several reads, collected by the
shard's HTTP protocol and answered there (server.httptools_protocol, COLLECT_BELOW_ATTR;
server.immediate, COLLECT_PUSH_BELOW, COLLECT_ROWS_BELOW, COLLECT_GROUP_BELOW): the app's
bytes, without reaching the app; past the bound, or for a verb that does not collect, the app
answers; a shutdown meanwhile lets the request finish, a client that leaves meanwhile changes
nothing.

The shard's real app runs in this process (tests/shard/test_immediate.py's ``shard`` and
``Connection``), each request fed to the protocol in pieces as a socket would deliver them.
"""

from __future__ import annotations

import asyncio

import numpy as np

from client_sdk.wire import groups as group_wire
from server.config import ShardConfig
from server.httptools_protocol import (
    ANSWER_BELOW,
    BYPASS_BELOW,
    COLLECT_BELOW_ATTR,
    COLLECT_ROOM_ATTR,
    IMMEDIATE,
    SMALL_READ,
    ShardHttpProtocol,
)
from server.immediate import COLLECT_GROUP_BELOW, COLLECT_PUSH_BELOW, COLLECT_ROWS_BELOW
from tests.shard.test_immediate import Callbacks, Connection, _push, _push_rows, request, shard

#: Distinct ids of table t (dim 4) whose push_rows body is above ANSWER_BELOW.
IDS = np.arange(1000, 4000, dtype=np.int64)


def _big_push(seq: int) -> bytes:
    grads = np.ones((len(IDS), 4), np.float32)
    data = _push_rows({"name": "t", "ids": IDS, "grads": grads, "worker_id": "w", "seq": seq}, True)
    assert ANSWER_BELOW < len(data) < COLLECT_ROWS_BELOW
    return data


#: The members of the step group the group-push tests register: 64 float32 variables of 1,000.
GROUP = [f"g{i}" for i in range(64)]


def _register_group(*apps) -> list[str]:
    """Make :data:`GROUP`'s variables (zeros) on each app's store and register it there; the
    groups' ids, in the apps' order."""
    ids = []
    for app in apps:
        store = app.state.store
        store.init({n: (np.zeros(1000, np.float32), None) for n in GROUP})
        ids.append(store.groups.register(store, GROUP, 64, 1 << 20).id)
    return ids


def _group_push(gid: str, seq: int) -> bytes:
    """A push of ``seq`` into every value of group ``gid``: 256,000 bytes of gradients."""
    grads = np.full(64 * 1000, seq, np.float32).data.cast("B")
    enc = group_wire.encode(
        {"group": gid, "worker_id": "w", "seq": seq}, None, "grads", "<f4", [grads], len(grads)
    )
    return request(path="/v1/group_push", body=enc.join(), ctype=enc.content_type)


async def _in_pieces(conn: Connection, data: bytes, pieces: int = 3) -> bytes:
    """Feed ``data`` in ``pieces`` reads; what was written once its reply is complete."""
    cuts = np.linspace(0, len(data), pieces + 1).astype(int).tolist()
    for k in range(pieces - 1):
        assert await conn.send(data[cuts[k] : cuts[k + 1]], replies=0) == b""
    return await conn.send(data[cuts[-2] :])


def test_a_push_rows_over_several_reads_is_answered_at_once_with_the_apps_bytes():
    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            for seq in (1, 2, 2):  # the last a retry: "duplicate"
                data = _big_push(seq)
                mine = await _in_pieces(Connection(immediate), data)
                theirs = await _in_pieces(Connection(usual), data)
                assert mine.startswith(b"HTTP/1.1 200 ")
                assert mine.replace(incarnations[0], b"") == theirs.replace(incarnations[1], b"")
            assert immediate.calls == 0 and usual.calls == 3
            for app in (one, other):
                table = app.state.tables.get("t")
                assert table.version == 3 and len(table) == 2 + len(IDS)

    asyncio.run(run())


def test_a_push_over_several_reads_is_answered_at_once_with_the_apps_bytes():
    """A push of one 400 KB gradient (above ANSWER_BELOW) is collected and applied in the
    protocol, as the app would answer it (server.immediate, COLLECT_PUSH_BELOW), in each
    layout the SDK sends; a retry of a seq is a duplicate there too."""
    n = 100_000
    pushes = [(1, "table"), (2, "framed"), (3, "msgpack"), (3, "table")]

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            for app in (one, other):
                app.state.store.init({"big": (np.zeros(n, np.float32), None)})
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            for seq, layout in pushes:
                grads = {"big": np.full(n, seq, np.float32)}
                data = _push({"worker_id": "w", "seq": seq}, layout, grads)
                assert ANSWER_BELOW < len(data) < COLLECT_PUSH_BELOW
                mine = await _in_pieces(Connection(immediate), data)
                theirs = await _in_pieces(Connection(usual), data)
                assert mine.startswith(b"HTTP/1.1 200 ")
                assert mine.replace(incarnations[0], b"") == theirs.replace(incarnations[1], b"")
            assert immediate.calls == 0 and usual.calls == len(pushes)
            for app in (one, other):
                got = app.state.store.pull(["big"])["big"]
                assert got["version"] == 3 and np.isclose(got["value"][0], -0.06)  # SGD, lr 0.01

    asyncio.run(run())


def test_the_rest_of_a_big_collected_body_is_read_into_one_buffer(monkeypatch):
    """Once BYPASS_BELOW bytes or more of a collected body are still to come, and the gate has
    room for the body, the rest is written straight into one buffer of its size (the
    transport's protocol is then a BufferedProtocol) and answered from it, as the app would;
    without room in the gate it goes the usual way (the app answers it, the same); a client
    that leaves while its body is read into the buffer changes nothing."""
    ids = np.arange(1000, 12_000, dtype=np.int64)  # a 260 KB body: 3 reads of ~90 KB

    def push(seq: int, name: str = "t") -> bytes:
        grads = np.full((len(ids), 4), seq, np.float32)
        msg = {"name": name, "ids": ids, "grads": grads, "worker_id": "w", "seq": seq}
        data = _push_rows(msg, True)
        assert BYPASS_BELOW < len(data) // 3 and len(data) < COLLECT_ROWS_BELOW
        return data

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            answerer = getattr(immediate, IMMEDIATE)[b"/v1/push_rows"]
            for seq, room in ((1, True), (2, False), (2, True)):  # the last a retry
                if not room:
                    monkeypatch.setattr(answerer, COLLECT_ROOM_ATTR, lambda nbytes: False)
                data = push(seq)
                conn = Connection(immediate)
                third = len(data) // 3
                assert await conn.send(data[:third], replies=0) == b""
                direct = isinstance(conn.transport.get_protocol(), asyncio.BufferedProtocol)
                assert direct == room
                mine = await conn.send(data[third:])
                assert conn.transport.get_protocol() in (None, conn.protocol, conn.protocol._small)
                theirs = await _in_pieces(Connection(usual), data)
                assert mine.startswith(b"HTTP/1.1 200 ")
                assert mine.replace(incarnations[0], b"") == theirs.replace(incarnations[1], b"")
                monkeypatch.undo()
            assert immediate.calls == 1 and usual.calls == 3  # the one without room
            rows = [app.state.tables.get("t").gather(ids) for app in (one, other)]
            assert np.array_equal(rows[0], rows[1])
            assert one.state.tables.get("t").version == other.state.tables.get("t").version == 3
            # a client that leaves while its body is read into the buffer: nothing changes
            conn = Connection(immediate)
            data = push(3)
            assert await conn.send(data[: len(data) // 3], replies=0) == b""
            assert isinstance(conn.transport.get_protocol(), asyncio.BufferedProtocol)
            conn.transport.get_protocol().connection_lost(None)
            await asyncio.sleep(0.01)
            assert immediate.calls == 1 and one.state.tables.get("t").version == 3

    asyncio.run(run())


def test_a_body_being_collected_holds_its_room_in_the_gate():
    """A body collected over several reads counts in the gate until it is answered, as an
    admitted request's does: one that does not fit beside it then goes the usual way (the app
    admits it once the first is answered) rather than being collected beside it, so what
    collected bodies hold stays within --max-queued-bytes; a client that leaves gives its room
    back."""
    ids = np.arange(1000, 12_000, dtype=np.int64)  # a 260 KB body

    def push(seq: int) -> tuple[bytes, int]:
        grads = np.full((len(ids), 4), seq, np.float32)
        msg = {"name": "t", "ids": ids, "grads": grads, "worker_id": "w", "seq": seq}
        data = _push_rows(msg, True)
        return data, len(data) - data.index(b"\r\n\r\n") - 4

    config = ShardConfig(max_request_bytes=300_000, max_queued_bytes=300_000)

    async def run() -> None:
        async with shard(config) as (app, immediate, _):
            gate = app.state.gate
            (first, size), (second, _) = push(1), push(2)
            one, two = Connection(immediate), Connection(immediate)
            third = len(first) // 3
            assert await one.send(first[:third], replies=0) == b""
            assert (gate.requests, gate.bytes) == (1, size)
            assert await two.send(second[:third], replies=0) == b""
            await asyncio.sleep(0.01)  # the app's task starts (and waits in the gate's line)
            assert gate.bytes <= gate.max_bytes and immediate.calls == 1
            assert not isinstance(two.transport.get_protocol(), asyncio.BufferedProtocol)
            assert (await one.send(first[third:])).startswith(b"HTTP/1.1 200 ")
            assert (await two.send(second[third:])).startswith(b"HTTP/1.1 200 ")
            assert immediate.calls == 1 and (gate.requests, gate.bytes) == (0, 0)
            assert app.state.tables.get("t").version == 3
            leaving = Connection(immediate)
            assert await leaving.send(push(3)[0][:third], replies=0) == b""
            assert gate.bytes == size
            leaving.transport.get_protocol().connection_lost(None)
            assert (gate.requests, gate.bytes) == (0, 0)

    asyncio.run(run())


def test_a_group_push_over_several_reads_is_answered_at_once_with_the_apps_bytes():
    """A step group's push (64 x 1,000 float32: above ANSWER_BELOW) is collected and applied
    in the protocol, as the app would answer it (server.immediate, COLLECT_GROUP_BELOW)."""

    def group_push(gid: str, seq: int) -> bytes:
        data = _group_push(gid, seq)
        assert ANSWER_BELOW < len(data) < COLLECT_GROUP_BELOW
        return data

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            ids = _register_group(one, other)
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            for seq in (1, 2, 2):  # the last a retry: "duplicate"
                mine = await _in_pieces(Connection(immediate), group_push(ids[0], seq))
                theirs = await _in_pieces(Connection(usual), group_push(ids[1], seq))
                assert mine.startswith(b"HTTP/1.1 200 ")
                mine = mine.replace(incarnations[0], b"").replace(ids[0].encode(), b"")
                theirs = theirs.replace(incarnations[1], b"").replace(ids[1].encode(), b"")
                assert mine == theirs
            assert immediate.calls == 0 and usual.calls == 3
            for app in (one, other):
                got = app.state.store.pull(GROUP[-1:])[GROUP[-1]]
                assert got["version"] == 2 and np.isclose(got["value"][0], -0.03)  # SGD, lr 0.01

    asyncio.run(run())


def test_the_body_in_the_read_that_brings_a_collected_heads_goes_to_the_buffer(monkeypatch):
    """A read that brings a collected request's head and part of its body (a group push of
    64 x 1,000 float32, the read a third of it): only the head goes to the parser; the body's
    bytes of that read are copied into the body's buffer from the read itself (the parser
    makes no piece of them), the rest comes through the buffer, and the answer and the values
    are the app's."""
    parsed: list[int] = []
    on_body = ShardHttpProtocol.on_body

    def counted(self, body):  # the body bytes the parser hands on
        parsed.append(len(body))
        return on_body(self, body)

    monkeypatch.setattr(ShardHttpProtocol, "on_body", counted)

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            ids = _register_group(one, other)
            replies = []
            for gid, app in zip(ids, (immediate, usual)):
                grads = np.arange(64 * 1000, dtype=np.float32).data.cast("B")
                enc = group_wire.encode(
                    {"group": gid, "worker_id": "w", "seq": 1},
                    None,
                    "grads",
                    "<f4",
                    [grads],
                    len(grads),
                )
                data = request(path="/v1/group_push", body=enc.join(), ctype=enc.content_type)
                conn = Connection(app)
                parsed.clear()
                assert await conn.send(data[: len(data) // 3], replies=0) == b""
                if app is immediate:
                    assert parsed == []
                    assert isinstance(conn.transport.get_protocol(), asyncio.BufferedProtocol)
                replies.append(await conn.send(data[len(data) // 3 :]))
                if app is immediate:
                    assert parsed == []
                    assert conn.transport.get_protocol() in (
                        None,
                        conn.protocol,
                        conn.protocol._small,
                    )
                replies[-1] = replies[-1].replace(gid.encode(), b"")
            incarnation = one.state.incarnation.encode(), other.state.incarnation.encode()
            mine, theirs = (r.replace(i, b"") for r, i in zip(replies, incarnation))
            assert mine.startswith(b"HTTP/1.1 200 ") and mine == theirs
            assert immediate.calls == 0 and usual.calls == 1
            values = [app.state.store.pull(GROUP)[GROUP[-1]]["value"] for app in (one, other)]
            assert np.array_equal(values[0], values[1])
            assert np.isclose(values[0][-1], -0.01 * (64 * 1000 - 1))  # SGD, lr 0.01

    asyncio.run(run())


def test_a_collected_requests_head_as_the_sdk_writes_it_is_read_without_the_parser():
    """A read that brings a group push's head, as the SDK writes one, and the start of its
    body: the head is read as a small whole request's (server.whole_heads, no parser
    callback), the body collected into its buffer, the answer the app's. When the answerer
    then declines (an unknown group), the parser reads the head after all and the app answers
    it, and the connection goes on (also when the parser read the head: one it alone reads);
    without room in the gate for the body now, the parser reads the head and the app answers
    it, the same."""

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            ids = _register_group(one, other)
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            conns = Connection(immediate), Connection(usual)
            seen = Callbacks(conns[0].protocol)

            async def both_ways(
                seq: int, gids=ids, third: bool = True, capital: bool = False
            ) -> list[bytes]:
                replies = []
                for conn, gid, incarnation in zip(conns, gids, incarnations):
                    data = _group_push(gid, seq)
                    if capital:
                        data = data.replace(b"host: ", b"Host: ")
                    cut = len(data) // 3 if third else len(data) - 1
                    assert await conn.send(data[:cut], replies=0) == b""
                    reply = await conn.send(data[cut:])
                    replies.append(reply.replace(incarnation, b"").replace(gid.encode(), b""))
                assert replies[0] == replies[1]
                return replies

            for seq in (1, 2):  # a new connection's first request, then between requests
                assert (await both_ways(seq))[0].startswith(b"HTTP/1.1 200 ")
            assert seen.count == 0 and immediate.calls == 0
            unknown = ("0" * len(ids[0]), "0" * len(ids[1]))
            assert (await both_ways(3, unknown))[0].startswith(b"HTTP/1.1 404 ")
            assert seen.count > 0 and immediate.calls == 1
            # the same with a head only the parser reads: the parser's way, declined alike
            seen.count = 0
            assert (await both_ways(3, unknown, capital=True))[0].startswith(b"HTTP/1.1 404 ")
            assert seen.count > 0 and immediate.calls == 2
            seen.count = 0
            answerer = getattr(immediate, IMMEDIATE)[b"/v1/group_push"]
            room = getattr(answerer, COLLECT_ROOM_ATTR)
            setattr(answerer, COLLECT_ROOM_ATTR, lambda nbytes: False)  # no room now
            try:
                assert (await both_ways(3))[0].startswith(b"HTTP/1.1 200 ")
                assert seen.count > 0 and immediate.calls == 3
            finally:
                setattr(answerer, COLLECT_ROOM_ATTR, room)
            seen.count = 0
            assert (await both_ways(4, third=False))[0].startswith(b"HTTP/1.1 200 ")
            assert seen.count == 0 and immediate.calls == 3
            for app in (one, other):
                assert app.state.store.pull(GROUP[-1:])[GROUP[-1]]["version"] == 4

    asyncio.run(run())


def test_after_a_collected_body_a_connection_reads_little_before_the_next_one(monkeypatch):
    """Once a connection has had a body collected into one buffer, it reads at most SMALL_READ
    bytes at a time: the next group push arriving all at once brings its head and a little of
    its body in its first read (copied into the body's buffer, not parsed), the rest is read
    into the buffer; a small request on it is still answered at once; the answers and values
    are the app's."""
    reads: list[int] = []
    parsed: list[int] = []
    data_received, on_body = ShardHttpProtocol.data_received, ShardHttpProtocol.on_body

    def counted_read(self, data):
        reads.append(len(data))
        return data_received(self, data)

    def counted_body(self, body):
        parsed.append(len(body))
        return on_body(self, body)

    monkeypatch.setattr(ShardHttpProtocol, "data_received", counted_read)
    monkeypatch.setattr(ShardHttpProtocol, "on_body", counted_body)

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            ids = _register_group(one, other)
            mine_conn, theirs_conn = Connection(immediate), Connection(usual)
            pull = request()  # a small pull, answered in the protocol
            for seq in (1, 2, 3):
                data = _group_push(ids[0], seq)
                reads.clear()
                parsed.clear()
                if seq == 1:  # over several reads: collected into one buffer
                    mine = await _in_pieces(mine_conn, data)
                else:  # all at once, as a socket holding all of it would give it
                    mine = await mine_conn.send(data)
                    assert max(reads) <= SMALL_READ < len(data) and parsed == []
                theirs = await theirs_conn.send(_group_push(ids[1], seq))
                mine = mine.replace(ids[0].encode(), b"").replace(
                    one.state.incarnation.encode(), b""
                )
                theirs = theirs.replace(ids[1].encode(), b"")
                assert mine.startswith(b"HTTP/1.1 200 ")
                assert mine == theirs.replace(other.state.incarnation.encode(), b"")
                calls = immediate.calls
                assert (await mine_conn.send(pull)).startswith(b"HTTP/1.1 200 ")
                assert immediate.calls == calls  # answered in the protocol, as before
            assert immediate.calls == 0
            values = [app.state.store.pull(GROUP)[GROUP[-1]]["value"] for app in (one, other)]
            assert np.array_equal(values[0], values[1])
            assert np.isclose(values[0][0], -0.01 * 6)  # SGD, lr 0.01: 1 + 2 + 3

    asyncio.run(run())


def test_past_the_bound_or_for_a_verb_that_does_not_collect_the_app_answers(monkeypatch):
    async def run() -> None:
        async with shard() as (app, immediate, _):
            answerer = getattr(immediate, IMMEDIATE)[b"/v1/push_rows"]
            data = _big_push(1)
            monkeypatch.setattr(answerer, COLLECT_BELOW_ATTR, len(data) - 200)  # the body's size
            assert (await _in_pieces(Connection(immediate), data)).startswith(b"HTTP/1.1 200 ")
            assert immediate.calls == 1 and app.state.tables.get("t").version == 2
            # a pull is answered at once only when its body comes whole in one read
            pull, conn = request(), Connection(immediate)
            assert await conn.send(pull[:-5], replies=0) == b""  # the head, most of the body
            assert (await conn.send(pull[-5:])).startswith(b"HTTP/1.1 200")
            assert immediate.calls == 2
            await Connection(immediate).send(pull)
            assert immediate.calls == 2

    asyncio.run(run())


def test_a_shutdown_while_a_body_is_collected_answers_it_then_closes():
    async def run() -> None:
        async with shard() as (app, immediate, _):
            conn = Connection(immediate)
            data = _big_push(1)
            assert await conn.send(data[:30_000], replies=0) == b""
            conn.protocol.shutdown()
            assert not conn.transport.closed  # the request is under way
            reply = await conn.send(data[30_000:])
            assert reply.startswith(b"HTTP/1.1 200 ") and conn.transport.closed
            assert immediate.calls == 0 and app.state.tables.get("t").version == 2
            # one the answerer hands to the app (an unknown table): answered, then closed
            conn = Connection(immediate)
            grads = np.ones((len(IDS), 4), np.float32)
            msg = {"name": "nope", "ids": IDS, "grads": grads, "worker_id": "w", "seq": 2}
            data = _push_rows(msg, True)
            assert await conn.send(data[:30_000], replies=0) == b""
            conn.protocol.shutdown()
            reply = await conn.send(data[30_000:])
            assert reply.startswith(b"HTTP/1.1 404 ") and conn.transport.closed
            assert immediate.calls == 1
            idle = Connection(immediate)
            idle.protocol.shutdown()
            assert idle.transport.closed  # an idle connection closes at once, as before

    asyncio.run(run())


def test_a_client_that_leaves_while_its_body_is_collected_changes_nothing():
    async def run() -> None:
        async with shard() as (app, immediate, _):
            conn = Connection(immediate)
            data = _big_push(1)
            assert await conn.send(data[: len(data) - 10], replies=0) == b""
            conn.protocol.connection_lost(None)
            await asyncio.sleep(0.01)
            assert immediate.calls == 0 and app.state.tables.get("t").version == 1

    asyncio.run(run())
