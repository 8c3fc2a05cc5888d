"""Partitioned variables (:mod:`client_sdk.partitions`) through every verb: each public verb's
flow, which hands plain variables to the verb's own flow unchanged and addresses a partitioned
variable's parts.

* ``init``: a variable given ``partitions=k`` (``k >= 2``), or bigger than the fleet's
  ``partition_bytes`` without ``partitions``, is made in two rounds: its layout at the shard
  that owns its name (which decides it: a different one is 409 naming the field), then its
  parts as variables of their own, with the variable's optimizer.
* ``pull`` / ``poll``: the parts are pulled (each one only if it changed, as any variable) and
  put together along axis 0; the whole is rebuilt only when a part changed. Pulled into a
  caller's buffer (``out=``), each part is received (or written) straight into the buffer's
  rows instead (``_into.py``).
* ``push`` / ``assign``: the gradient or value, of the variable's full shape, is split into
  views of the parts, one per part, in the same requests as the rest.
* ``versions``: a partitioned variable's version is the lowest of its parts' (each push and
  assign through the SDK moves every part by one, so they go together).

A name the client does not know (never made, pulled or looked up by it) is looked up before a
write (``POST /v1/wait`` with no wait: the reply says which names are partitioned), so a
write's ``seq`` is never spent on a request refused for naming a partitioned variable. A read
naming one is refused by the name's shard (409 ``partitioned``, carrying the layout), and then
made again with the parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np

from .. import _args, _into, _replies
from .._core import Core
from .._exceptions import BadRequestError, BadTensorError, PartitionedError, UnknownVariableError
from .._flow import Flow
from .._parts import fold_results
from ..modes import ASYNC, Mode
from ..partitions import Layout, LayoutError, auto_partitions
from .assign import assign as _assign
from .init import init as _init
from .poll import poll as _poll
from .pull import pull as _pull
from .push import PushJob, prepare_push
from .push import push as _push
from .set_optimizer import set_optimizer as _set_optimizer

__all__ = [
    "assign",
    "init",
    "poll",
    "pull",
    "push",
    "push_job",
    "resolve",
    "send_push",
    "set_optimizer",
    "versions",
]

Arrays = dict[str, np.ndarray]
#: How often a read learns a layout and starts again before the error is raised.
_RELEARN = 3


# -- looking names up -----------------------------------------------------------------------


def resolve(core: Core, names: list[str]) -> Flow[None]:
    """Learn which of ``names`` are partitioned (and their layouts) from their shards."""
    if not names:
        return None
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    batch = [
        core.post(
            shard, "wait", {"names": group, "timeout": 0}, deadline, mutating=False, names=group
        )
        for shard, group in core.fleet.chunks(core.fleet.split(names))
    ]
    replies = core.collect(batch, (yield batch))
    for request, reply in zip(batch, replies):
        found = reply.msg.get("partitioned") or {}
        learned = core.parts.learn(found, core.url(request.shard))
        missing = reply.msg.get("missing")
        absent = set(missing) if isinstance(missing, list) else set()
        taken = {layout.name for layout in learned} | absent
        core.parts.learn_plain(n for n in request.names if n not in taken)
    return None


def _lookup(core: Core, values: Any, verb: str) -> Flow[None]:
    """Before a write: look up those of ``values``' names this client knows nothing of
    (:func:`_unknown`), once the fleet was seen to hold partitioned variables."""
    if not core.parts and not core.fleet.partitioned:
        if not core.fleet.unchecked():
            return None  # none seen anywhere: a refusal teaches the first
        _args.arrays(values, verb, core.fleet)  # its errors before anything is sent
        yield from core.require_fleet(core.deadline())
        if not core.fleet.partitioned:
            return None
    unknown = _unknown(core, values)
    if unknown:
        _args.arrays(values, verb, core.fleet)  # its errors before anything is sent
        yield from resolve(core, _args.names(unknown, verb, core.fleet))
    return None


def _unknown(core: Core, names: Mapping[str, Any]) -> list[str]:
    """Those of ``names`` this client knows nothing of: neither a layout, nor a value or
    shape it pulled or made (those are plain: learned here as such)."""
    unknown = core.parts.unknown(names)
    if unknown:
        known = core.cache.shapes(unknown)
        if known:
            core.parts.learn_plain(known)
            unknown = [n for n in unknown if n not in known]
    return unknown


def _relearned(core: Core, exc: Exception) -> bool:
    """Learn from a refusal that a layout is new or stale; whether the call may start again."""
    if isinstance(exc, PartitionedError):
        details = exc.details if isinstance(exc.details, Mapping) else {}
        layouts = details.get("layouts")
        if not layouts:
            return False
        learned = core.parts.learn(layouts, exc.shard)
        # what is cached under these names is of variables deleted since
        core.cache.forget([n for lay in learned for n in (lay.name, *lay.part_names())])
        return True
    if isinstance(exc, UnknownVariableError):  # a part gone: the variable was deleted
        details = exc.details if isinstance(exc.details, Mapping) else {}
        stale = {
            n.rsplit("/part-", 1)[0]
            for n in details.get("missing") or ()
            if isinstance(n, str) and "/part-" in n
        }
        stale = {n for n in stale if core.parts.get(n) is not None}
        _drop(core, stale)
        return bool(stale)
    return False


def _drop(core: Core, names: Iterable[str]) -> None:
    """Forget the layouts of ``names``, and what the cache holds of their parts."""
    for name in names:
        layout = core.parts.get(name)
        if layout is not None:
            core.cache.forget(layout.part_names())
        core.parts.forget([name])


def _expand(names: list[str], layouts: Mapping[str, Layout]) -> list[str]:
    out: list[str] = []
    for name in names:
        layout = layouts.get(name)
        if layout is None:
            out.append(name)
        else:
            out += layout.part_names()
    return out


# -- reads ----------------------------------------------------------------------------------


def pull(core: Core, names: Any, out: Any = None) -> Flow[dict[str, np.ndarray]]:
    """A pull; with ``out`` (name -> the caller's buffer) each of those values is written into
    its buffer (:mod:`client_sdk._into`) and a partitioned one's parts straight into its rows."""
    views = _targets(core, names, out)
    for attempt in range(_RELEARN + 1):
        layouts = core.parts.of(names)
        try:
            if not layouts:
                got = yield from _pull(core, names, views)
                return got if views is None else _written(views, got)
            checked = _args.names(names, "pull", core.fleet)
            whole = yield from _pull_parts(core, checked, layouts, views or {}, True)
            return _written(views, whole) if views is not None else cast(Arrays, whole)
        except (PartitionedError, UnknownVariableError, _Stale) as exc:
            if attempt == _RELEARN or not (isinstance(exc, _Stale) or _relearned(core, exc)):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _targets(core: Core, names: Any, out: Any) -> dict[str, np.ndarray] | None:
    """``out``'s buffers checked against what this client knows of the names (none: None)."""
    if out is None:
        return None
    checked = _args.names(names, "pull", core.fleet)
    known = core.cache.shapes(checked)
    for name, layout in core.parts.of(checked).items():
        known[name] = (layout.shape, np.dtype(layout.dtype))
    return _into.targets(out, checked, known)


def _written(
    views: Mapping[str, np.ndarray], got: Mapping[str, _into.Value]
) -> dict[str, np.ndarray]:
    _into.check(views, got)
    return _into.write(views, got)


class _Stale(Exception):
    """A pulled part does not fit the layout known of its variable: it was made again."""


def _pull_parts(
    core: Core,
    names: list[str],
    layouts: Mapping[str, Layout],
    views: Mapping[str, np.ndarray],
    receive: bool = False,
) -> Flow[dict[str, _into.Value]]:
    """Pull ``names`` (partitioned ones by their parts); with ``receive``, each value with a
    buffer in ``views`` received into it where it fits, a partitioned one's parts into its
    rows (``_into.py``)."""
    into: dict[str, np.ndarray] | None = None
    if receive and views:
        into = {}
        for name, view in views.items():
            layout = layouts.get(name)
            if layout is None:
                into[name] = view
            elif view.shape == layout.shape:
                into.update(zip(layout.part_names(), layout.split(view)))
    got = yield from _pull(core, _expand(names, layouts), into)
    return _assembled(core, names, layouts, got, views)


def _assembled(
    core: Core,
    names: list[str],
    layouts: Mapping[str, Layout],
    got: Mapping[str, np.ndarray],
    views: Mapping[str, np.ndarray],
) -> dict[str, _into.Value]:
    """Each variable's value; a partitioned one put together from its parts, or, when it has
    a buffer in ``views``, its parts as they are (written into the buffer's rows later)."""
    out: dict[str, _into.Value] = {}
    for name in names:
        layout = layouts.get(name)
        if layout is None:
            out[name] = got[name]
            continue
        parts = [got[p] for p in layout.part_names()]
        if name in views:
            dtype = np.dtype(layout.dtype)
            if [p.shape for p in parts] != layout.part_shapes() or any(
                p.dtype != dtype for p in parts
            ):
                _drop(core, [name])
                raise _Stale(name)
            out[name] = (layout, parts)
            continue
        full = core.parts.assemble(layout, parts)
        if full is None:
            _drop(core, [name])
            raise _Stale(name)
        out[name] = full
    return out


def poll(
    core: Core, names: Any, newer_than: Any, min_version: Any, timeout: Any, out: Any = None
) -> Flow[dict[str, np.ndarray]]:
    views = _targets(core, names, out)
    for attempt in range(_RELEARN + 1):
        layouts = core.parts.of(names)
        try:
            if not layouts:
                got = yield from _poll(core, names, newer_than, min_version, timeout)
            else:
                got = yield from _poll_parts(core, names, layouts, newer_than, min_version, timeout)
            return got if views is None else _written(views, got)
        except (PartitionedError, UnknownVariableError, _Stale) as exc:
            if attempt == _RELEARN or not (isinstance(exc, _Stale) or _relearned(core, exc)):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _poll_parts(
    core: Core,
    names: Any,
    layouts: Mapping[str, Layout],
    newer_than: Any,
    min_version: Any,
    timeout: Any,
) -> Flow[dict[str, np.ndarray]]:
    checked = _args.names(names, "pull", core.fleet)
    if isinstance(newer_than, Mapping):  # a partitioned variable's version stands for each part
        given = dict(newer_than)
        newer_than = {}
        for name, version in given.items():
            layout = layouts.get(name)
            for part in layout.part_names() if layout is not None else (name,):
                newer_than[part] = version
    got = yield from _poll(core, _expand(checked, layouts), newer_than, min_version, timeout)
    changed = [
        name
        for name in checked
        if name in got or (name in layouts and any(p in got for p in layouts[name].part_names()))
    ]
    partitioned = [name for name in changed if name in layouts]
    whole = (yield from _pull_parts(core, partitioned, layouts, {})) if partitioned else {}
    arrays = cast(Arrays, whole)  # no buffers given: every partitioned one was put together
    return {name: arrays[name] if name in layouts else got[name] for name in changed}


def versions(core: Core, names: Any) -> dict[str, int]:
    """:meth:`PSClient.versions`: a partitioned variable's is the lowest of its parts'."""
    checked = _args.names(names, "versions", core.fleet)
    layouts = core.parts.of(checked)
    held = core.cache.versions(_expand(checked, layouts) if layouts else checked)
    if not layouts:
        return held
    out = {}
    for name in checked:
        layout = layouts.get(name)
        if layout is None:
            if name in held:
                out[name] = held[name]
            continue
        parts = [held[p] for p in layout.part_names() if p in held]
        if len(parts) == layout.parts:
            out[name] = min(parts)
    return out


# -- writes ---------------------------------------------------------------------------------


def _mapping(values: Any, verb: str) -> Mapping[str, Any]:
    if not isinstance(values, Mapping):
        raise BadRequestError(f"{verb} takes a dict of name -> array, got {type(values).__name__}")
    return values


def _split(
    core: Core, values: Mapping[str, Any], verb: str, what: str
) -> tuple[Mapping[str, Any], dict[str, Layout]]:
    """``values`` with each partitioned variable's array split into its parts' (views): its
    full shape checked first (:class:`BadTensorError` naming the variable)."""
    layouts = core.parts.of(values)
    if not layouts:
        return values, {}
    out: dict[str, Any] = {}
    for name, value in values.items():
        layout = layouts.get(name)
        if layout is None:
            out[name] = value
            continue
        array = _args.as_array(name, value)
        if array.shape != layout.shape:
            raise BadTensorError(
                f"{verb}: {what} of {name!r} has shape {list(array.shape)}, but the variable "
                f"is {list(layout.shape)} (partitioned in {layout.parts} parts): give the "
                "whole variable's shape",
                code="bad_tensor",
                details={
                    "variable": name,
                    "shape": list(array.shape),
                    "expected_shape": list(layout.shape),
                },
            )
        out.update(zip(layout.part_names(), layout.split(array)))
    return out, layouts


def push_job(
    core: Core, grads: Any, versions: Mapping[str, int] | None = None, *, copy: bool = False
) -> Flow[PushJob]:
    """:func:`push.prepare_push` for any variables: unknown names looked up first."""
    grads = _mapping(grads, "push")
    yield from _lookup(core, grads, "push")
    split, layouts = _split(core, grads, "push", "gradient")
    if layouts and versions is not None and isinstance(versions, Mapping):
        given, versions = versions, {}
        for name, version in given.items():
            layout = layouts.get(name)
            for part in layout.part_names() if layout is not None else (name,):
                versions[part] = version
    job = prepare_push(core, split, versions, copy=copy)
    job.layouts = layouts
    return job


def push(
    core: Core, grads: Any, versions: Mapping[str, int] | None = None
) -> Flow[dict[str, dict[str, Any]]]:
    job = yield from push_job(core, grads, versions)
    return (yield from send_push(core, job))


def send_push(core: Core, job: PushJob) -> Flow[dict[str, dict[str, Any]]]:
    """:func:`push.push`, learning from a refusal that names a partitioned variable."""
    try:
        return (yield from _push(core, job))
    except PartitionedError as exc:
        raise _learned(core, exc) from None


def _learned(core: Core, exc: PartitionedError) -> PartitionedError:
    """A write refused for naming a partitioned variable this client did not know as one:
    learn its layout, so that the call made again addresses its parts."""
    if _relearned(core, exc):
        exc.message += "; this client has learned its layout now: make the call again"
        exc.args = (exc.message,)
    return exc


def assign(core: Core, values: Any) -> Flow[dict[str, dict[str, Any]]]:
    values = _mapping(values, "assign")
    yield from _lookup(core, values, "assign")
    split, layouts = _split(core, values, "assign", "value")
    try:
        return fold_results((yield from _assign(core, split)), layouts)
    except PartitionedError as exc:
        raise _learned(core, exc) from None


def set_optimizer(
    core: Core, target: Any, spec: Any = None, frozen: Any = None
) -> Flow[dict[str, dict[str, Any]]]:
    """A list of names with each partitioned variable's parts in its place (a prefix matches
    the parts on their shards by itself)."""
    if isinstance(target, (str, bytes)) or not isinstance(target, (list, tuple)):
        return (yield from _set_optimizer(core, target, spec, frozen))
    named = dict.fromkeys(n for n in target if isinstance(n, str))
    if named and core.fleet.unchecked():
        _args.target(target, "set_optimizer", core.fleet)  # its errors before anything is sent
        yield from core.require_fleet(core.deadline())
    if core.parts or core.fleet.partitioned:
        unknown = _unknown(core, named)
        if unknown:
            yield from resolve(core, _args.names(unknown, "set_optimizer", core.fleet))
    layouts = core.parts.of(target)
    for name in layouts:
        _no_clip(spec, name)
    names = _expand(list(target), layouts) if layouts else target
    try:
        return fold_results((yield from _set_optimizer(core, names, spec, frozen)), layouts)
    except PartitionedError as exc:
        raise _learned(core, exc) from None


def init(
    core: Core, values: Any, optimizer: Any, mode: Mode, partitions: Any
) -> Flow[dict[str, dict[str, Any]]]:
    arrays = _args.arrays(values, "init", core.fleet)
    _args.optimizer_specs(optimizer, arrays)  # its errors before anything is sent
    if not arrays:
        return {}
    deadline = core.deadline()
    yield from core.require_fleet(deadline)  # the fleet's partition_bytes
    layouts = _layouts(core, arrays, partitions)
    if not layouts:
        result = yield from _init(core, arrays, optimizer, mode)
        core.parts.learn_plain(arrays)
        return result
    if mode != ASYNC:
        raise BadRequestError(
            f"init: {next(iter(layouts))!r} is partitioned, and a partitioned variable trains "
            "asynchronously only: sync rounds and max_staleness would be decided per part. "
            "Init it with partitions=1, or without a training mode"
        )
    for name in layouts:
        _no_clip(optimizer.get(name) if isinstance(optimizer, Mapping) else optimizer, name)
    made = yield from _record(core, layouts, deadline)
    split, _ = _split(core, arrays, "init", "value")
    if isinstance(optimizer, Mapping):
        optimizer = {
            part: spec
            for name, spec in optimizer.items()
            for part in (layouts[name].part_names() if name in layouts else (name,))
        }
    result = fold_results((yield from _init(core, split, optimizer, mode)), layouts)
    core.parts.learn_plain(n for n in arrays if n not in layouts)
    for name, layout in layouts.items():
        result[name] = {
            "version": result[name]["version"],
            "created": made[name].get("created"),
            "partitions": layout.parts,
        }
    return result


def _no_clip(spec: Any, name: str) -> None:
    """Refuse gradient clipping by norm for a partitioned variable: each part would be clipped
    by its own norm, not the variable's."""
    if getattr(spec, "clip_norm", None) is not None:
        raise BadRequestError(
            f"{name!r} is partitioned, and clip_norm would clip each part's gradient by the "
            "part's own norm, not the variable's: clip on the worker, or do not partition it",
            details={"variable": name, "field": "optimizer.clip_norm"},
        )


def _layouts(core: Core, arrays: Mapping[str, np.ndarray], partitions: Any) -> dict[str, Layout]:
    """The layout of each variable of ``arrays`` to partition: ``partitions`` (an int for all,
    or name -> int), else the fleet's ``partition_bytes``."""
    if partitions is not None and not isinstance(partitions, Mapping):
        partitions = dict.fromkeys(arrays, partitions)
    out = {}
    for name, array in arrays.items():
        k = None if partitions is None else partitions.get(name)
        if k is None:
            k = auto_partitions(array.shape, array.itemsize, core.fleet.partition_bytes)
        if type(k) is int and k == 1:
            continue  # a plain variable (whatever its shape)
        try:
            layout = Layout.make(name, array.dtype, array.shape, k)
        except LayoutError as exc:
            raise BadRequestError(
                f"init: {name}: {exc}", details={"variable": name, "field": exc.field}
            ) from None
        if layout.parts > 1:
            out[name] = layout
    return out


def _record(
    core: Core, layouts: Mapping[str, Layout], deadline: float
) -> Flow[dict[str, dict[str, Any]]]:
    """Record the layouts at the shards that own the variables' names (first round of init)."""
    batch = [
        core.post(
            shard,
            "init",
            {"variables": {name: layouts[name].to_wire() for name in names}},
            deadline,
            mutating=True,
            names=names,
            retry_safe=True,
        )
        for shard, names in core.fleet.chunks(core.fleet.split(layouts))
    ]
    replies = core.collect(batch, (yield batch))
    made = _replies.per_variable(batch, replies, "variables", core.shards)
    core.parts.learn({name: layout.to_wire() for name, layout in layouts.items()})
    return made
