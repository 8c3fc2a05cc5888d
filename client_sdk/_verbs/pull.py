"""``pull``: the current values of variables, each sent only if it changed since the client's
last pull of it.

One request per shard (or per run of ``max_request_names`` names) asks for its names in the
table layout, with the versions the cache holds of them (``_cache.py``). The shard answers in
a tensor table (docs/PROTOCOL.md, pull): a row with a value, or without one where the version
asked for is current, for which the cached array stands. A row without a value that the cache
cannot stand for (the shard restarted meanwhile) is pulled again, without versions. Values
arrive as read-only views of the reply's body: no copy after the socket's.

Given the caller's buffers (``into``: ``pull(out=)``, ``_verbs/partitioned.py``), each request
to a shard carries a :class:`~client_sdk._into.Sink` of its names' buffers, and the values
arrive in the buffers themselves (``_into.py``); what the cache keeps of those is
:func:`~client_sdk._cache.lent`, so a pull into buffers offers no version the cache only lends.

A shard that does not answer in tables answers a map name -> ``{version, value}`` instead
(:func:`_take_map`); both end in the cache's one storing rule.

Hot path: a training loop pulls the same list of names every step. Its plan (checked names,
names per shard) is kept per list, and the bound on each reply per list of names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _args, wire
from .._cache import NOT_HELD, Held, Lent, lent, reuse
from .._core import REPLY_HEADROOM, REPLY_PER_NAME, Core
from .._exceptions import ProtocolError
from .._flow import Body, Flow, ShardRequest
from .._into import Sink
from .._replies import Message
from ..wire import halves

__all__ = ["half_on", "plan", "pull", "reply_bound", "take"]

#: Lists of names whose pull plans are kept (all dropped when full).
MAX_PLANS = 64


def pull(
    core: Core, names: Any, into: Mapping[str, np.ndarray] | None = None
) -> Flow[dict[str, np.ndarray]]:
    """The values of ``names``; those named in ``into`` (name -> the caller's writable
    ndarray) received into it where the reply allows, their value then that very ndarray
    (the others are written by ``_into.write``)."""
    names, groups = plan(core, names)
    if not names:
        return {}
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    fleet, cache = core.fleet, core.cache
    wire_dtype = core.settings.wire_dtype
    out: dict[str, np.ndarray] = {}
    for use_cache in (True, False):
        batch, held = [], []
        for shard, group in fleet.chunks(groups):
            msg: dict[str, Any] = {
                "names": group,
                "layout": "table",
                "uniform": True,
                "packed": True,
            }
            if wire_dtype is not None:
                fleet.require(
                    shard, wire.FEATURE_WIRE_DTYPE, f"PSClient(wire_dtype={wire_dtype!r})"
                )
                msg["wire_dtype"] = wire_dtype
            sink = None
            views = {n: into[n] for n in group if n in into} if into else {}
            if views or wire_dtype is not None:  # narrowed rows are widened as they arrive
                sink = Sink(views, group, wire_dtype is not None)
            if use_cache:
                entries, writes = cache.held(group, core.read_era(shard))
                if views and entries is not None:
                    entries = _unlent(entries)
                held.append((entries, writes))
                if entries is not None:
                    if fleet.tables[shard]:  # a list parallel to "names" (tables' form)
                        msg["versions"] = [c[1] if c is not None else None for c in entries]
                    else:
                        msg["versions"] = {k: c[1] for k, c in zip(group, entries) if c is not None}
            batch.append(
                core.post(
                    shard,
                    "pull",
                    msg,
                    deadline,
                    mutating=False,
                    names=group,
                    max_reply=reply_bound(core, group),
                    into=sink,
                )
            )
        replies = core.collect(batch, (yield batch))
        todo: list[str] = []
        for i, (request, reply) in enumerate(zip(batch, replies)):
            todo += take(core, request, reply, held[i] if held else NOT_HELD, out)
        if not todo:
            break
        groups = fleet.split(todo)
    if todo:  # pragma: no cover - a shard that omits values it was not asked to keep
        raise ProtocolError(f"shards did not send the values of {todo}")
    if list(out) == names:
        return out  # already in the caller's order (one shard, one round)
    return {name: out[name] for name in names}


def _unlent(entries: list[Any]) -> list[Any] | None:
    """``entries`` (a pull's held ones) without those the cache lends (no version offered)."""
    entries = [None if c is not None and type(c[2]) is Lent else c for c in entries]
    return None if entries.count(None) == len(entries) else entries


def half_on(core: Core, shard: int) -> str:
    """The client's ``wire_dtype``, once ``shard`` is known to take it (else
    :class:`~client_sdk.ProtocolError` naming the shard, before anything is sent)."""
    wire_dtype = core.settings.wire_dtype
    assert wire_dtype is not None
    core.fleet.require(shard, wire.FEATURE_WIRE_DTYPE, f"PSClient(wire_dtype={wire_dtype!r})")
    return wire_dtype


def plan(core: Core, names: Any) -> tuple[list[str], dict[int, list[str]]]:
    """A pull's checked names (:func:`_args.names`) and those names per shard, kept per list
    of names: a training loop pulls the same list step after step."""
    key = None
    if type(names) is list or type(names) is tuple:
        try:
            key = tuple(names)
            plan = core.pull_plans.get(key)
        except TypeError:  # an unhashable item: names() says what is wrong with it
            key = plan = None
        if plan is not None:
            return plan
    checked = _args.names(names, "pull", core.fleet)
    plan = (checked, core.fleet.split(checked))
    if key is not None:
        plans = core.pull_plans
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return plan


def reply_bound(core: Core, names: list[str]) -> int:
    """The most bytes a pull reply for ``names`` (one shard's) can take: the headroom, the
    size of each value this client knows (from its cache, or its init) and the room per name;
    plus ``max_reply_bytes`` once for all those of unknown size."""
    known, unknown = core.cache.value_bytes(names)
    bound = REPLY_HEADROOM + REPLY_PER_NAME * len(names) + known
    return bound + core.settings.max_reply_bytes if unknown else bound


def take(
    core: Core, request: ShardRequest, reply: Message, held: Held, out: dict[str, np.ndarray]
) -> list[str]:
    """Decode one shard's pull reply into ``out`` and cache its values; return names to pull
    again without versions (their cached value came from another incarnation of the shard)."""
    # Arrays decoded from a read-only view of the body are read-only themselves.
    body = reply.body
    if isinstance(body, (bytearray, memoryview)):
        body = memoryview(body).toreadonly()
    table = reply.msg.get("table")
    if table is not None:
        return _take_table(core, request, reply, table, body, held, out)
    return _take_map(core, request, reply, body, held, out)


def _take_table(
    core: Core,
    request: ShardRequest,
    reply: Message,
    table: Any,
    body: Body,
    held: Held,
    out: dict[str, np.ndarray],
) -> list[str]:
    """:func:`take` for a reply in the table layout (docs/PROTOCOL.md, pull)."""
    url = core.url(request.shard)
    asked = list(request.names)
    sink = request.into
    views: Mapping[str, np.ndarray] = {}
    values: Any
    if isinstance(sink, Sink) and sink.rows is not None:
        names, values = sink.rows  # received into the buffers (and the sink's own)
        views = sink.views
    else:
        try:
            names, values = wire.table_rows(table, body, native=True, names=asked)
        except wire.WireError as exc:
            raise ProtocolError(
                f"shard {url} sent a bad pull table: {exc.message}", shard=url
            ) from exc
    if "narrowed" in table:
        values = _widened(url, table["narrowed"], values, names, views)
    versions = table.get("versions")
    if (
        type(versions) is not list
        or len(versions) != len(names)
        or (names is not asked and names != asked)
    ):
        raise ProtocolError(
            f"shard {url} sent a pull table whose names or versions do not match the request",
            shard=url,
        )
    incarnation = reply.incarnation
    if ("uniform" in table or table["dtype"].count(None) == 0) and set(map(type, versions)) == {
        int
    }:
        # Every row holds a value (a row has one exactly when its dtype is not nil): the
        # same as below, without a statement per row.
        out.update(zip(names, values))
        core.cache.store(names, versions, _kept(views, names, values), incarnation, held[1])
        return []
    if set(map(type, versions)) != {int}:
        for name, version in zip(names, versions):
            if type(version) is not int:
                raise ProtocolError(
                    f"shard {url} sent no version for {name!r} in a pull reply", shard=url
                )
    # Views of a read-only body (see take) are read-only already.
    return _rows(
        core,
        request,
        names,
        versions,
        values,
        table["dtype"].count(None),
        reply,
        held,
        out,
        views,
    )


def _kept(
    views: Mapping[str, np.ndarray], names: Sequence[str], values: Sequence[Any]
) -> Sequence[Any]:
    """What the cache keeps of ``values``: a value received into its buffer (``views``) lent."""
    if not views:
        return values
    return [
        lent(v) if (b := views.get(n)) is not None and v is b else v for n, v in zip(names, values)
    ]


def _widened(
    url: str,
    narrowed: Any,
    values: list[np.ndarray | None],
    names: list[str],
    views: Mapping[str, np.ndarray],
) -> list[np.ndarray | None]:
    """``values`` with the rows the shard narrowed (``wire_dtype``) widened back to float32;
    a row received by a sink (``views``) widened into its buffer when it fits."""
    if type(narrowed) is not list or not all(
        type(i) is int and 0 <= i < len(values) and values[i] is not None for i in narrowed
    ):
        raise ProtocolError(f"shard {url} sent a pull table with a bad 'narrowed' list", shard=url)
    values = list(values)
    for i in narrowed:
        value: Any = values[i]
        if value.dtype == np.float32:
            continue  # widened as it arrived (client_sdk._into.Sink)
        view = views.get(names[i])
        if view is not None and view.shape == value.shape and view.dtype == np.float32:
            values[i] = halves.widen(value, view)
        else:
            values[i] = halves.widen(value)
    return values


def _rows(
    core: Core,
    request: ShardRequest,
    names: list[str],
    versions: list[int],
    values: list[np.ndarray | None],
    without: int,
    reply: Message,
    held: Held,
    out: dict[str, np.ndarray],
    views: Mapping[str, np.ndarray] | None = None,
) -> list[str]:
    """Put a reply's rows into ``out`` (``without`` of them came without a value) and cache
    those with one (lent where received into a buffer of ``views``); return the names to pull
    again (see :func:`_cache.reuse`)."""
    incarnation = reply.incarnation
    if without < len(names):
        fresh = [(n, v, a) for n, v, a in zip(names, versions, values) if a is not None]
        fresh_names, fresh_versions, fresh_values = zip(*fresh)
        out.update(zip(fresh_names, fresh_values))
        kept = _kept(views or {}, fresh_names, fresh_values)
        core.cache.store(fresh_names, fresh_versions, kept, incarnation)
    if not without:
        return []
    entries = held[0]
    held_of = dict(zip(request.names, entries)) if entries is not None else {}
    return reuse(names, versions, values, held_of, incarnation, out)


def _take_map(
    core: Core,
    request: ShardRequest,
    reply: Message,
    body: Body,
    held: Held,
    out: dict[str, np.ndarray],
) -> list[str]:
    """:func:`take` for a reply that maps each name to ``{version, value}``."""
    url = core.url(request.shard)
    variables = reply.msg.get("variables")
    if not isinstance(variables, Mapping):
        raise ProtocolError(f"shard {url} sent a pull reply without 'variables'", shard=url)
    names = list(request.names)
    versions: list[int] = []
    values: list[np.ndarray | None] = []
    for name in names:
        entry: Any = variables.get(name)  # a dict wherever version is an int
        version = entry.get("version") if isinstance(entry, dict) else None
        if type(version) is not int:
            raise ProtocolError(
                f"shard {url} sent no version for {name!r} in a pull reply", shard=url
            )
        versions.append(version)
        value = entry.get("value")
        if value is not None:
            array = wire.framed_view(value, body) if type(value) is dict else None
            if array is None or not array.dtype.isnative:
                array = _tensor(url, name, value, body)
            value = array
        values.append(value)
    without = sum(1 for v in values if v is None)
    return _rows(core, request, names, versions, values, without, reply, held, out)


def _tensor(url: str, name: str, obj: Any, body: Body) -> np.ndarray:
    """A tensor map of a pull reply as a read-only array in this machine's byte order."""
    try:
        value = wire.decode_tensor(obj, body)
    except wire.WireError as exc:
        raise ProtocolError(
            f"shard {url} sent a bad tensor for {name!r}: {exc.message}", shard=url
        ) from exc
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    if value.flags.writeable:
        value.flags.writeable = False
    return value
