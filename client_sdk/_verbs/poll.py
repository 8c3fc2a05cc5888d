"""``pull(names, newer_than=...)`` and ``pull(names, min_version=...)``: pulls that wait.

Both are flows over ``POST /v1/poll`` (docs/PROTOCOL.md §3 poll): a pull the shard holds until
there is something to answer, answered as a pull is (``pull.py`` takes the reply apart).

* :func:`newer` (*newer than*): returns as soon as one named variable's version differs from
  the one given (``"cached"``: the one this client's version cache holds, incarnation
  included), with only the variables that changed; ``{}`` at the timeout. Over several shards
  it is a *race*: one poll per shard, each request carrying an
  :class:`~client_sdk._abort.Abort`; the shells hand the flow the first settled result and
  abandon the others (their connections closed, so the shards stop waiting for them). When
  the first has news, the shards abandoned are asked again without waiting (a poll of 0 s),
  so that the result holds every shard's changed variables, not the first shard's alone.
* :func:`reached` (*min version*): returns every named variable once each has reached the
  version, its values as a pull's (only what the cache lacks travels); raises
  :class:`~client_sdk.NotReadyError` at the timeout. Every shard must answer, so no race.

A shard holds a poll at most 30 s: a longer (or unbounded, ``timeout=None``) wait is a series of
polls. Values that arrive go into the version cache as a pull's do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import wire
from .._abort import Abort
from .._cache import Lent
from .._core import Core
from .._exceptions import BadRequestError, NotReadyError, ProtocolError
from .._flow import Flow, ShardRequest
from .._replies import Message
from .pull import half_on, plan, pull, reply_bound, take
from .wait import WAIT_READ_SLACK

__all__ = ["POLL_SECONDS", "newer", "poll", "reached"]

#: The longest one poll waits on a shard (the shard's own limit).
POLL_SECONDS = 30.0
_MAX_VERSION = (1 << 63) - 1


def poll(
    core: Core, names: Any, newer_than: Any, min_version: Any, timeout: Any
) -> Flow[dict[str, np.ndarray]]:
    """The flow of a pull given ``newer_than`` or ``min_version``, its arguments checked
    first (:class:`~client_sdk.BadRequestError`, before anything is sent)."""
    _check(newer_than, min_version, timeout)
    if min_version is not None:
        return reached(core, names, int(min_version), timeout)
    if newer_than != "cached":
        newer_than = {k: int(v) for k, v in newer_than.items()}
    return newer(core, names, newer_than, timeout)


def _check(newer_than: Any, min_version: Any, timeout: Any) -> None:
    """Refuse bad ``newer_than`` / ``min_version`` / ``timeout`` arguments of a pull before
    anything is sent (:class:`~client_sdk.BadRequestError`)."""
    if newer_than is not None and min_version is not None:
        raise BadRequestError(
            "pull: give newer_than or min_version, not both (newer_than returns what changed, "
            "min_version waits for every variable to reach a version)"
        )
    if newer_than is not None and newer_than != "cached":
        if not isinstance(newer_than, Mapping) or not all(_version(v) for v in newer_than.values()):
            raise BadRequestError(
                "pull: newer_than must be 'cached' or a dict name -> version (an int in "
                f"0..2**63-1, e.g. from a push's result), got {_shown(newer_than)}"
            )
    if min_version is not None and not _version(min_version):
        raise BadRequestError(
            f"pull: min_version must be an int in 0..2**63-1, got {_shown(min_version)}"
        )
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise BadRequestError(f"pull: timeout must be seconds >= 0 or None, got {timeout!r}")


def _version(v: Any) -> bool:
    return bool(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v <= _MAX_VERSION
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else type(value).__name__


def _end(timeout: float | None) -> float:
    return math.inf if timeout is None else time.monotonic() + timeout


def _poll_time(end: float) -> float:
    return max(0.0, min(end - time.monotonic(), POLL_SECONDS))


def _request(
    core: Core,
    shard: int,
    group: list[str],
    held: list[int | None],
    extra: dict[str, Any],
    poll: float,
    abort: Abort | None,
) -> ShardRequest:
    core.fleet.require(shard, wire.FEATURE_POLL, "a pull with newer_than or min_version")
    msg: dict[str, Any] = {
        "names": group,
        "timeout": poll,
        "layout": "table",
        "uniform": True,
        "packed": True,
        **extra,
    }
    if core.settings.wire_dtype is not None:
        msg["wire_dtype"] = half_on(core, shard)
    if any(v is not None for v in held):
        msg["versions"] = held  # a list parallel to "names": every poll shard takes tables
    return core.post(
        shard,
        "poll",
        msg,
        core.deadline(),
        mutating=False,
        names=group,
        timeout=poll + WAIT_READ_SLACK,
        max_reply=reply_bound(core, group),
        abort=abort,
    )


def newer(
    core: Core, names: Any, newer_than: str | Mapping[str, int], timeout: float | None
) -> Flow[dict[str, np.ndarray]]:
    """``pull(names, newer_than=..., timeout=...)``: see the module."""
    names, groups = plan(core, names)
    if not names:
        return {}
    end = _end(timeout)
    yield from core.require_fleet(core.deadline())
    cached = newer_than == "cached"
    while True:
        parts = core.fleet.chunks(groups)
        race = len(parts) > 1
        batch, helds = _newer_batch(core, parts, newer_than, _poll_time(end), race)
        results = yield batch
        out: dict[str, np.ndarray] = {}
        again: list[str] = []
        abandoned: list[tuple[int, list[str]]] = []
        for request, result, held in zip(batch, results, helds):
            if result is None:  # abandoned: another shard answered first
                abandoned.append((request.shard, request.names))
                continue
            again += _newer_taken(core, request, result, held, cached, out)
        if abandoned and (out or again):
            # The race's winner had news: what the other shards hold newer goes with it, asked
            # for without waiting (a poll of 0 s answers at once).
            batch, helds = _newer_batch(core, abandoned, newer_than, 0.0, False)
            for request, result, held in zip(batch, (yield batch), helds):
                again += _newer_taken(core, request, result, held, cached, out)
        if again:
            out.update((yield from pull(core, again)))
        if out or time.monotonic() >= end:
            return {n: out[n] for n in names if n in out}


def _newer_batch(
    core: Core,
    parts: list[tuple[int, list[str]]],
    newer_than: str | Mapping[str, int],
    poll: float,
    race: bool,
) -> tuple[list[ShardRequest], list[Any]]:
    """One newer-than poll per ``(shard, names)`` of ``parts``, each with what the client holds
    of them (the cache's entries, or none)."""
    batch, helds = [], []
    for shard, group in parts:
        if newer_than == "cached":
            held = core.cache.held(group, core.read_era(shard))
            entries = held[0] or [None] * len(group)
            versions = [None if c is None else c[1] for c in entries]
        else:
            assert isinstance(newer_than, Mapping)
            held, versions = (None, None), [newer_than.get(n) for n in group]
        helds.append(held)
        batch.append(_request(core, shard, group, versions, {}, poll, Abort() if race else None))
    return batch, helds


def _newer_taken(
    core: Core,
    request: ShardRequest,
    result: Any,
    held: Any,
    cached: bool,
    out: dict[str, np.ndarray],
) -> list[str]:
    """The values of a newer-than poll's reply that are news, into ``out``; the names to pull
    again (their shard restarted: what it holds is news too)."""
    got: dict[str, np.ndarray] = {}
    message = core.accept(request, result)
    rest = take(core, request, message, held, got)
    if not cached:  # a value came exactly where the version differs
        out.update(got)
        return []
    entries = held[0] or [None] * len(request.names)
    for name, entry in zip(request.names, entries):
        value = got.get(name)
        if value is not None and (entry is None or value is not entry[2]):
            out[name] = value
    if rest and any(e is not None and type(e[2]) is Lent for e in entries):
        # A value the cache lends (pulled into a buffer) is not news at the version it has.
        versions = _versions(core, request, message)
        unchanged = {
            name
            for name, entry, version in zip(request.names, entries, versions)
            if entry is not None and type(entry[2]) is Lent and entry[1] == version
        }
        rest = [name for name in rest if name not in unchanged]
    return rest


def reached(
    core: Core, names: Any, min_version: int, timeout: float | None
) -> Flow[dict[str, np.ndarray]]:
    """``pull(names, min_version=..., timeout=...)``: see the module."""
    names, groups = plan(core, names)
    if not names:
        return {}
    started = time.monotonic()
    end = _end(timeout)
    yield from core.require_fleet(core.deadline())
    out: dict[str, np.ndarray] = {}
    todo = groups
    while True:
        poll = _poll_time(end)
        batch, helds = [], []
        for shard, group in core.fleet.chunks(todo):
            held = core.cache.held(group, core.read_era(shard))
            entries = held[0] or [None] * len(group)
            versions = [None if c is None else c[1] for c in entries]
            helds.append(held)
            batch.append(
                _request(core, shard, group, versions, {"min_version": min_version}, poll, None)
            )
        replies = core.collect(batch, (yield batch))
        again: list[str] = []
        behind: dict[str, int] = {}
        for request, reply, held in zip(batch, replies, helds):
            got: dict[str, np.ndarray] = {}
            rest = take(core, request, reply, held, got)
            if reply.msg.get("ready") is True:
                out.update(got)
                again += rest
                continue
            for name, version in zip(request.names, _versions(core, request, reply)):
                if version < min_version:
                    behind[name] = version
                elif name in got:
                    out[name] = got[name]
            again += [n for n in rest if n not in behind]
        if again:
            out.update((yield from pull(core, again)))
        if not behind:
            return {n: out[n] for n in names}
        if time.monotonic() >= end:
            waited = time.monotonic() - started
            shown = ", ".join(f"{n!r} at {v}" for n, v in list(behind.items())[:10])
            raise NotReadyError(
                f"pull: not every variable reached min_version {min_version} within "
                f"{waited:.1f}s ({shown}{' ...' if len(behind) > 10 else ''}): wait longer "
                "(timeout=...), or check that the pushes that make those versions happen",
                missing=sorted(behind),
            )
        todo = core.fleet.split(list(behind))


def _versions(core: Core, request: ShardRequest, reply: Message) -> list[int]:
    """The versions a poll reply gives, parallel to the request's names."""
    msg = reply.msg
    if "table" in msg:
        versions = msg["table"].get("versions") if isinstance(msg["table"], Mapping) else None
    else:
        variables = msg.get("variables")
        versions = (
            [
                e.get("version") if isinstance(e, Mapping) else None
                for e in map(variables.get, request.names)
            ]
            if isinstance(variables, Mapping)
            else None
        )
    if not isinstance(versions, Sequence) or any(type(v) is not int for v in versions):
        url = core.url(request.shard)
        raise ProtocolError(f"shard {url} sent a poll reply without versions", shard=url)
    return list(versions)
