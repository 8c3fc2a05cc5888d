"""Requests the shard's HTTP protocol answers itself, before any ASGI request cycle.

:func:`immediate_routes` is the table the protocol reads (:data:`server.httptools_protocol.
IMMEDIATE`: raw path -> answerer; :func:`server.app.serving_app` sets it), and the ``*_now``
functions are the answerers' verbs: :func:`pull_now` (``POST /v1/pull`` in the table layout),
:func:`pull_rows_now` (``/v1/pull_rows`` of float32 rows), :func:`push_now`,
:func:`increment_now`, :func:`push_rows_now`, and a step group's :func:`group_pull_now` and
:func:`group_push_now`; the commonest pull, of one name, has a one-pass answerer of its own,
:func:`pull_quick`, tried before :func:`pull_now`. The protocol offers a request to its path's
answerer when it is small (``Content-Length`` below
:data:`~server.httptools_protocol.ANSWER_BELOW`) and came whole in one read, or, for
``push``, ``push_rows`` and ``group_push``, once its body is whole when it is below
:data:`COLLECT_PUSH_BELOW` / :data:`COLLECT_ROWS_BELOW` / :data:`COLLECT_GROUP_BELOW` (a
gradient of a few hundred KB, a batch of a few thousand rows, or a step group's gradients,
takes several reads; the protocol collects it, holding its room in
the gate meanwhile (:meth:`~server.admission.Gate.hold_now`; without room now it goes the usual
way), into one buffer of the body's size); it is answered here only when all of these
hold:

* it passes the fleet check as the SDK sends it, and carries a token that may read (a pull) or
  write (the others) when the shard has tokens;
* the gate would admit it at once, and, for a write, the shard takes writes with no wait and no
  refusal to give, and has no replicas (:func:`_writes_at_once`: a replica's write waits for its
  backups, through :class:`~server.app.ShardMiddleware`); for a read on a replica of a group,
  the replica answers reads now (:func:`~server.replication.reads.read_refusal` finds no
  refusal: a primary, or a backup asked with ``x-paramshard-allow-backup``);
* its body is one the SDK sends (content type, size within ``--max-request-bytes``, a msgpack
  map) and its verb can answer it with no error, no ``await`` and nothing off the loop (no push
  writing one of its variables in a worker thread).

The reply is the one the usual way gives, byte for byte: the verbs' own argument checks and
store calls (:mod:`server.routes_data`, :mod:`server.routes_tables`), the shard's headers from
:class:`~server.app.ShardMiddleware`. Anything else, every refusal and error included, returns
``None`` and goes the usual way, which answers it: nothing has changed before that (the store
checks a write whole before it changes anything). Everything here is synchronous, on the event
loop, inside the protocol's parser callback.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
from fastapi import FastAPI

from client_sdk import wire
from client_sdk.wire.constants import COUNT_FROM

from .admission import Gate
from .app import ShardMiddleware
from .auth import READ, WRITE, Guard
from .embedding import EmbeddingTables
from .errors import ShardError
from .httptools_protocol import (
    COLLECT_BELOW_ATTR,
    COLLECT_HELD_ATTR,
    COLLECT_RELEASE_ATTR,
    COLLECT_ROOM_ATTR,
    Answerer,
    Immediate,
)
from .metrics import Traffic
from .replication.reads import ALLOW_BACKUP, read_refusal
from .routes_data import MAX_VERSION, increment_args, pull_args, pull_table, push_args, writer
from .routes_groups import group_pull_reply, group_push_args, group_push_reply
from .routes_tables import table_name, whole_tensors
from .store import ParameterStore

__all__ = [
    "COLLECT_PUSH_BELOW",
    "COLLECT_ROWS_BELOW",
    "group_pull_now",
    "group_push_now",
    "immediate_routes",
    "increment_now",
    "pull_now",
    "pull_quick",
    "pull_rows_now",
    "push_now",
    "push_rows_now",
]

_FLEET_KEY = wire.HEADER_FLEET.encode()
_MSGPACK, _FRAME = wire.MSGPACK.encode(), wire.FRAME.encode()
#: Content type (as sent) -> the body's encoding, for the verbs that take either.
_EITHER = {_MSGPACK: wire.MSGPACK, _FRAME: wire.FRAME}
_MSGPACK_ONLY = {_MSGPACK: wire.MSGPACK}

#: A push_rows body below this many bytes is answered here even when it comes over several
#: reads (it is applied on the event loop either way): 1 MiB, about 3,900 rows of 64 float32.
COLLECT_ROWS_BELOW = 1 << 20

#: A push body below this many bytes is answered here even when it comes over several reads
#: (below :data:`~server.store.apply.OFFLOAD_BYTES` it is applied on the event loop either
#: way): 1 MiB, a float32 gradient of 262,144 elements.
COLLECT_PUSH_BELOW = 1 << 20

#: A group_push body below this many bytes is answered here even when it comes over several
#: reads (below :data:`~server.store.apply.OFFLOAD_BYTES` it is applied on the event loop
#: either way): 1 MiB, a step group of 256 float32 variables of 1,000 elements.
COLLECT_GROUP_BELOW = 1 << 20

#: ``now(target, headers, msg, body)``: a verb's reply to a request whose message is ``msg``
#: (``body``: its framed body, which the message's tensors point into, or ``None`` for a msgpack
#: one), or ``None`` where the usual way must answer it; may raise ``ShardError`` or
#: ``wire.WireError`` (also the usual way's to answer).
Now = Callable[[Any, Mapping[bytes, bytes], dict[str, Any], Any], wire.Encoded | None]


#: ``quick(target, max_names, headers, body)``: a verb's commonest request answered in one
#: pass, the same reply :data:`Now` gives it, or ``None`` for :data:`Now` to take the request
#: (anything else, every refusal included); never raises.
Quick = Callable[[Any, int, Mapping[bytes, bytes], Any], wire.Encoded | None]


def pull_now(
    store: ParameterStore, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """A pull in the table layout (the client accepts a framed reply): what
    :func:`server.routes_data.pull` answers, its arrays as the reply's own pieces; ``None`` for
    another layout, a ``wire_dtype``, or a push writing one of the variables in place."""
    if _FRAME not in headers.get(b"accept", b"").lower():
        return None
    names, versions, table, layout = pull_args(msg, True)
    if not table or "wire_dtype" in msg or not store.settled_now(names):
        return None
    return pull_table(store, names, versions, layout, True)


#: The fields of the pull :func:`pull_quick` answers; a message with any other goes the usual way.
_QUICK_PULL_FIELDS = frozenset(("names", "layout", "uniform", "packed", "versions"))


def pull_quick(
    store: ParameterStore, max_names: int, headers: Mapping[bytes, bytes], body: Any
) -> wire.Encoded | None:
    """The commonest pull, answered in one pass: one name of ours, in the table layout, to a
    client that accepts a framed reply. The same bytes as :func:`pull_now` (the same decoding
    limits, the same field checks, the row :meth:`~server.store.ParameterStore.pull_rows`
    reads, :func:`~client_sdk.wire.encode_row`), with none of its general steps; ``None`` for
    anything else, which :func:`pull_now` then answers or refuses. It never raises."""
    if _FRAME not in headers.get(b"accept", b"").lower() or len(body) > COUNT_FROM:
        return None
    try:  # wire.unpack's decoding of a small body, without the calls around it
        msg = msgpack.unpackb(
            body, raw=False, strict_map_key=False, max_array_len=max_names, max_map_len=max_names
        )
    except Exception:  # msgpack raises several unrelated types; pull_now says which
        return None
    if (
        type(msg) is not dict
        or msg.get("layout") != "table"
        or not msg.keys() <= _QUICK_PULL_FIELDS
    ):
        return None
    names, held = msg.get("names"), msg.get("versions")
    uniform, packed = msg.get("uniform"), msg.get("packed")
    if (
        type(names) is not list
        or len(names) != 1
        or type(names[0]) is not str
        or (uniform is not None and type(uniform) is not bool)
        or (packed is not None and type(packed) is not bool)
    ):
        return None
    if held is not None:
        if type(held) is not list or len(held) != 1:
            return None
        held = held[0]
        if held is not None and (type(held) is not int or not 0 <= held <= MAX_VERSION):
            return None
    row = store.pull_row_now(names[0], held)
    if row is None:
        return None
    version, value, meta = row
    table: dict[str, Any] = {"versions": [version]}
    dtype, shape = meta if meta is not None else (None, None)
    # One row is never uniform, so "uniform" and "packed" change nothing in the reply.
    return wire.encode_row({"table": table}, table, value, dtype, shape)


def pull_rows_now(
    tables: EmbeddingTables, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """A pull_rows: what :func:`server.routes_tables.pull_rows` answers, its rows as the
    reply's own piece; ``None`` with a ``wire_dtype``."""
    if "wire_dtype" in msg:
        return None
    name = table_name(msg, "pull_rows")
    table, rows = tables.pull(name, whole_tensors(msg, ("ids",), "pull_rows", body)["ids"])
    frame = _FRAME in headers.get(b"accept", b"").lower()
    return wire.encode({"rows": rows, "version": table.version}, frame=None if frame else False)


