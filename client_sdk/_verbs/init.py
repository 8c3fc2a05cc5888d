"""``init``: create each variable unless it exists; the first value wins.

Each shard's part is one request (or one per run of ``max_request_names`` variables) mapping
names to ``{value, optimizer}`` and the training mode's fields, if any
(:mod:`client_sdk.modes`). A variable that exists with the same shape and dtype keeps its value
(``created`` false); another shape or dtype is a 409 and that shard creates nothing. Once the
shards hold the variables, the cache learns their layouts (``_cache.py``): a pull of them is
then bounded exactly, and a push of the wrong shape is refused before it is sent.
"""

from __future__ import annotations

from typing import Any

from .. import _args, _replies
from .._core import Core
from .._flow import Flow
from ..modes import ASYNC, Mode

__all__ = ["init"]


def init(
    core: Core, values: Any, optimizer: Any = None, mode: Mode = ASYNC
) -> Flow[dict[str, dict[str, Any]]]:
    arrays = _args.arrays(values, "init", core.fleet)
    specs = _args.optimizer_specs(optimizer, arrays)
    fields = mode.to_wire()
    if not arrays:
        return {}
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    batch = []
    for shard, names in core.fleet.chunks(core.fleet.split(arrays)):
        variables = {}
        for name in names:
            entry: dict[str, Any] = {"value": arrays[name], **fields}
            if specs.get(name) is not None:
                entry["optimizer"] = specs[name]
            variables[name] = entry
        batch.append(
            core.post(
                shard,
                "init",
                {"variables": variables},
                deadline,
                mutating=True,
                names=names,
                retry_safe=True,
                tensors=True,
            )
        )
    replies = core.collect(batch, (yield batch))
    out = _replies.per_variable(batch, replies, "variables", core.shards)
    core.cache.learn(arrays)  # the shards hold these shapes and dtypes now (else: 409)
    return out
