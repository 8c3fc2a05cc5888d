"""``push``: gradients sent to the variables' shards, applied there by each one's optimizer.

A push is prepared in the caller's thread (:func:`prepare_push`: gradients converted, and
copied for a background push, the versions they were computed on chosen, a ``seq`` taken),
then sent by :func:`push`, at once or later by the background pusher (``_pusher.py``), which
may add a newer push into one still waiting (:func:`merge_push`). :func:`check_push` refuses
before sending what a shard is sure to refuse, as far as the client knows the variables.

Each shard's part is one request (or one per run of ``max_request_names`` gradients, each with a
``seq`` of its own), a tensor table where the shard takes one. The shard validates its whole
part before applying any of it; the ``seq`` makes a retry apply at most once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _args, _replies, wire
from .._core import Core
from .._exceptions import BadRequestError, BadTensorError
from .._flow import Flow
from .._parts import fold_results
from ..partitions import Layout
from ..wire import halves
from ..wire.tensors import dtype_str
from .pull import half_on

__all__ = ["PushJob", "check_push", "merge_push", "prepare_push", "push"]


@dataclass
class PushJob:
    """A push prepared in the caller's thread: converted gradients, versions and ``seq``."""

    grads: dict[str, np.ndarray]
    versions: dict[str, int]
    seq: int
    #: The partitioned variables whose parts it pushes: their results are folded into one.
    layouts: dict[str, Layout] = field(default_factory=dict)
    #: Whether every gradient is the job's own copy (so coalescing may add into it in place);
    #: False once one is the caller's own buffer, lent (``push_async(copy=False)``).
    owned: bool = True


def prepare_push(
    core: Core, grads: Any, versions: Mapping[str, int] | None = None, *, copy: bool = False
) -> PushJob:
    """Convert gradients and choose versions and ``seq`` in the caller's thread.

    ``versions`` defaults to the versions this client last pulled for those names.
    ``copy`` snapshots the gradients (for pushes that run while the caller goes on).
    """
    arrays = _args.arrays(grads, "push", core.fleet, copy=copy)
    if versions is None:
        chosen = core.cache.versions(arrays)
    else:
        if not isinstance(versions, Mapping):
            raise BadRequestError("push versions must be a dict of name -> int version")
        chosen = {}
        for k, v in versions.items():
            if k in arrays:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                    raise BadRequestError(f"push: version of {k!r} must be an int >= 0, got {v!r}")
                chosen[k] = int(v)
    return PushJob(arrays, chosen, core.next_seq(), owned=copy)


def check_push(core: Core, job: PushJob) -> None:
    """Raise :class:`BadTensorError` for a gradient the shard is sure to refuse, as far as
    this client knows its variable (from its init or its last pull): another shape, or a
    dtype that is not a float one (or a variable that is not). Unknown variables pass."""
    layouts = core.cache.shapes(job.grads)
    for name, (shape, dtype) in layouts.items():
        grad = job.grads[name]
        if grad.shape != shape or grad.dtype.kind != "f" or dtype.kind != "f":
            raise BadTensorError(
                f"push: gradient of {name!r} is {grad.dtype.str} {list(grad.shape)}, "
                f"but the variable is {dtype.str} {list(shape)}: a gradient must have "
                "its variable's shape and a float dtype (of a float variable)",
                code="bad_tensor",
                details={
                    "variable": name,
                    "shape": list(grad.shape),
                    "expected_shape": list(shape),
                },
            )


def merge_push(into: PushJob, new: PushJob) -> None:
    """Add ``new``'s gradients into ``into`` (a push not yet sent), for coalescing. A
    variable's version becomes the older of the two, so staleness is never understated. A
    caller's lent buffer is never added into: the sum is a new array then."""
    into.layouts.update(new.layouts)
    owned = into.owned
    into.owned = owned and new.owned
    for name, grad in new.grads.items():
        have = into.grads.get(name)
        if have is None:
            into.grads[name] = grad
        elif have.shape != grad.shape:
            raise BadTensorError(
                f"push_async(coalesce=True): gradient of {name!r} has shape "
                f"{list(grad.shape)}, but the push it would be added to has "
                f"{list(have.shape)}",
                code="bad_tensor",
                details={"variable": name},
            )
        elif owned and have.dtype == grad.dtype:
            np.add(have, grad, out=have)
        else:
            into.grads[name] = np.add(have, grad)
        if name in new.versions:
            old = into.versions.get(name)
            into.versions[name] = (
                new.versions[name] if old is None else min(old, new.versions[name])
            )


def push(core: Core, job: PushJob) -> Flow[dict[str, dict[str, Any]]]:
    if not job.grads:
        return {}
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    fleet = core.fleet
    worker_id = core.settings.worker_id
    batch = []
    grads = job.grads
    wire_dtype = core.settings.wire_dtype
    types: dict[str, str] | None = None
    if wire_dtype is not None:
        grads, types = _narrowed(core, grads, wire_dtype)
    first = set()
    for shard, names in fleet.chunks(fleet.split(grads)):
        # A shard's further requests (a batch above its max_request_names) are writes of
        # their own, each with a seq of its own.
        seq = job.seq if shard not in first else core.next_seq()
        first.add(shard)
        msg: dict[str, Any] = {"worker_id": worker_id, "seq": seq}
        held = job.versions
        versions = {k: held[k] for k in names if k in held} if held else None
        if versions:
            msg["versions"] = versions
        if fleet.tables[shard]:  # one tensor table: a fraction of the header to pack
            table = msg["grads"] = {"names": names}
            msg["layout"] = "table"
            batch.append(
                core.post(
                    shard,
                    "push",
                    msg,
                    deadline,
                    mutating=True,
                    names=names,
                    retry_safe=True,
                    table=table,
                    arrays=[grads[k] for k in names],
                    dtypes=None if types is None else [types[k] for k in names],
                )
            )
            continue
        msg["grads"] = {k: grads[k] for k in names}
        batch.append(
            core.post(
                shard,
                "push",
                msg,
                deadline,
                mutating=True,
                names=names,
                retry_safe=True,
                tensors=True,
            )
        )
    replies = core.collect(batch, (yield batch))
    results = _replies.per_variable(batch, replies, "variables", core.shards)
    return fold_results(results, job.layouts) if job.layouts else results


def _narrowed(
    core: Core, grads: dict[str, np.ndarray], wire_dtype: str
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``grads`` as they go on the wire with ``PSClient(wire_dtype=)``: each float32 one
    narrowed to ``wire_dtype``, the others as they are; and each one's type string. The
    shards are checked for the feature first; :class:`BadTensorError` for a gradient beyond
    float16's range, before anything is sent."""
    for shard in core.fleet.split(grads):
        half_on(core, shard)
    out, types = {}, {}
    for name, grad in grads.items():
        if grad.dtype == np.float32:
            try:
                out[name], types[name] = halves.narrow(
                    grad, wire_dtype, f"push: gradient of {name!r}"
                )
            except wire.WireError as exc:
                raise BadTensorError(
                    exc.message, code="bad_tensor", details={"variable": name}
                ) from None
        else:
            out[name], types[name] = grad, dtype_str(grad.dtype)
    return out, types
