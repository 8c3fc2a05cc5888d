"""``variables``: a summary of every variable on every shard (``GET /v1/variables``), sorted by
name, each with the index of its shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._core import Core
from .._exceptions import ProtocolError
from .._flow import Flow

__all__ = ["variables"]


def variables(core: Core) -> Flow[list[dict[str, Any]]]:
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    batch = [core.get(i, "/v1/variables", deadline, "variables") for i in range(core.n)]
    replies = core.collect(batch, (yield batch))
    out = []
    for request, reply in zip(batch, replies):
        summaries = reply.msg.get("variables")
        if not isinstance(summaries, list):
            url = core.url(request.shard)
            raise ProtocolError(f"GET {url}/v1/variables sent no 'variables' list", shard=url)
        out += [{**s, "shard": request.shard} for s in summaries if isinstance(s, Mapping)]
    return sorted(out, key=lambda s: str(s.get("name")))
