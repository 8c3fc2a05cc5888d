"""The direct path: a :class:`~client_sdk.StepGroup`'s pull and push when the whole group lives
on one shard, sent and received from the calling thread without the general machinery.

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
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _replies
from ._core import REPLY_HEADROOM
from ._exceptions import PSError
from ._flow import Reply, ShardRequest, request_headers
from ._http.direct import exchange
from ._http.http11 import Buffer, request_head
from ._http.native import NativeSender
from ._pusher import closed_error
from ._transport import _TRANSPORT_ERRORS, settle
from ._verbs import group as _group
from .wire import FRAME
from .wire import groups as group_wire

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ["GroupRoute"]


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
