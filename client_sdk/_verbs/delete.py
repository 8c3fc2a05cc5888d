"""``delete``: remove variables from the shards, to start a run over.

The variables are a list of names, or a prefix string that every shard matches against what it
holds, counters included (``_targets.py``). Deleting what is not there removes nothing and is
no error; the result lists what was removed, sorted. A write like a push: this worker's id and
a ``seq`` make a retry apply at most once (a retry answered ``duplicate`` lists nothing: its
first attempt removed them). The client forgets the values it cached of those names: one made
again under a name starts over at version 0.
"""

from __future__ import annotations

from typing import Any

from .. import _args
from .._core import Core
from .._exceptions import ProtocolError
from .._flow import Flow
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
    deleted: list[str] = []
    for request, reply in zip(batch, replies):
        got = reply.msg.get("deleted")
        if not isinstance(got, list) or not all(isinstance(n, str) for n in got):
            url = core.shards[request.shard]
            raise ProtocolError(
                f"shard {url} sent a delete reply without a 'deleted' list", shard=url
            )
        deleted += got
    return sorted(deleted)
