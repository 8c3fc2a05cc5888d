"""``assign``: overwrite existing variables (same shape; the shard casts to the variable's
dtype), keeping their optimizer state. A write like a push: this worker's id and a ``seq``
make a retry apply at most once."""

from __future__ import annotations

from typing import Any

from .. import _args, _replies
from .._core import Core
from .._flow import Flow

__all__ = ["assign"]


def assign(core: Core, values: Any) -> Flow[dict[str, dict[str, Any]]]:
    arrays = _args.arrays(values, "assign", core.fleet)
    if not arrays:
        return {}
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    batch = [
        core.post(
            shard,
            "assign",
            {
                "values": {k: arrays[k] for k in names},
                "worker_id": core.settings.worker_id,
                "seq": core.next_seq(),
            },
            deadline,
            mutating=True,
            names=names,
            retry_safe=True,
            tensors=True,
        )
        for shard, names in core.fleet.chunks(core.fleet.split(arrays))
    ]
    replies = core.collect(batch, (yield batch))
    return _replies.per_variable(batch, replies, "variables", core.shards)
