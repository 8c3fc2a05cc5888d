"""The direct path: a :class:`~client_sdk.StepGroup`'s pull and push when the whole group lives
on one shard, and :meth:`PSClient.pull <client_sdk.PSClient.pull>` of names that all live on
one shard, sent and received from the calling thread without the general machinery.

A step's call to one shard needs none of what lets a call reach many (the flow's batches, the
fan-out, a thread per retry, the stall watch) but paid for all of it in Python on every step.
:class:`GroupRoute` sends such a call straight through the blocking pool's connection
(``_http/direct.py``): a group pull's request (head and body) is built once per group id and
written as one buffer, its reply's values received straight into the group's flat buffer (or
``out``); a push builds its body (new ``seq``, the versions last pulled) and a head differing
only by its length, and writes the gradients' own memory after them.

It is taken only where it keeps every rule of the general path without doing anything of its
own: a :class:`~client_sdk.PSClient` with its native connections (no injected transport), a
group on one shard, that shard's URL ``http://`` (TLS: general path), its index one replica (a
replica group's exchanges are watched for stalls and follow failovers: ``_stalls.py``,
``_following.py``; general path) and the group registered. A reply is accepted as any is
(:meth:`Core.accept <client_sdk._core.Core.accept>`: the shard's identity, its incarnation,
the error a status means). Anything but a ``200`` reply -- a transport failure, a timeout,
429/503, 404 ``unknown_group``, any refusal -- is handed to the general path as the outcome
of its first attempt (:func:`client_sdk._transport.settle`), and the verb's flow goes on from
there (``PSClient._drive(first=...)``): the same retries and backoff under the same deadlines,
the push under the same ``seq``, the group registered again, the same errors.

:class:`PullRoute` does the same for a plain pull (no ``newer_than``, ``min_version``,
``out``, ``allow_backup``, nor ``wire_dtype``) of a list of names on one such shard, none of
them partitioned, every shard checked against the list (as every verb makes sure first) and
that one taking tensor tables: its request's head and the body's fixed part are built once
per list of names, and each call adds only the versions the cache holds (``_cache.py``; read
and stored as the general pull does, ``_verbs/pull.py``, whose
:func:`~client_sdk._verbs.pull.take` decodes the reply). A reply whose headers are those of
the last reply the route accepted is not checked and noted again: they name the same shard,
incarnation, state version and deletions. A reply with rows the cache cannot stand for (the
shard restarted) sends the call down the general path from its start, as does every other
outcome but a ``200`` from its first attempt on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from . import _replies, wire
from ._core import REPLY_HEADROOM
from ._exceptions import PSError
from ._flow import Reply, ShardRequest, request_headers
from ._http.direct import exchange
from ._http.http11 import Buffer, request_head
from ._http.native import NativeSender
from ._pusher import closed_error
from ._transport import _TRANSPORT_ERRORS, settle
from ._verbs import group as _group
from ._verbs import partitioned as _partitioned
from ._verbs.pull import plan, reply_bound, take
from .wire import FRAME
from .wire import groups as group_wire
from .wire.constants import FRAME_MAGIC, FRAME_PREFIX
from .wire.messages import align
from .wire.tensors import PARSED_NATIVE

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ["GroupRoute", "PullRoute", "direct_pull"]

#: Lists of names whose pull routes a client keeps (all dropped when full).
MAX_PULL_ROUTES = 64


class GroupRoute:
    """The direct path of one step group on one shard (module docstring). Not thread-safe,
    as the group is not."""

    __slots__ = (
        "client",
        "state",
        "part",
        "pool",
        "origin",
        "url",
        "gid",
        "pull_req",
        "pull_bytes",
        "push_req",
        "push_head",
    )

    def __init__(self, client: PSClient, state: _group.GroupState) -> None:
        sender = client._sender
        assert isinstance(sender, NativeSender)
        self.client = client
        self.state = state
        self.part = state.parts[0]
        self.pool = sender.pool
        self.url = sender.urls[self.part.shard]
        self.origin = sender.origins[self.url]
        #: The group id the requests below were built for.
        self.gid: str | None = None
        self.pull_req: ShardRequest | None = None
        self.pull_bytes = b""
        self.push_req: ShardRequest | None = None
        self.push_head = b""

    @classmethod
    def make(cls, client: PSClient, state: _group.GroupState) -> GroupRoute | None:
        """The route of ``state`` (a group of ``client``), or ``None`` where the direct path
        is not taken (module docstring)."""
        sender = client._sender
        core = client._core
        if not isinstance(sender, NativeSender) or len(state.parts) != 1 or core.allow_backup:
            return None
        shard = state.parts[0].shard
        if core.replicas.replicated(shard) or sender.origins[sender.urls[shard]].tls:
            return None
        return cls(client, state)

    def ready(self) -> bool:
        """Whether this call may take the direct path (the group is registered)."""
        return self.part.gid is not None

    def _prepare(self) -> None:
        """Build the requests for the group's id (once per registration)."""
        core = self.client._core
        part = self.part
        gid = part.gid
        pull = core.post(
            part.shard,
            "group_pull",
            {"group": gid},
            0.0,  # each call's deadline is set where the general path takes over
            mutating=False,
            max_reply=REPLY_HEADROOM + part.nbytes,
            into=part.sink,
        )
        assert pull.body is not None
        self.pull_req = pull
        self.pull_bytes = (
            request_head(self.origin, pull.method, pull.path, request_headers(pull))
            + pull.body.join()
        )
        push = core.post(part.shard, "group_push", {}, 0.0, mutating=True, retry_safe=True)
        self.push_req = push
        head = request_head(self.origin, push.method, push.path, push.headers)
        self.push_head = head[:-2] + f"content-type: {FRAME}\r\ncontent-length: ".encode()
        self.gid = gid

    def _send(
        self, req: ShardRequest, views: list[Buffer], started: float
    ) -> tuple[Reply | None, Reply | Exception]:
        """One exchange: ``(reply, reply)`` for a ``200``, else ``(None, outcome)``."""
        settings = self.client._core.settings
        try:
            r = exchange(
                self.pool,
                self.origin,
                views,
                started + settings.timeout,
                req.max_reply or 0,
                req.into,
            )
            reply = Reply(r.status, r.headers, r.content)
            _replies.refuse_encoded(r.headers, r.status, self.url)
        except (*_TRANSPORT_ERRORS, PSError) as exc:
            return None, exc
        return (reply if reply.status == 200 else None), reply

    def _general(self, req: ShardRequest, started: float, outcome: Reply | Exception) -> list[Any]:
        """The first attempt's result, the general path going on from ``outcome``."""
        client = self.client
        core = client._core
        req = dataclasses.replace(req, deadline=started + core.settings.retry_deadline)
        return [settle(client._sender, core, req, started, outcome)]

    def pull(self, out: Any) -> dict[str, np.ndarray]:
        """:func:`client_sdk._verbs.group.pull`, directly."""
        client = self.client
        if client._closed:
            raise closed_error()
        core = client._core
        state, part = self.state, self.part
        if part.gid != self.gid:
            self._prepare()
        req = self.pull_req
        assert req is not None and part.sink is not None and part.flat is not None
        targets = _group.out_targets(state, out)
        part.sink.target = part.flat if targets is None else targets[part.shard]
        started = time.monotonic()
        reply, outcome = self._send(req, [self.pull_bytes], started)
        if reply is None:
            first = self._general(req, started, outcome)
            return client._drive(_group.pull(core, state, out), first)
        _group.take(core, part, req, core.accept(req, reply))
        return _group.pulled(state, out)

    def push(self, grads: Any) -> dict[str, Any]:
        """:func:`client_sdk._verbs.group.push`, directly."""
        client = self.client
        if client._closed:
            raise closed_error()
        core = client._core
        state, part = self.state, self.part
        if part.gid != self.gid:
            self._prepare()
        req = self.push_req
        assert req is not None and part.dtype is not None
        pieces = _group.gradient_pieces(state, grads)[part.shard]
        seq = core.next_seq()
        body = group_wire.encode(
            {"group": part.gid, "worker_id": core.settings.worker_id, "seq": seq},
            part.versions,
            "grads",
            part.dtype.str,
            pieces,
            part.nbytes,
        )
        views: list[Buffer] = [self.push_head + b"%d\r\n\r\n" % body.nbytes, *body.chunks]
        started = time.monotonic()
        reply, outcome = self._send(req, views, started)
        if reply is None:
            first = self._general(dataclasses.replace(req, body=body), started, outcome)
            return client._drive(_group.push(core, state, grads, seq), first)
        return _group.pushed(core, state, [core.accept(req, reply)])


