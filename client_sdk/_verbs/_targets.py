"""The requests of a verb that names variables or a prefix of their names (``set_optimizer``,
``delete``): a list of names goes to the shards that own them, one request per shard (or per
run of its ``max_request_names``); a prefix goes to every shard, each matching what it holds.
Each request is a write: this worker's id and its own ``seq``. A shard that does not list the
verb in its features is refused before anything is sent (:meth:`Fleet.require
<client_sdk._fleet.Fleet.require>`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .. import wire
from .._core import REPLY_HEADROOM, REPLY_PER_NAME, Core
from .._exceptions import ProtocolError
from .._flow import ShardRequest
from .._replies import Message

__all__ = ["merged", "requests"]


def requests(
    core: Core,
    verb: str,
    names: list[str] | None,
    prefix: str | None,
    fields: Mapping[str, Any],
    deadline: float,
) -> list[ShardRequest]:
    """One request per shard (and run of names) carrying ``fields`` and ``names`` or
    ``prefix``. A prefix's reply is bounded by the most names its shard may match."""
    worker_id = core.settings.worker_id
    feature = {"set_optimizer": wire.FEATURE_SET_OPTIMIZER, "delete": wire.FEATURE_DELETE}[verb]
    if prefix is not None:
        for shard in range(core.n):
            core.fleet.require(shard, feature, verb)
        return [
            core.post(
                shard,
                verb,
                {"prefix": prefix, **fields, "worker_id": worker_id, "seq": core.next_seq()},
                deadline,
                mutating=True,
                retry_safe=True,
                max_reply=REPLY_HEADROOM + REPLY_PER_NAME * core.fleet.max_names[shard],
            )
            for shard in range(core.n)
        ]
    assert names is not None
    parts = core.fleet.chunks(core.fleet.split(names))
    for shard, _ in parts:
        core.fleet.require(shard, feature, verb)
    return [
        core.post(
            shard,
            verb,
            {"names": part, **fields, "worker_id": worker_id, "seq": core.next_seq()},
            deadline,
            mutating=True,
            names=part,
            retry_safe=True,
        )
        for shard, part in parts
    ]


def merged(
    batch: list[ShardRequest], replies: list[Message], key: str, urls: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """The maps ``key`` of every reply, merged: name -> its entry (a prefix's matches, which
    the client cannot list beforehand)."""
    out: dict[str, dict[str, Any]] = {}
    for request, reply in zip(batch, replies):
        entries = reply.msg.get(key)
        if not isinstance(entries, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Mapping) for k, v in entries.items()
        ):
            url = urls[request.shard]
            raise ProtocolError(
                f"shard {url} sent a {request.verb} reply without a '{key}' map", shard=url
            )
        out.update((k, dict(v)) for k, v in entries.items())
    return out
