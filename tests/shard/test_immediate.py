"""Small table pulls, pull_rows, pushes and increments answered by the shard's HTTP protocol
itself (server.httptools_protocol, IMMEDIATE; server.immediate): the same bytes as the app's
answer, and every request it does not take handed to the app, which answers it the usual way.

The shard's real app runs in this process, served twice over one store: once as a shard
serves it, once with nothing answered immediately (``immediate = {}``); each request goes to
both, on connections of the protocol with a recording transport and a fixed ``date`` header,
and the two byte streams must be equal. A counting wrapper around the served app tells which
requests reached it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import msgpack
import numpy as np
import pytest
import uvicorn
from uvicorn.server import ServerState

from client_sdk import wire
from client_sdk.embedding import TableSpec, initial_rows
from client_sdk.optimizers import SGD, Add
from server import admission
from server.app import create_app, serving_app
from server.config import ShardConfig
from server.httptools_protocol import ANSWER_BELOW, IMMEDIATE, ShardHttpProtocol
from server.upstream import new_parser
from tests.helpers.recorder import Recorder

NAMES = ["a", "b", "c"]
DATE = [(b"date", b"Tue, 24 Nov 2026 10:00:00 GMT")]


class Counting:
    """The served app, counting the requests that reach it (the protocol finds the
    answerers on it, as on the app it wraps)."""

    def __init__(self, served) -> None:
        self.served = served
        self.calls = 0
        setattr(self, IMMEDIATE, getattr(served, IMMEDIATE))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.served(scope, receive, send)


class Connection:
    """One connection of the shard's protocol to ``app``; :meth:`send` feeds it bytes."""

    def __init__(self, app, access_log: bool = False) -> None:
        config = uvicorn.Config(
            app,
            http=ShardHttpProtocol,
            lifespan="off",
            log_level="critical",
            access_log=access_log,
            proxy_headers=False,
            server_header=False,
        )  # as a shard serves
        config.load()
        state = ServerState()
        state.default_headers = list(DATE)
        self.protocol = ShardHttpProtocol(config=config, server_state=state, app_state={})
        self.transport = Recorder()
        self.protocol.connection_made(self.transport)

    async def send(self, data: bytes, replies: int = 1) -> bytes:
        """Feed ``data``; what was written once ``replies`` responses are complete (or the
        connection closed)."""
        before = len(self.transport.calls)
        self.feed(data)
        deadline = asyncio.get_running_loop().time() + 5.0
        for i in itertools.count():
            if (
                self.transport.closed
                or _complete(self.transport, before) >= replies
                or asyncio.get_running_loop().time() > deadline
            ):
                break
            await asyncio.sleep(0 if i < 100 else 0.001)
        return self.transport.sent(before)

    def feed(self, data: bytes) -> None:
        """Deliver ``data`` as a socket read would, to the protocol the transport has now
        (one that reads into its own buffer, :class:`asyncio.BufferedProtocol`, through it)."""
        while data:
            protocol = self.transport.get_protocol() or self.protocol
            if not isinstance(protocol, asyncio.BufferedProtocol):
                protocol.data_received(data)
                return
            buf = protocol.get_buffer(len(data))
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            protocol.buffer_updated(n)
            data = data[n:]


