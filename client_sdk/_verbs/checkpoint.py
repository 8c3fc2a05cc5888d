"""``checkpoint``: the whole fleet's state captured at one instant, under one id.

Writes are paused on every shard (a lease: a shard resumes by itself if the client goes
away), each shard captures its state, then every shard resumes and says whether its snapshot
is on disk. If pausing or capturing fails, every shard is told to resume and the failure is
raised; so is a missing snapshot. Shards started with ``--restore <id>`` come back to exactly
this state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from .._core import Core
from .._exceptions import BadRequestError, PSError
from .._flow import Flow, ShardRequest

__all__ = ["checkpoint"]

#: The longest a fleet checkpoint may take (a shard's pause lease is at most 600 s).
MAX_CHECKPOINT_SECONDS = 570.0


def checkpoint(core: Core, timeout: float) -> Flow[str]:
    """Pause writes on every shard, have each capture its state, resume, and wait until
    every snapshot is on disk; return the checkpoint's id.

    If pausing or capturing fails, every shard is told to resume (each would anyway once
    the pause's lease runs out) and the failure is raised; so is a failed write.
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_CHECKPOINT_SECONDS
    ):
        raise BadRequestError(
            f"checkpoint timeout must be seconds in (0, "
            f"{MAX_CHECKPOINT_SECONDS:g}], got {timeout!r}"
        )
    checkpoint_id = time.strftime("ckpt-%Y%m%dT%H%M%SZ-", time.gmtime()) + os.urandom(3).hex()
    deadline = core.deadline(timeout)
    yield from core.require_fleet(deadline)
    lease = min(MAX_CHECKPOINT_SECONDS, timeout + 30.0)
    shards = range(core.n)

    def round_(verb: str, msg: dict[str, Any]) -> list[ShardRequest]:
        return [
            core.post(
                i,
                verb,
                msg,
                deadline,
                mutating=True,
                retry_safe=True,
                timeout=timeout,
                max_reply=core.max_reply,
            )
            for i in shards
        ]

    msg = {"checkpoint": checkpoint_id}
    try:
        pause = round_("pause", {**msg, "lease": lease})
        core.collect(pause, (yield pause))
        snapshot = round_("snapshot", msg)
        core.collect(snapshot, (yield snapshot))
    except PSError:
        resume = round_("resume", msg)
        yield resume
        raise
    resume = round_("resume", msg)
    for request, reply in zip(resume, core.collect(resume, (yield resume))):
        if not isinstance(reply.msg.get("snapshot"), Mapping):
            url = core.url(request.shard)
            raise PSError(
                f"checkpoint {checkpoint_id} is incomplete: shard {url} has no "
                "snapshot of it (did it restart during the checkpoint?); take "
                "another",
                shard=url,
            )
    return checkpoint_id
