"""``delete``: remove variables from the shards, to start a run over.

The variables are a list of names, or a prefix string that every shard matches against what it
holds, counters included (``_targets.py``). Deleting what is not there removes nothing and is
no error; the result lists what was removed, sorted. A write like a push: this worker's id and
a ``seq`` make a retry apply at most once (a retry answered ``duplicate`` lists nothing: its
first attempt removed them). The client forgets the values it cached of those names: one made
again under a name starts over at version 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import _args, partitions
from .._core import Core
from .._exceptions import ProtocolError
from .._flow import Flow, ShardRequest
from .._replies import Message
from . import _targets

__all__ = ["delete"]


def delete(core: Core, target: Any) -> Flow[list[str]]:
    names, prefix = _args.target(target, "delete", core.fleet)
    if names == []:
        return []
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    batch = _targets.requests(core, "delete", names, prefix, {}, deadline)
    try:
        replies = core.collect(batch, (yield batch))
    finally:  # whatever was removed, even where another shard refused, is not to be offered
        core.cache.forget(names or (), prefix)
        core.parts.forget(names or (), prefix)
    deleted = _deleted(core, batch, replies)
    # A partitioned variable's parts, named by the layouts removed (a prefix matched them).
    parts = [
        part
        for reply in replies
        for name, entry in _layouts(reply).items()
        if isinstance(entry, dict) and type(entry.get("partitions")) is int
        for part in (partitions.part_name(name, i) for i in range(entry["partitions"]))
        if part not in deleted
    ]
    if parts and prefix is None:
        batch = _targets.requests(core, "delete", parts, None, {}, deadline)
        try:
            replies = core.collect(batch, (yield batch))
        finally:
            core.cache.forget(parts)
        deleted += _deleted(core, batch, replies)
    return sorted(deleted)


def _deleted(core: Core, batch: list[ShardRequest], replies: list[Message]) -> list[str]:
    deleted: list[str] = []
    for request, reply in zip(batch, replies):
        got = reply.msg.get("deleted")
        if not isinstance(got, list) or not all(isinstance(n, str) for n in got):
            url = core.shards[request.shard]
            raise ProtocolError(
                f"shard {url} sent a delete reply without a 'deleted' list", shard=url
            )
        deleted += got
    return deleted


def _layouts(reply: Message) -> Mapping[str, Any]:
    """The layouts a delete reply says it removed (``partitioned``); none if it says none."""
    found = reply.msg.get("partitioned")
    return found if isinstance(found, Mapping) else {}