def direct_pull(client: PSClient, names: Any) -> dict[str, np.ndarray] | None:
    """A plain pull of ``names`` by the direct path (module docstring); ``None`` where it is
    not taken: the caller takes the general path."""
    if type(names) is not list and type(names) is not tuple:
        return None
    routes = client._pull_routes
    try:
        route = routes[tuple(names)]
    except KeyError:
        route = PullRoute.make(client, names)
        if len(routes) >= MAX_PULL_ROUTES:
            routes.clear()
        routes[tuple(names)] = route
    except TypeError:  # an unhashable item: the general path says what is wrong with it
        return None
    return None if route is None else route.pull()


class PullRoute:
    """The direct path of a plain pull of one list of names from one shard (module
    docstring). Thread-safe: nothing of a call is kept."""

    __slots__ = (
        "client",
        "names",
        "shard",
        "pool",
        "origin",
        "url",
        "req",
        "head",
        "bare",
        "seen",
    )

    def __init__(self, client: PSClient, names: list[str], shard: int) -> None:
        sender = client._sender
        assert isinstance(sender, NativeSender)
        core = client._core
        self.client = client
        self.names = names
        self.shard = shard
        self.pool = sender.pool
        self.url = sender.urls[shard]
        self.origin = sender.origins[self.url]
        msg = {"names": names, "layout": "table", "uniform": True, "packed": True}
        #: The call's request as the reply is decoded with it (its body, ``max_reply`` and
        #: ``deadline`` are set per call where the general path takes over).
        self.req = core.post(shard, "pull", msg, 0.0, mutating=False, names=names)
        head = request_head(self.origin, "POST", self.req.path, self.req.headers)
        self.head = head[:-2] + f"content-type: {wire.MSGPACK}\r\ncontent-length: ".encode()
        #: The body without versions; with them, its map has one more entry at the end.
        self.bare: bytes = msgpack.packb(msg, use_bin_type=True)
        #: The headers of the last reply :meth:`Core.accept <client_sdk._core.Core.accept>`
        #: took, and the era it found in them.
        self.seen: tuple[Mapping[str, str], str | None] | None = None

    @classmethod
    def make(cls, client: PSClient, names: Any) -> PullRoute | None:
        """The route of a pull of ``names`` by ``client``, or ``None`` where the direct path
        is not taken whatever the state (module docstring)."""
        sender = client._sender
        core = client._core
        if not isinstance(sender, NativeSender) or core.settings.wire_dtype is not None:
            return None
        try:
            checked, groups = plan(core, names)
        except PSError:  # the general path raises it
            return None
        if len(groups) != 1:
            return None
        shard = next(iter(groups))
        if core.replicas.replicated(shard) or sender.origins[sender.urls[shard]].tls:
            return None
        return cls(client, checked, shard)

    def _one_row(
        self, reply: Reply, cached_as: str | None, writes: int | None
    ) -> dict[str, np.ndarray] | None:
        """The commonest reply, taken in one pass: a framed table of the route's one name,
        its value a vector of a dtype already seen in this machine's byte order; what
        :func:`~client_sdk._replies.decode` and :func:`~client_sdk._verbs.pull.take` make of
        it (the same read-only view of the body, cached the same way). ``None`` for any other
        reply (a row without a value, a column more, anything malformed), which they take."""
        if reply.headers.get("content-type") != FRAME:
            return None
        body = reply.content
        if isinstance(body, (bytearray, memoryview)):
            body = memoryview(body).toreadonly()
        size = len(body)  # a memoryview of bytes (http11.body_buffer), or bytes
        if size < FRAME_PREFIX.size:
            return None
        magic, hlen = FRAME_PREFIX.unpack_from(body, 0)
        start = FRAME_PREFIX.size + hlen
        if magic != FRAME_MAGIC or start > size:
            return None
        try:
            msg = msgpack.unpackb(body[FRAME_PREFIX.size : start], raw=False, strict_map_key=False)
        except Exception:  # msgpack raises several unrelated types; decode says which
            return None
        table = msg.get("table") if type(msg) is dict else None
        if type(table) is not dict or len(table) != 3:
            return None
        versions, dtypes, shapes = table.get("versions"), table.get("dtype"), table.get("shape")
        if (
            type(versions) is not list
            or type(dtypes) is not list
            or type(shapes) is not list
            or len(versions) != 1
            or len(dtypes) != 1
            or len(shapes) != 1
        ):
            return None
        text, shape = dtypes[0], shapes[0]
        if type(versions[0]) is not int or type(text) is not str or type(shape) is not list:
            return None
        dtype = PARSED_NATIVE.get(text)
        if dtype is None or len(shape) != 1 or type(shape[0]) is not int or shape[0] <= 0:
            return None
        at = align(start)
        if at + shape[0] * dtype.itemsize > size:
            return None
        value = np.frombuffer(body, dtype, shape[0], at)
        self.client._core.cache.store(self.names, versions, [value], cached_as, writes)
        return {self.names[0]: value}

    def _body(self, versions: list[int | None] | None) -> bytes:
        bare = self.bare
        if versions is None:
            return bare
        # fixmap of n entries -> n + 1: the versions go last, as the general path puts them
        packed: bytes = msgpack.packb(versions)
        return bytes((bare[0] + 1,)) + bare[1:] + b"\xa8versions" + packed

    def pull(self) -> dict[str, np.ndarray] | None:
        """The values of the names, or ``None`` where this call takes the general path
        from its start (a shard not checked yet, a name known partitioned since)."""
        client = self.client
        if client._closed:
            raise closed_error()
        core = client._core
        fleet, shard, names = core.fleet, self.shard, self.names
        if (
            not fleet.all_checked()
            or not fleet.tables[shard]
            or len(names) > fleet.max_names[shard]
            or core.parts.of(names)
        ):
            return None
        entries, writes = core.cache.held(names, fleet.era(shard))
        versions = None if entries is None else [c[1] if c is not None else None for c in entries]
        body = self._body(versions)
        req = self.req
        max_reply = reply_bound(core, names)
        started = time.monotonic()
        try:
            r = exchange(
                self.pool,
                self.origin,
                [self.head + b"%d\r\n\r\n" % len(body), body],
                started + core.settings.timeout,
                max_reply,
            )
            outcome: Reply | Exception = Reply(r.status, r.headers, r.content)
            _replies.refuse_encoded(r.headers, r.status, self.url)
        except (*_TRANSPORT_ERRORS, PSError) as exc:
            outcome = exc
        if type(outcome) is not Reply or outcome.status != 200:
            req = dataclasses.replace(
                req,
                body=wire.Encoded(wire.MSGPACK, [body], len(body)),
                deadline=started + core.settings.retry_deadline,
                max_reply=max_reply,
            )
            first = [settle(client._sender, core, req, started, outcome)]
            return client._drive(_partitioned.pull(core, names), first)
        seen = self.seen
        if seen is not None and (seen[0] is outcome.headers or seen[0] == outcome.headers):
            # The headers core.accept last checked and noted, unchanged: the same shard, in
            # the same era, so checking and noting them again would change nothing.
            url, cached_as = self.url, seen[1]
        else:
            url, cached_as = core.identify(req, outcome)
        if len(names) == 1:
            one = self._one_row(outcome, cached_as, writes)
            if one is not None:
                self.seen = (outcome.headers, cached_as)
                return one
        message = _replies.decode(req, outcome, url, core.n, cached_as)
        self.seen = (outcome.headers, cached_as)
        out: dict[str, np.ndarray] = {}
        if take(core, req, message, (entries, writes), out):
            # rows the cache cannot stand for (the shard restarted): the general path
            return client._drive(_partitioned.pull(core, names))
        if list(out) == names:
            return out
        return {name: out[name] for name in names}  # the caller's order, as the general path