def push_now(
    store: ParameterStore, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """A push: what :func:`server.routes_data.push` answers (a body this small is applied on
    the loop, as :meth:`~server.store.ParameterStore.push_async` would); ``None`` while a push
    computing off the loop holds one of its names."""
    kind = wire.FRAME if body is not None else wire.MSGPACK
    worker_id, seq, grads, versions, finite, block = push_args(msg, kind, body, {})
    if store.settling(grads):
        return None
    result = store.push(worker_id, seq, grads, versions, finite=finite, block=block)
    return wire.encode({"variables": result}, tensors=False)


def increment_now(
    store: ParameterStore, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """An increment: what :func:`server.routes_data.increment` answers; ``None`` while a push
    writes that name off the loop."""
    name, delta, worker_id, seq, kind = increment_args(msg)
    if store.settling([name]):
        return None
    return wire.encode(store.increment(name, delta, worker_id, seq, kind), tensors=False)


def push_rows_now(
    tables: EmbeddingTables, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """A push_rows: what :func:`server.routes_tables.push_rows` answers."""
    worker_id, seq = writer(msg, "push_rows", required=True)
    name = table_name(msg, "push_rows")
    tensors = whole_tensors(msg, ("ids", "grads"), "push_rows", body)
    result = tables.push(name, worker_id, seq, tensors["ids"], tensors["grads"])
    return wire.encode(result, tensors=False)


def group_pull_now(
    store: ParameterStore, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """A step group's pull: what :func:`server.routes_groups.group_pull` answers, its values
    as the reply's own pieces; ``None`` while a push writes one of them in place off the
    loop."""
    gid = msg.get("group")
    group = store.groups.get(store, gid)
    if not store.settled_now(group.names):
        return None
    return group_pull_reply(store, group, True)


def group_push_now(
    store: ParameterStore, headers: Mapping[bytes, bytes], msg: dict[str, Any], body: Any
) -> wire.Encoded | None:
    """A step group's push: what :func:`server.routes_groups.group_push` answers (applied on
    the loop, as :meth:`~server.store.ParameterStore.push_async` would a body this small);
    ``None`` while a push computing off the loop holds one of its variables."""
    worker_id, seq, group, grads, versions, finite, block = group_push_args(store, msg, body)
    if store.settling(grads):
        return None
    result = store.push(worker_id, seq, grads, versions, finite=finite, block=block, group=group)
    return group_push_reply(group, result)


def immediate_routes(app: FastAPI) -> dict[bytes, Answerer]:
    """The answerers of ``app``'s shard (made by :func:`server.app.create_app`), by raw path:
    each checks what the module docstring lists, decodes the body, and calls its ``*_now``
    verb; the traffic metrics count what it answers."""
    state = app.state
    store, tables, gate = state.store, state.tables, state.gate
    limit, max_names = state.config.max_request_bytes, state.config.max_request_names
    shard = ShardMiddleware(app, state.config, state.incarnation, state)
    guard: Guard = state.auth
    traffic: Traffic | None = getattr(state, "traffic", None)
    replication = shard.replication  # as the shard's middleware reads it: once

    def answerer(
        verb: str,
        now: Now,
        target: Any,
        kinds: Mapping[bytes, str],
        access: str = READ,
        collect_below: int = 0,
        quick: Quick | None = None,
    ) -> Answerer:
        writes = access == WRITE

        def answer(
            headers: Mapping[bytes, bytes], body: bytes | memoryview, held: bool = False
        ) -> Immediate | None:
            if (
                not shard.meant_for_me(headers.get(_FLEET_KEY))
                or not guard.allows(headers, access)
                or not (held or gate.room_now(len(body)))
                or (writes and (replication is not None or not _writes_at_once(gate)))
                or (
                    not writes
                    and replication is not None
                    and read_refusal(replication, state, headers.get(ALLOW_BACKUP)) is not None
                )
            ):
                return None
            kind = kinds.get(headers.get(b"content-type", b""))
            if kind is None or len(body) > limit:
                return None
            since = time.perf_counter()
            encoded = quick(target, max_names, headers, body) if quick is not None else None
            if encoded is None:
                try:
                    msg = wire.unpack(body, kind, max_names)
                    if not isinstance(msg, dict):
                        return None
                    encoded = now(target, headers, msg, body if kind == wire.FRAME else None)
                except (ShardError, wire.WireError):
                    return None
                if encoded is None:
                    return None
            if traffic is not None:
                traffic.count(verb, 200, time.perf_counter() - since, len(body), encoded.nbytes)
            return Immediate(
                [
                    (b"content-type", encoded.content_type.encode("latin-1")),
                    (b"content-length", str(encoded.nbytes).encode("latin-1")),
                    *shard.reply_headers(),
                ],
                encoded.chunks,
                encoded.nbytes,
            )

        if collect_below:
            setattr(answer, COLLECT_BELOW_ATTR, collect_below)
            setattr(answer, COLLECT_ROOM_ATTR, gate.hold_now)
            setattr(answer, COLLECT_RELEASE_ATTR, gate.release)
            setattr(answer, COLLECT_HELD_ATTR, functools.partial(answer, held=True))
        return answer

    return {
        b"/v1/pull": answerer("pull", pull_now, store, _MSGPACK_ONLY, quick=pull_quick),
        b"/v1/pull_rows": answerer("pull_rows", pull_rows_now, tables, _EITHER),
        b"/v1/push": answerer("push", push_now, store, _EITHER, WRITE, COLLECT_PUSH_BELOW),
        b"/v1/increment": answerer("increment", increment_now, store, _MSGPACK_ONLY, WRITE),
        b"/v1/push_rows": answerer(
            "push_rows", push_rows_now, tables, _EITHER, WRITE, COLLECT_ROWS_BELOW
        ),
        b"/v1/group_pull": answerer("group_pull", group_pull_now, store, _MSGPACK_ONLY),
        b"/v1/group_push": answerer(
            "group_push", group_push_now, store, {_FRAME: wire.FRAME}, WRITE, COLLECT_GROUP_BELOW
        ),
    }


def _writes_at_once(gate: Gate) -> bool:
    """Whether a write may be applied and acknowledged right now, with no wait and no refusal
    to give: what :class:`~server.admission.AdmissionMiddleware` would let straight through
    (the shard is ready, takes writes, no fleet checkpoint pauses or holds them). (A replica's
    writes wait for its backups, or are refused: the usual way, through
    :class:`~server.app.ShardMiddleware`; the caller checks for replicas.)"""
    return gate.write_refusal() is None and gate.paused_for is None and not gate.closed
