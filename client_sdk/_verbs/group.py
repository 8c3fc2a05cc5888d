"""Step groups: a list of variables registered once per shard, then pulled and pushed as one
flat buffer per shard (docs/PROTOCOL.md §3, Step groups; the user's side is
``client_sdk/groups.py``).

:class:`GroupState` is what a group keeps: per shard its part of the names (in the group's
order), the id the shard gave the part, the layout it answered (dtype, shapes), the flat buffer
its pulls arrive in, the versions last pulled, and per name a view of that buffer made once.
The flows here register the parts (:func:`register`), pull (:func:`pull`) and push
(:func:`push`); a part the shard no longer knows (404 ``unknown_group``: it restarted, another
replica answers now, or it let the group go) is registered again and the request sent again,
once, without the caller seeing it (a push keeps its ``seq``: applied once). A part registered
again with another layout than before (a variable made again with another shape) raises
:class:`~client_sdk.StaleGroupError`, as does the shard's 409 ``group_stale``: the caller makes
the group again.

Over the SDK's own connections a pull's values are received from the socket straight into the
flat buffer (:class:`GroupSink`); elsewhere (an injected transport, a reply that came whole with
its head) they are copied in from the reply, one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import _args, wire
from .._core import REPLY_HEADROOM, Core
from .._exceptions import (
    BadRequestError,
    BadTensorError,
    ProtocolError,
    PSError,
    StaleGroupError,
)
from .._flow import Flow, Reply, ShardRequest
from .._http.http11 import body_buffer
from .._replies import Message
from ..wire import groups as group_wire

__all__ = [
    "GroupSink",
    "GroupState",
    "Part",
    "gradient_pieces",
    "out_targets",
    "pull",
    "pulled",
    "push",
    "pushed",
    "register",
    "take",
]


@dataclass
class Part:
    """A group's variables on one shard, in the group's order."""

    shard: int
    names: list[str]
    #: The shard's id for the part (``None`` until registered).
    gid: str | None = None
    dtype: np.dtype | None = None
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    nbytes: int = 0
    #: Where pulls arrive: one flat array of the part's values, back to back.
    flat: np.ndarray | None = None
    #: The versions of the values in :attr:`flat` (``None`` before the first pull).
    versions: np.ndarray | None = None
    sink: GroupSink | None = None
    #: The part's own gradient buffer (:meth:`GroupState.grad_views`), made on first use.
    grad: np.ndarray | None = None

    @property
    def count(self) -> int:
        return self.nbytes // self.dtype.itemsize if self.dtype is not None else 0


class GroupState:
    """What a step group keeps (module docstring); its flows are this module's functions."""

    def __init__(self, core: Core, names: Any) -> None:
        if isinstance(names, Iterable) and not isinstance(names, (str, bytes)):
            names = list(names)  # read once (a generator)
        checked = _args.names(names, "group", core.fleet)
        if not checked:
            raise BadRequestError("group() needs at least one variable name")
        if len(checked) != len(names):
            raise BadRequestError(
                "group(): a name is listed twice: list each variable once",
                details={"field": "names"},
            )
        self.names = checked
        self.parts = [Part(shard, part) for shard, part in core.fleet.split(checked).items()]
        #: Name -> a view of its part's flat buffer (made once; what :meth:`pull` fills).
        self.views: dict[str, np.ndarray] = {}
        self._grad_views: dict[str, np.ndarray] | None = None
        #: The last flat ``out`` pulled into (a group on one shard) and its views.
        self._out: tuple[np.ndarray, dict[str, np.ndarray]] | None = None

    def views_of(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Name -> a view of ``flat`` (a caller's flat buffer of a group on one shard), laid
        out as :attr:`views`; kept for the last buffer given."""
        if self._out is not None and self._out[0] is flat:
            return self._out[1]
        part = self.parts[0]
        views: dict[str, np.ndarray] = {}
        at = 0
        for name, shape in zip(part.names, part.shapes):
            size = int(np.prod(shape, dtype=np.int64))
            views[name] = flat[at : at + size].reshape(shape)
            at += size
        self._out = (flat, {name: views[name] for name in self.names})
        return self._out[1]

    def layout(self) -> None:
        """Make each part's flat buffer and the views into it (after the first registration)."""
        views: dict[str, np.ndarray] = {}
        for part in self.parts:
            assert part.dtype is not None
            flat = part.flat = np.zeros(part.count, part.dtype)
            part.sink = GroupSink(flat)
            at = 0
            for name, shape in zip(part.names, part.shapes):
                size = int(np.prod(shape, dtype=np.int64))
                views[name] = flat[at : at + size].reshape(shape)
                at += size
        self.views = {name: views[name] for name in self.names}

    def grad_views(self) -> dict[str, np.ndarray]:
        """Name -> a view of its part's gradient buffer (made on first use, zeros): a
        worker writes its gradients there and pushes them with :func:`push` (``grads=None``),
        nothing gathered or copied."""
        if self._grad_views is None:
            views: dict[str, np.ndarray] = {}
            for part in self.parts:
                assert part.dtype is not None
                grad = part.grad = np.zeros(part.count, part.dtype)
                at = 0
                for name, shape in zip(part.names, part.shapes):
                    size = int(np.prod(shape, dtype=np.int64))
                    views[name] = grad[at : at + size].reshape(shape)
                    at += size
            self._grad_views = {name: views[name] for name in self.names}
        return self._grad_views


def register(core: Core, state: GroupState, parts: Sequence[Part] | None = None) -> Flow[None]:
    """Register ``parts`` (by default every part) on their shards; raise
    :class:`StaleGroupError` if a part registered before comes back with another layout."""
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    todo = list(state.parts if parts is None else parts)
    for part in todo:
        core.fleet.require(part.shard, wire.FEATURE_GROUPS, "group()")
    batch = [
        core.post(
            part.shard,
            "groups",
            {"names": part.names},
            deadline,
            mutating=False,
            names=part.names,
        )
        for part in todo
    ]
    replies = core.collect(batch, (yield batch))
    first = state.parts[0].dtype is None
    for part, request, reply in zip(todo, batch, replies):
        _registered(core, part, request, reply.msg)
    if first:
        state.layout()


def _registered(core: Core, part: Part, request: ShardRequest, msg: Any) -> None:
    url = core.url(part.shard)
    try:
        gid, names = msg["group"], msg["names"]
        dtype = np.dtype(wire.parse_dtype(msg["dtype"]))
        shapes = [tuple(int(d) for d in s) for s in msg["shapes"]]
        nbytes = int(msg["nbytes"])
        if type(gid) is not str or names != part.names or len(shapes) != len(names):
            raise ValueError("names or shapes not those asked for")
        if nbytes != sum(int(np.prod(s, dtype=np.int64)) for s in shapes) * dtype.itemsize:
            raise ValueError("nbytes is not the shapes' size")
    except (KeyError, TypeError, ValueError, wire.WireError) as exc:
        raise ProtocolError(f"shard {url} sent a bad groups reply: {exc}", shard=url) from None
    if part.dtype is not None and (dtype != part.dtype or shapes != part.shapes):
        raise StaleGroupError(
            f"the group's variables on shard {url} now have another layout than when the "
            "group was made (one was made again with another shape or dtype): make the group "
            "again (ps.group(names))",
            shard=url,
            code="group_stale",
        )
    part.gid, part.dtype, part.shapes, part.nbytes = gid, dtype, shapes, nbytes


def _send(
    core: Core, state: GroupState, request: Callable[[Part], ShardRequest]
) -> Generator[list[ShardRequest], list[Any], tuple[list[ShardRequest], list[Any]]]:
    """Send ``request(part)`` for every part; a part whose shard no longer knows its group
    (404 ``unknown_group``) is registered again and its request (built again: the new id)
    sent again, once. The requests and results, in the parts' order."""
    todo = list(state.parts)
    done: dict[int, tuple[ShardRequest, Any]] = {}
    for attempt in range(2):
        batch = [request(part) for part in todo]
        results = yield batch
        lost = []
        for part, sent, result in zip(todo, batch, results):
            if attempt == 0 and _unknown(core, sent, result):
                lost.append(part)
            else:
                done[part.shard] = (sent, result)
        if not lost:
            break
        yield from register(core, state, lost)
        todo = lost
    pairs = [done[part.shard] for part in state.parts]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _unknown(core: Core, sent: ShardRequest, result: Any) -> bool:
    """Whether ``result`` is a 404 ``unknown_group``."""
    if not isinstance(result, Reply) or result.status != 404:
        return False
    try:
        core.accept(sent, result)
    except PSError as exc:
        return exc.code == "unknown_group"
    return False  # pragma: no cover - a 404 always raises


def pull(core: Core, state: GroupState, out: Any = None) -> Flow[dict[str, np.ndarray]]:
    """The group's values, received into its flat buffers (or ``out``'s); returns
    :attr:`GroupState.views` (or the caller's arrays: ``out``)."""
    if state.parts[0].gid is None:
        yield from register(core, state)
    targets = out_targets(state, out)
    deadline = core.deadline()

    def request(part: Part) -> ShardRequest:
        assert part.sink is not None and part.flat is not None
        part.sink.target = part.flat if targets is None else targets.get(part.shard, part.flat)
        return core.post(
            part.shard,
            "group_pull",
            {"group": part.gid},
            deadline,
            mutating=False,
            max_reply=REPLY_HEADROOM + part.nbytes,
            into=part.sink,
        )

    batch, results = yield from _send(core, state, request)
    replies = core.collect(batch, results)
    for part, sent, reply in zip(state.parts, batch, replies):
        take(core, part, sent, reply)
    return pulled(state, out)


def pulled(state: GroupState, out: Any) -> dict[str, np.ndarray]:
    """What :func:`pull` returns once every part's values arrived."""
    if out is None:
        return state.views
    if isinstance(out, np.ndarray):
        return state.views_of(out)
    for name, view in out.items():
        np.copyto(view, state.views[name])
    return dict(out)


def out_targets(state: GroupState, out: Any) -> dict[int, np.ndarray] | None:
    """Where each part's pull arrives: ``out`` as one flat array (a group on one shard), or
    ``None`` (the group's own buffers: a dict ``out`` is copied into after)."""
    if out is None:
        return None
    if isinstance(out, np.ndarray):
        if len(state.parts) != 1:
            raise BadRequestError(
                "pull(out=<one array>) needs a group on one shard; this one spans "
                f"{len(state.parts)}: pass a dict name -> array, or make one group per shard"
            )
        part = state.parts[0]
        if (
            out.dtype != part.dtype
            or out.shape != (part.count,)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise BadTensorError(
                f"pull(out=): the flat buffer must be a writable C-contiguous {part.dtype} "
                f"array of shape ({part.count},), got {out.dtype} {list(out.shape)}",
                code="bad_tensor",
            )
        return {part.shard: out}
    if not isinstance(out, Mapping):
        raise BadRequestError("pull(out=) takes one flat array or a dict name -> array")
    for name, view in out.items():
        have = state.views.get(name)
        if have is None:
            raise BadRequestError(f"pull(out=): {name!r} is not in the group")
        if (
            not isinstance(view, np.ndarray)
            or view.shape != have.shape
            or (view.dtype != have.dtype)
        ):
            raise BadTensorError(
                f"pull(out=): out[{name!r}] must be a {have.dtype} array of shape "
                f"{list(have.shape)}",
                code="bad_tensor",
                details={"variable": name},
            )
    return None


def take(core: Core, part: Part, request: ShardRequest, reply: Message) -> None:
    """A part's pull reply: its versions kept; its values in the sink's target (received
    there, or copied there from the body)."""
    url = core.url(part.shard)
    sink = part.sink
    assert sink is not None and sink.target is not None and part.dtype is not None
    msg, body = reply.msg, reply.body
    try:
        if msg.get("group") != part.gid:
            raise wire.WireError(f"it answers group {msg.get('group')!r}, not {part.gid!r}")
        versions = group_wire.read_versions(msg, body, len(part.names))
        if versions is None:
            raise wire.WireError("it has no 'versions'")
        if sink.received is not body:
            size = len(memoryview(body).cast("B"))
            offset, _ = group_wire.flat_tensor(
                msg, "values", part.dtype, part.count, wire.header_end(body), size
            )
            sink.target[...] = np.frombuffer(body, part.dtype, part.count, offset)
    except wire.WireError as exc:
        raise ProtocolError(
            f"shard {url} sent a bad group_pull reply: {exc.message}", shard=url
        ) from None
    part.versions = versions.copy()


class GroupSink:
    """Receives a part's pull reply (:class:`client_sdk._http.http11.Into`): the header and
    the versions into a small buffer of its own, the values straight into :attr:`target`
    (the part's flat buffer, or the caller's). A reply that is not laid out so is received
    whole, for the pull to refuse (or, if it is right after all, copy). A group's replies
    have the same header every time (only the versions' bytes change): the last one that
    checked out, and the target's bytes, are kept, so the next is compared, not decoded."""

    __slots__ = ("target", "received", "_checked", "_bytes")

    def __init__(self, target: np.ndarray) -> None:
        self.target = target
        #: What the last reply taken apart here returned (its head), else ``None``.
        self.received: Any = None
        self._checked: tuple[bytes, int, np.dtype, int] | None = None
        self._bytes: tuple[np.ndarray, memoryview] | None = None

    def receive(self, got: memoryview, size: int) -> Generator[memoryview, int, Any]:
        self.received = None
        target = self.target
        nbytes = target.nbytes
        start = size - nbytes  # the values end the body
        if start < wire.FRAME_PREFIX.size:
            return (yield from _whole(got, size))
        head = memoryview(bytearray(start))  # the versions are copied out of it
        take = min(start, len(got))
        head[:take] = got[:take]
        while take < start:
            take += yield head[take:]
        rest = got[start:] if len(got) > start else memoryview(b"")
        try:
            end = wire.header_end(head)
            key = (head[:end].tobytes(), size, target.dtype, target.size)
            if key != self._checked:
                msg = wire.unpack(head, wire.FRAME)
                group_wire.flat_tensor(msg, "values", target.dtype, target.size, end, size)
                self._checked = key
        except wire.WireError:
            return (yield from _whole(head, size, rest))
        kept = self._bytes
        if kept is not None and kept[0] is target:
            into = kept[1]
        else:
            into = target.reshape(-1).view(np.uint8).data
            self._bytes = (target, into)
        take = len(rest)
        into[:take] = rest
        while take < nbytes:
            take += yield into[take:]
        self.received = head
        return head


def _whole(
    got: memoryview, size: int, more: memoryview | None = None
) -> Generator[memoryview, int, Any]:
    """The body whole in one buffer (``got``: its first bytes; ``more``: the ones after)."""
    body = body_buffer(size)
    at = len(got)
    body[:at] = got
    if more is not None:
        body[at : at + len(more)] = more
        at += len(more)
    while at < size:
        at += yield body[at:]
    return body


def push(core: Core, state: GroupState, grads: Any, seq: int | None = None) -> Flow[dict[str, Any]]:
    """Apply gradients to the group's variables, each shard's part as one flat tensor, once
    per ``seq``. ``grads``: a dict name -> array for every variable of the group, (a group on
    one shard) one flat array, or ``None``: the group's own gradient buffers
    (:meth:`GroupState.grad_views`); the versions sent are the last pulled."""
    if state.parts[0].gid is None:
        yield from register(core, state)
    pieces = gradient_pieces(state, grads)
    deadline = core.deadline()
    worker_id = core.settings.worker_id
    seqs = {part.shard: core.next_seq() if seq is None else seq for part in state.parts}

    def request(part: Part) -> ShardRequest:
        assert part.dtype is not None
        body = group_wire.encode(
            {"group": part.gid, "worker_id": worker_id, "seq": seqs[part.shard]},
            part.versions,
            "grads",
            part.dtype.str,
            pieces[part.shard],
            part.nbytes,
        )
        sent = core.post(part.shard, "group_push", {}, deadline, mutating=True, retry_safe=True)
        return replace(sent, body=body)

    batch, results = yield from _send(core, state, request)
    return pushed(core, state, core.collect(batch, results))


def pushed(core: Core, state: GroupState, replies: list[Message]) -> dict[str, Any]:
    """What :func:`push` returns, from each part's reply (in the parts' order)."""
    versions: dict[str, int] = {}
    applied = 0
    others: dict[str, Any] = {}
    for part, reply in zip(state.parts, replies):
        msg = reply.msg
        got = msg.get("versions")
        if type(got) is not list or len(got) != len(part.names):
            url = core.url(part.shard)
            raise ProtocolError(f"shard {url} sent a bad group_push reply", shard=url)
        versions.update(zip(part.names, got))
        applied += int(msg.get("applied", 0))
        if isinstance(msg.get("variables"), dict):
            others.update(msg["variables"])
    if len(state.parts) != 1:  # one part's names are the group's, in its order already
        versions = {name: versions[name] for name in state.names}
    return {"versions": versions, "applied": applied, "variables": others}


def gradient_pieces(state: GroupState, grads: Any) -> dict[int, list[Any]]:
    """Each part's gradient bytes, in its order (the caller's arrays' own memory; ``None``:
    the group's own gradient buffers)."""
    if grads is None:
        state.grad_views()
        return {
            part.shard: [part.grad.data.cast("B")] for part in state.parts if part.grad is not None
        }
    if isinstance(grads, np.ndarray):
        if len(state.parts) != 1:
            raise BadRequestError(
                "push(<one array>) needs a group on one shard; this one spans "
                f"{len(state.parts)}: pass a dict name -> gradient"
            )
        part = state.parts[0]
        if grads.shape != (part.count,) or grads.dtype != part.dtype:
            raise BadTensorError(
                f"push: the flat gradient must be a {part.dtype} array of shape "
                f"({part.count},), got {grads.dtype} {list(grads.shape)}",
                code="bad_tensor",
            )
        return {part.shard: [np.ascontiguousarray(grads).data.cast("B")]}
    if not isinstance(grads, Mapping):
        raise BadRequestError("a group's push takes a dict name -> gradient, or one flat array")
    if len(grads) != len(state.names) or not all(name in grads for name in state.names):
        missing = [n for n in state.names if n not in grads][:10]
        extra = [n for n in grads if n not in state.views][:10]
        raise BadRequestError(
            "a group's push needs a gradient for every variable of the group, and no other: "
            f"missing {missing}, not in the group {extra}",
            details={"missing": missing, "extra": extra},
        )
    out = {}
    for part in state.parts:
        pieces = []
        for name, shape in zip(part.names, part.shapes):
            grad = grads[name]
            if not isinstance(grad, np.ndarray):
                grad = np.asarray(grad)
            if grad.shape != shape or grad.dtype != part.dtype:
                raise BadTensorError(
                    f"push: gradient of {name!r} is {grad.dtype} {list(grad.shape)}, but the "
                    f"group holds it as {part.dtype} {list(shape)}",
                    code="bad_tensor",
                    details={"variable": name},
                )
            pieces.append(np.ascontiguousarray(grad).reshape(-1).view(np.uint8).data)
        out[part.shard] = pieces
    return out