def _complete(transport: Recorder, before: int) -> int:
    """Responses whose last byte was written since call ``before`` (each a head with a
    Content-Length and its body, after any interim 1xx response)."""
    sent = transport.sent(before)
    count = 0
    while sent:
        head, sep, rest = sent.partition(b"\r\n\r\n")
        if not sep:
            break
        if head.startswith(b"HTTP/1.1 1"):  # an interim response: no body
            sent = rest
            continue
        length = [
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        if not length or len(rest) < length[0]:
            break
        count += 1
        sent = rest[length[0] :]
    return count


@contextlib.asynccontextmanager
async def shard(config: ShardConfig | None = None):
    """The shard's app with variables a, b (float32, 3) and c (int64, 2 x 2) and embedding
    table t (dim 4, rows 5 and -7 stored), and two ways to serve it: ``(immediate, usual)``,
    each a :class:`Counting`."""
    app = create_app(config or ShardConfig())
    async with app.router.lifespan_context(app):
        app.state.store.init(
            {
                "a": (np.arange(3, dtype=np.float32), Add().to_wire()),
                "b": (np.ones(3, np.float32), Add().to_wire()),
                "c": (np.arange(4, dtype=np.int64).reshape(2, 2), None),
            }
        )
        tables = app.state.tables
        tables.create("t", TableSpec(dim=4, optimizer=SGD(lr=1.0), seed=3).to_wire())
        tables.push("t", "w0", 1, np.array([5, -7], np.int64), np.ones((2, 4), np.float32))
        immediate = Counting(serving_app(app))
        plain = serving_app(app)
        plain.immediate = {}
        yield app, immediate, Counting(plain)


def request(
    msg=None,
    *,
    path: str = "/v1/pull",
    body: bytes | None = None,
    ctype: str = wire.MSGPACK,
    accept: str = wire.FRAME,
    extra: str = "",
    version: str = "1.1",
) -> bytes:
    if body is None:
        body = msgpack.packb(msg if msg is not None else {"names": NAMES, "layout": "table"})
    return (
        f"POST {path} HTTP/{version}\r\nhost: shard\r\ncontent-type: {ctype}\r\n"
        f"accept: {accept}\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def both(
    immediate: Counting, usual: Counting, data: bytes, replies: int = 1
) -> tuple[bytes, bytes]:
    """``data`` on a new connection to each; what each wrote."""
    return (
        await Connection(immediate).send(data, replies),
        await Connection(usual).send(data, replies),
    )


def _table(sent: bytes) -> tuple[dict, list]:
    """A 200 table reply's header message and rows."""
    head, _, body = sent.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
    msg = wire.unpack(body, wire.FRAME)
    return msg, wire.table_rows(msg["table"], body, names=NAMES)[1]


def test_a_small_table_pull_is_answered_at_once_with_the_apps_bytes():
    async def run() -> None:
        async with shard() as (app, immediate, usual):
            for held in (None, [None, None, None], [0, 0, 0], [0, None, 0]):
                msg = {"names": NAMES, "layout": "table"}
                if held is not None:
                    msg["versions"] = held
                mine, theirs = await both(immediate, usual, request(msg))
                assert mine == theirs
                assert immediate.calls == 0 and usual.calls > 0
                table, rows = _table(mine)
                assert table["table"]["versions"] == [0, 0, 0]
                fresh = [v is None for v in held] if held else [True] * 3
                assert [r is not None for r in rows] == fresh
                if fresh[0]:
                    assert rows[0].tolist() == [0.0, 1.0, 2.0]
                if fresh[2]:
                    assert rows[2].tolist() == [[0, 1], [2, 3]]
            # a uniform table, padded and packed (a and b: float32 (3,), 12 bytes each)
            for packed in (False, True):
                msg = {"names": ["a", "b"], "layout": "table", "uniform": True, "packed": packed}
                mine, theirs = await both(immediate, usual, request(msg))
                assert mine == theirs and immediate.calls == 0
                uniform = wire.unpack(mine.partition(b"\r\n\r\n")[2], wire.FRAME)["table"]
                assert uniform["uniform"].get("packed", False) is packed
            # the fleet header as the SDK sends it (this shard's own) is no obstacle
            mine, theirs = await both(
                immediate, usual, request(extra="x-paramshard-fleet: 0/1\r\n")
            )
            assert mine == theirs and immediate.calls == 0
            # the reply carries the shard's headers, the restored state's version included
            head = mine.partition(b"\r\n\r\n")[0].decode()
            assert "x-paramshard-incarnation: " + app.state.incarnation in head
            assert "x-paramshard-state-version: " in head

    asyncio.run(run())


def test_a_pull_of_one_name_is_answered_in_one_pass_with_the_apps_bytes():
    """The commonest pull (one name, the table layout) is answered by server.immediate's
    one-pass answerer, without the store's pull_rows, with the bytes the app gives; a pull of
    one name it does not take (a refusal, a field it does not read) gets the app's answer too."""

    async def run() -> None:
        async with shard() as (app, immediate, usual):
            store = app.state.store
            store.init({"z": (np.zeros((0, 3), np.float32), None)})  # a row with no bytes
            store.push("w", 1, {"a": np.ones(3, np.float32)}, None)  # a is at version 1
            rows = store.pull_rows
            reads = []

            def counted(*args, **kwargs):
                reads.append(args)
                return rows(*args, **kwargs)

            store.pull_rows = counted
            flags = ({}, {"uniform": True, "packed": True}, {"uniform": False}, {"packed": None})
            for name, held, extra in itertools.product(
                ("a", "c", "z"), (None, [None], [0], [1]), flags
            ):
                msg = {"names": [name], "layout": "table", **extra}
                if held is not None:
                    msg["versions"] = held
                mine = await Connection(immediate).send(request(msg))
                assert not reads and immediate.calls == 0, msg
                theirs = await Connection(usual).send(request(msg))
                assert mine == theirs, msg
                assert len(reads) == 1, msg  # the usual way reads the row with pull_rows
                reads.clear()
            assert store.pull(["a"])["a"]["version"] == 1
            for msg in (
                {"names": ["nope"], "layout": "table"},
                {"names": ["a"], "layout": "table", "versions": [-1]},
                {"names": ["a"], "layout": "table", "versions": [None, 1]},
                {"names": ["a"], "layout": "table", "versions": [True]},
                {"names": ["a"], "layout": "table", "versions": {"a": 1}},
                {"names": ["a"], "layout": "table", "uniform": "yes"},
                {"names": ["a"], "layout": "table", "wire_dtype": "float16"},
                {"names": ["a"], "layout": "table", "padding": b"x"},
                {"names": ["a"], "layout": "tables"},
                {"names": "a", "layout": "table"},
                {"names": [b"a"], "layout": "table"},
                {"names": ["a"], "layout": "table", 7: 1},
            ):
                mine, theirs = await both(immediate, usual, request(msg))
                assert mine == theirs, msg
            mine, theirs = await both(immediate, usual, request(msg, accept=wire.MSGPACK))
            assert mine == theirs

    asyncio.run(run())


def _big_pull() -> bytes:
    """A pull the app answers 200, with a body of ANSWER_BELOW bytes (a field it ignores)."""
    msg = {"names": NAMES, "layout": "table", "padding": b""}
    size = len(msgpack.packb(msg))
    msg["padding"] = b"x" * (ANSWER_BELOW - size - 1)  # bin 16: 1 more byte than bin 8
    body = msgpack.packb(msg)
    assert len(body) == ANSWER_BELOW
    return request(body=body)


CASES = {
    "unknown variable": lambda: request({"names": ["a", "nope"], "layout": "table"}),
    "bad name": lambda: request({"names": ["a", 7], "layout": "table"}),
    "bad versions": lambda: request({"names": NAMES, "layout": "table", "versions": [1, -1, 0]}),
    "bad packed": lambda: request(
        {"names": NAMES, "layout": "table", "uniform": True, "packed": "yes"}
    ),
    "not msgpack": lambda: request(body=b"\xc1garbage"),
    "not a map": lambda: request(body=msgpack.packb([1, 2])),
    "wrong content type": lambda: request(ctype="application/json"),
    "map layout": lambda: request({"names": NAMES}),
    "no framed accept": lambda: request(accept=wire.MSGPACK),
    "another shard's request": lambda: request(extra="x-paramshard-fleet: 1/2\r\n"),
    "malformed fleet header": lambda: request(extra="x-paramshard-fleet: zero\r\n"),
    "query string": lambda: request(path="/v1/pull?x=1"),
    "expects 100-continue": lambda: request(extra="expect: 100-continue\r\n"),
    "connection close": lambda: request(extra="connection: close\r\n"),
    "HTTP/1.0": lambda: request(version="1.0"),
    "HTTP/1.0 keep-alive": lambda: request(version="1.0", extra="connection: keep-alive\r\n"),
    "body of ANSWER_BELOW or more": _big_pull,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_request_not_taken_goes_to_the_app_and_gets_its_answer(case):
    """Each request the protocol does not answer itself reaches the app, which answers it
    (errors included) exactly as without immediate answers."""

    async def run() -> None:
        async with shard() as (app, immediate, usual):
            data = CASES[case]()
            assert await Connection(immediate).send(data) == await Connection(usual).send(data)
            assert immediate.calls == 1
            assert app.state.store.pull(["a"])["a"]["version"] == 0

    asyncio.run(run())


@pytest.mark.parametrize("phase", ["draining", "full", "queue"])
def test_a_pull_the_gate_would_hold_or_refuse_goes_to_the_app(phase, monkeypatch):
    monkeypatch.setattr(admission, "ADMIT_WAIT", 0.05)

    async def run() -> None:
        async with shard(ShardConfig(max_queued_requests=1)) as (app, immediate, _usual):
            gate = app.state.gate
            if phase == "draining":
                gate.set_phase("draining")
            else:
                gate.requests, gate.bytes = 1, 0  # a request in flight fills the shard
            if phase == "queue":  # room, but another waits in line before it (and stays)
                gate.max_requests = 2
                gate._waiters.append([0, asyncio.get_running_loop().create_future(), True])
            mine = await Connection(immediate).send(request())
            gate._waiters.clear()
            assert immediate.calls == 1
            status = mine.split(b" ", 2)[1]
            assert status == {"draining": b"503", "full": b"429", "queue": b"429"}[phase]

    asyncio.run(run())


@pytest.mark.parametrize("names", [NAMES, ["b"]])
def test_a_pull_of_a_variable_being_written_in_place_goes_to_the_app(names):
    async def run() -> None:
        async with shard() as (app, immediate, _usual):
            store = app.state.store
            var = store._vars["b"]
            var.in_place, var.writing = True, asyncio.get_running_loop().create_future()
            store._off_loop.in_place += 1  # as OffLoop.push marks a variable it writes
            store._off_loop.writing += 1
            assert not store.settled_now(["a", "b"]) and store.settled_now(["a", "c", 3])
            conn = Connection(immediate)
            pending = asyncio.ensure_future(conn.send(request({"names": names, "layout": "table"})))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not pending.done() and immediate.calls == 1  # the app waits for the writer
            var.writing.set_result(None)
            var.writing, var.in_place = None, False
            store._off_loop.in_place -= 1
            store._off_loop.writing -= 1
            assert (await pending).startswith(b"HTTP/1.1 200 OK\r\n")

    asyncio.run(run())


def test_an_answerer_that_fails_hands_the_request_to_the_app(caplog):
    async def run() -> None:
        async with shard() as (_app, immediate, usual):

            def broken(headers, body):
                raise RuntimeError("a bug")

            getattr(immediate, IMMEDIATE)[b"/v1/pull"] = broken
            with caplog.at_level(logging.ERROR, logger="paramshard.protocol"):
                mine, theirs = await both(immediate, usual, request())
            assert mine == theirs and immediate.calls == 1
            assert "answering b'/v1/pull' immediately failed" in caplog.text

    asyncio.run(run())


class Callbacks:
    """Counts the parser callbacks a protocol gets (its ``on_message_begin`` and
    ``on_header``): none for a request it reads without the parser."""

    def __init__(self, protocol) -> None:
        self.count = 0
        for name in ("on_message_begin", "on_header"):
            setattr(protocol, name, self._counted(getattr(protocol, name)))
        protocol.parser = new_parser(protocol)  # it binds the callbacks when made

    def _counted(self, callback):
        def counted(*args):
            self.count += 1
            return callback(*args)

        return counted


def test_a_whole_request_in_one_read_is_answered_without_the_parser():
    """A small request that comes whole in one read, with a head as the SDK writes it, is read
    without the HTTP parser (server.whole_heads); the same request over two reads, or with a
    head only the parser reads the same as every other (a capital in a name, more space
    around a value, a header twice), goes through the parser; the answers are the same."""
    sdk_like = request(extra="x-paramshard-fleet: 0/1\r\n")
    head, _, body = sdk_like.partition(b"\r\n\r\n")
    parser_only = [
        sdk_like.replace(b"accept:", b"Accept:"),
        sdk_like.replace(b"host: shard", b"host:  shard"),
        sdk_like.replace(b"host: shard", b"host:shard"),
        sdk_like.replace(b"host: shard", b"host: shard "),
        sdk_like.replace(b"host: shard\r\n", b"host: shard\r\nhost: shard\r\n"),
        sdk_like.replace(b"host: shard\r\n", b"host: shard\r\nx-empty:\r\n"),
    ]

    async def run() -> None:
        async with shard() as (_app, immediate, usual):
            conn = Connection(immediate)
            seen = Callbacks(conn.protocol)
            expected = await Connection(usual).send(sdk_like)
            for _ in range(3):  # a new connection's first request, then between requests
                assert await conn.send(sdk_like) == expected
            assert seen.count == 0 and immediate.calls == 0
            conn.feed(head)
            assert await conn.send(b"\r\n\r\n" + body) == expected
            assert seen.count > 0 and immediate.calls == 0
            for data in parser_only:
                seen.count = 0
                assert await conn.send(data) == expected, data
                assert seen.count > 0 and immediate.calls == 0, data
            assert not conn.transport.closed

    asyncio.run(run())


def test_a_request_the_answerer_declines_is_offered_to_it_once():
    async def run() -> None:
        async with shard() as (_app, immediate, usual):
            answerers = getattr(immediate, IMMEDIATE)
            pull, offered = answerers[b"/v1/pull"], []

            def counting(headers, body):
                offered.append(body)
                return pull(headers, body)

            answerers[b"/v1/pull"] = counting
            declined = request({"names": NAMES})  # the map layout: the app answers it
            mine, theirs = await both(immediate, usual, declined)
            assert mine == theirs and immediate.calls == 1 and len(offered) == 1

    asyncio.run(run())


def test_the_shard_headers_of_an_immediate_answer_follow_the_store():
    """Each reply answered in the protocol carries the state version and deletions count of
    the moment, as the app's do: the headers the shard kept from the last reply are not
    reused once either moved."""

    def shard_headers(sent: bytes) -> dict[str, str]:
        head = sent.partition(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
        return {k: v for k, _, v in (line.partition(": ") for line in head)}

    async def run() -> None:
        async with shard() as (app, immediate, usual):
            conn, plain = Connection(immediate), Connection(usual)
            store = app.state.store
            pull = request({"names": ["a", "b"], "layout": "table"})
            seen = []
            for step in range(3):
                mine, theirs = await conn.send(pull), await plain.send(pull)
                assert mine == theirs and immediate.calls == 0
                seen.append(shard_headers(mine))
                if step == 0:
                    store.push("w", 1, {"a": np.ones(3, np.float32)})
                elif step == 1:
                    await store.delete("w", 2, names=["c"])
            versions = [int(h["x-paramshard-state-version"]) for h in seen]
            assert versions[1] == versions[0] + 1 and versions[2] == store.state_version
            assert "x-paramshard-deletions" not in seen[0]
            assert "x-paramshard-deletions" not in seen[1]
            assert seen[2]["x-paramshard-deletions"] == "1"

    asyncio.run(run())


def _assign(seq: int, *names: str) -> bytes:
    """An assign of ones to ``names`` (3 float32 each): a write the app answers."""
    values = {n: np.ones(3, np.float32) for n in names}
    enc = wire.encode({"values": values, "worker_id": "w", "seq": seq})
    return request(path="/v1/assign", body=enc.join(), ctype=enc.content_type)


def test_immediate_answers_keep_the_connection_and_the_order_of_replies():
    """On one connection: pulls answered at once, an assign through the app in between, and
    pipelined requests answered in the order they came (a pull behind an assign in flight
    waits for it, as uvicorn queues pipelined requests)."""

    async def run() -> None:
        async with shard() as (_app, immediate, _usual):
            conn = Connection(immediate)
            pull = request({"names": NAMES, "layout": "table"})
            assert _table(await conn.send(pull))[0]["table"]["versions"] == [0, 0, 0]
            assert conn.protocol.timeout_keep_alive_task is not None  # armed, as uvicorn does
            assert b" 200 " in (await conn.send(_assign(1, "a", "b")))[:16]
            assert _table(await conn.send(pull))[0]["table"]["versions"] == [1, 1, 0]
            calls = immediate.calls
            both_ways = await conn.send(_assign(2, "a", "b") + pull + pull, replies=3)
            assert immediate.calls == calls + 3  # the assign, and the pulls queued behind it
            first, _, rest = both_ways.partition(b"\r\n\r\n")
            assert first.startswith(b"HTTP/1.1 200") and b"x-paramshard" in first
            replies = rest.split(b"HTTP/1.1 200 OK\r\n")[1:]
            assert len(replies) == 2
            for reply in replies:
                assert _table(b"HTTP/1.1 200 OK\r\n" + reply)[0]["table"]["versions"] == [2, 2, 0]
            assert not conn.transport.closed

    asyncio.run(run())


def test_a_run_of_immediate_answers_keeps_one_keep_alive_timer():
    """Answers written by the protocol move one keep-alive timer on rather than cancelling it
    and arming another per request; a reply from the app in between arms uvicorn's own, which
    the next immediate answer replaces; the timer closes the connection only once it has been
    idle for the keep-alive timeout since the last answer."""

    async def run() -> None:
        async with shard() as (_app, immediate, _usual):
            conn = Connection(immediate)
            protocol = conn.protocol
            pull = request({"names": NAMES, "layout": "table"})
            await conn.send(pull)
            first = protocol.timeout_keep_alive_task
            assert first is not None and not first.cancelled()
            await conn.send(pull)
            await conn.send(pull)
            assert protocol.timeout_keep_alive_task is first and not first.cancelled()
            assert b" 200 " in (await conn.send(_assign(1, "a")))[:16]
            assert first.cancelled()  # the assign's head cancelled it, as uvicorn does
            apps = protocol.timeout_keep_alive_task
            assert apps is not None and apps is not first  # uvicorn's, after the app's reply
            assert _table(await conn.send(pull))[0]["table"]["versions"] == [1, 0, 0]
            again = protocol.timeout_keep_alive_task
            assert apps.cancelled() and again is not apps and not again.cancelled()

            # The timer firing: a connection idle for less than the timeout stays open and
            # the timer is armed for the rest; one idle for the timeout is closed.
            again.cancel()  # fired by hand below, not by the clock
            protocol._idle_timer_due()
            rest = protocol.timeout_keep_alive_task
            assert rest is not None and rest is not again and not conn.transport.closed
            rest.cancel()
            protocol._idle_since -= protocol.timeout_keep_alive + 1.0
            protocol._idle_timer_due()
            assert conn.transport.closed and protocol.timeout_keep_alive_task is None

    asyncio.run(run())


def test_a_pull_while_writing_is_paused_goes_to_the_app():
    async def run() -> None:
        async with shard() as (_app, immediate, _usual):
            conn = Connection(immediate)
            conn.protocol.pause_writing()
            pending = asyncio.ensure_future(conn.send(request()))
            for _ in range(20):
                await asyncio.sleep(0)
            assert immediate.calls == 1 and not pending.done()  # the app waits to write
            conn.protocol.resume_writing()
            _table(await pending)

    asyncio.run(run())


def test_with_an_access_log_every_request_goes_to_the_app():
    """`--access-log` logs every request: none is answered past the app (and its log line)."""

    async def run() -> None:
        async with shard() as (_app, immediate, _usual):
            conn = Connection(immediate, access_log=True)
            _table(await conn.send(request()))
            assert immediate.calls == 1

    asyncio.run(run())


def rows_request(msg: dict, *, framed: bool = False, accept: str = wire.FRAME) -> bytes:
    """A pull_rows request: ``msg`` (its ndarrays as tensors) msgpack or framed."""
    enc = wire.encode(msg, frame=framed)
    return request(path="/v1/pull_rows", body=enc.join(), ctype=enc.content_type, accept=accept)


def test_a_small_pull_rows_is_answered_at_once_with_the_apps_bytes():
    ids = np.array([5, 9, 5, -7, 1 << 62], np.int64)  # stored, not stored, repeated

    async def run() -> None:
        async with shard() as (app, immediate, usual):
            table = app.state.tables.get("t")
            for framed in (False, True):
                for accept in (wire.FRAME, wire.MSGPACK):
                    data = rows_request({"name": "t", "ids": ids}, framed=framed, accept=accept)
                    mine, theirs = await both(immediate, usual, data)
                    assert mine == theirs
                    assert immediate.calls == 0 and usual.calls > 0
                    head, _, body = mine.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
                    kind = wire.FRAME if wire.FRAME.encode() in head else wire.MSGPACK
                    msg = wire.unpack(body, kind)
                    rows = wire.decode_tensor(msg["rows"], body if kind == wire.FRAME else None)
                    np.testing.assert_array_equal(rows, table.gather(ids))
                    assert msg["version"] == 1
            assert len(table) == 2  # a pull stores nothing

    asyncio.run(run())


ROWS_CASES = {
    "unknown table": {"name": "nope", "ids": np.array([1], np.int64)},
    "a dense variable's name": {"name": "a", "ids": np.array([1], np.int64)},
    "no ids": {"name": "t"},
    "float ids": {"name": "t", "ids": np.array([1.0])},
    "2-d ids": {"name": "t", "ids": np.zeros((2, 2), np.int64)},
    "a name that is not a string": {"name": 7, "ids": np.array([1], np.int64)},
    "wire_dtype": {"name": "t", "ids": np.array([5], np.int64), "wire_dtype": "float16"},
}


@pytest.mark.parametrize("case", sorted(ROWS_CASES))
def test_a_pull_rows_not_taken_goes_to_the_app_and_gets_its_answer(case):
    async def run() -> None:
        async with shard() as (_app, immediate, usual):
            data = rows_request(ROWS_CASES[case])
            assert await Connection(immediate).send(data) == await Connection(usual).send(data)
            assert immediate.calls == 1

    asyncio.run(run())


def _increment(msg: dict) -> bytes:
    return request(msg, path="/v1/increment", accept=f"{wire.FRAME}, {wire.MSGPACK}")


#: Increments in order: fresh counters, a keyed one and its retry, a float counter, a kind
#: taken as stated; then ones the app must answer (errors), which change nothing.
INCREMENTS = [
    {"name": "n"},
    {"name": "n", "delta": 2, "worker_id": "w", "seq": 5},
    {"name": "n", "delta": 2, "worker_id": "w", "seq": 5},
    {"name": "f", "delta": 0.5},
    {"name": "n", "kind": "int", "delta": 3.0},
]
REFUSED_INCREMENTS = [
    {"name": "a"},  # a float32 vector, not a counter
    {"name": "n", "kind": "float"},  # an int counter
    {"name": "n", "delta": "1"},
    {"name": "nope/" + "x" * 300},
    {"name": "n", "worker_id": "w"},  # worker_id without seq
]


def test_an_increment_is_answered_at_once_with_the_apps_bytes():
    """Two shards from the same state, one answering increments in the protocol and one
    through the app: the same bytes (but each one's incarnation) for every increment, in
    order; refused ones go to the app, and change nothing."""

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            for msg in INCREMENTS + REFUSED_INCREMENTS:
                data = _increment(msg)
                mine = await Connection(immediate).send(data)
                theirs = await Connection(usual).send(data)
                assert mine.replace(incarnations[0], b"") == theirs.replace(incarnations[1], b"")
                taken = msg in INCREMENTS
                assert mine.startswith(b"HTTP/1.1 200 " if taken else b"HTTP/1.1 4"), msg
                assert immediate.calls == (0 if taken else REFUSED_INCREMENTS.index(msg) + 1)
            for app in (one, other):
                got = app.state.store.pull(["n", "f", "a"])
                assert got["n"]["value"] == 6 and got["f"]["value"] == 0.5
                assert got["a"]["version"] == 0

    asyncio.run(run())


@pytest.mark.parametrize("why", ["paused", "held", "cannot persist", "draining", "read token"])
def test_an_increment_the_gate_or_a_token_would_stop_goes_to_the_app(why, monkeypatch):
    monkeypatch.setattr(admission, "PAUSE_WAIT", 0.05)
    token = "t" * 24

    async def run() -> None:
        config = (
            ShardConfig(token=(token,), read_token=("r" * 24,)) if why == "read token" else None
        )
        async with shard(config) as (app, immediate, _usual):
            gate = app.state.gate
            extra = ""
            if why == "paused":
                gate.paused_for = "ckpt"
            elif why == "held":
                gate._hold()
            elif why == "cannot persist":
                gate.cannot_persist("disk full")
            elif why == "draining":
                gate.set_phase("draining")
            else:
                extra = f"authorization: Bearer {'r' * 24}\r\n"
            conn = Connection(immediate)
            pending = asyncio.ensure_future(
                conn.send(request({"name": "n"}, path="/v1/increment", extra=extra))
            )
            for _ in range(20):
                await asyncio.sleep(0)
            assert immediate.calls == 1
            if why == "held":
                assert not pending.done()  # the app waits until the gate opens
                gate._unhold()
            mine = await pending
            status = {"held": b"200", "read token": b"403"}.get(why, b"503")
            assert mine.split(b" ", 2)[1] == status, mine[:200]

    asyncio.run(run())


def _push(msg: dict, layout: str, grads: dict) -> bytes:
    """A push as the SDK sends it: a tensor table (framed), or a map of tensors, framed or
    plain msgpack."""
    if layout == "table":
        table = {"names": list(grads)}
        enc = wire.encode_table(
            {**msg, "layout": "table", "grads": table}, table, list(grads.values())
        )
    else:
        enc = wire.encode({**msg, "grads": grads}, frame=layout == "framed")
    return request(path="/v1/push", body=enc.join(), ctype=enc.content_type, accept=wire.FRAME)


A3 = np.ones(3, np.float32)
#: Pushes in order, each (message, layout, grads): applied ones, a retry, stale versions;
#: then ones the app must answer (errors), which change nothing.
PUSHES = [
    ({"worker_id": "w", "seq": 1}, "table", {"a": A3, "b": A3}),
    ({"worker_id": "w", "seq": 2}, "framed", {"a": A3}),
    ({"worker_id": "w", "seq": 3}, "msgpack", {"b": 2 * A3}),
    ({"worker_id": "w", "seq": 3}, "msgpack", {"b": 2 * A3}),  # a retry: duplicate
    ({"worker_id": "v", "seq": 1, "versions": {"a": 0}}, "table", {"a": A3}),
]
REFUSED_PUSHES = [
    ({"worker_id": "w", "seq": 9}, "table", {"a": A3, "nope": A3}),  # unknown variable
    ({"worker_id": "w", "seq": 9}, "framed", {"a": np.ones(4, np.float32)}),  # wrong shape
    ({"worker_id": "w", "seq": 9}, "table", {"a": np.array([1, np.nan, 0], np.float32)}),
    ({"worker_id": "w"}, "table", {"a": A3}),  # no seq
    ({"worker_id": "w", "seq": 9, "versions": {"a": -1}}, "msgpack", {"a": A3}),
]


def test_a_push_is_answered_at_once_with_the_apps_bytes():
    """Two shards from the same state, one answering pushes in the protocol and one through
    the app: the same bytes (but each one's incarnation) for every push, in order, in every
    layout the SDK sends; refused ones go to the app, and change nothing."""

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            for k, (msg, layout, grads) in enumerate(PUSHES + REFUSED_PUSHES):
                data = _push(msg, layout, grads)
                mine = await Connection(immediate).send(data)
                theirs = await Connection(usual).send(data)
                assert mine.replace(incarnations[0], b"") == theirs.replace(incarnations[1], b"")
                taken = k < len(PUSHES)
                assert mine.startswith(b"HTTP/1.1 200 " if taken else b"HTTP/1.1 4"), k
                assert immediate.calls == (0 if taken else k - len(PUSHES) + 1)
            for app in (one, other):
                got = app.state.store.pull(["a", "b"])
                assert got["a"]["version"] == 3 and got["b"]["version"] == 2
                assert got["a"]["value"].tolist() == [3.0, 4.0, 5.0]
                assert got["b"]["value"].tolist() == [4.0, 4.0, 4.0]

    asyncio.run(run())


def test_a_push_to_a_name_written_off_the_loop_goes_to_the_app():
    async def run() -> None:
        async with shard() as (app, immediate, _usual):
            var = app.state.store._vars["a"]
            var.writing = asyncio.get_running_loop().create_future()
            app.state.store._off_loop.writing += 1  # as OffLoop.push marks a variable it writes
            conn = Connection(immediate)
            pending = asyncio.ensure_future(
                conn.send(_push({"worker_id": "w", "seq": 1}, "table", {"a": A3}))
            )
            for _ in range(20):
                await asyncio.sleep(0)
            assert not pending.done() and immediate.calls == 1  # the app waits for the writer
            var.writing.set_result(None)
            var.writing = None
            app.state.store._off_loop.writing -= 1
            assert (await pending).startswith(b"HTTP/1.1 200 ")

    asyncio.run(run())


def _push_rows(msg: dict, framed: bool) -> bytes:
    enc = wire.encode(msg, frame=framed)
    return request(path="/v1/push_rows", body=enc.join(), ctype=enc.content_type)


G4 = np.ones((2, 4), np.float32)
#: push_rows in order, each (message, framed): new and stored rows, repeats, a retry; then ones
#: the app must answer (errors), which change nothing.
ROW_PUSHES = [
    (
        {"name": "t", "ids": np.array([5, 9], np.int64), "grads": G4, "worker_id": "w", "seq": 1},
        True,
    ),
    (
        {"name": "t", "ids": np.array([9, 9], np.int64), "grads": G4, "worker_id": "w", "seq": 2},
        False,
    ),
    (
        {"name": "t", "ids": np.array([9, 9], np.int64), "grads": G4, "worker_id": "w", "seq": 2},
        True,
    ),
]
REFUSED_ROW_PUSHES = [
    (
        {
            "name": "nope",
            "ids": np.array([1, 2], np.int64),
            "grads": G4,
            "worker_id": "w",
            "seq": 7,
        },
        True,
    ),
    (
        {"name": "a", "ids": np.array([1, 2], np.int64), "grads": G4, "worker_id": "w", "seq": 7},
        True,
    ),
    ({"name": "t", "ids": np.array([1], np.int64), "grads": G4, "worker_id": "w", "seq": 7}, False),
    (
        {
            "name": "t",
            "ids": np.array([1, 2], np.int64),
            "grads": G4 * np.nan,
            "worker_id": "w",
            "seq": 7,
        },
        True,
    ),
    ({"name": "t", "ids": np.array([1.0, 2.0]), "grads": G4, "worker_id": "w", "seq": 7}, True),
    ({"name": "t", "ids": np.array([1, 2], np.int64), "grads": G4, "worker_id": "w"}, True),
]


def test_a_push_rows_is_answered_at_once_with_the_apps_bytes():
    """Two shards from the same state, one answering push_rows in the protocol and one through
    the app: the same bytes (but each one's incarnation) for every push, in order, msgpack and
    framed; refused ones go to the app, and change nothing."""

    async def run() -> None:
        async with shard() as (one, immediate, _), shard() as (other, _, usual):
            incarnations = (one.state.incarnation.encode(), other.state.incarnation.encode())
            for k, (msg, framed) in enumerate(ROW_PUSHES + REFUSED_ROW_PUSHES):
                data = _push_rows(msg, framed)
                mine = await Connection(immediate).send(data)
                theirs = await Connection(usual).send(data)
                assert mine.replace(incarnations[0], b"") == theirs.replace(incarnations[1], b"")
                taken = k < len(ROW_PUSHES)
                assert mine.startswith(b"HTTP/1.1 200 " if taken else b"HTTP/1.1 4"), k
                assert immediate.calls == (0 if taken else k - len(ROW_PUSHES) + 1)
            ids = np.array([5, 9], np.int64)
            start = initial_rows(TableSpec(dim=4, optimizer=SGD(lr=1.0), seed=3), "t", ids)
            for app in (one, other):
                table = app.state.tables.get("t")
                assert table.version == 3 and len(table) == 3  # rows 5, -7 and 9
                np.testing.assert_allclose(
                    table.gather(ids) - start, [[-2.0] * 4, [-3.0] * 4], atol=1e-6
                )

    asyncio.run(run())
