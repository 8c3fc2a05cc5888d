"""``wait_ready``: block until named variables exist (some worker called ``init``), through
shards that are not up yet, until a timeout.

Each shard holds a long poll (``/v1/wait``) for its missing names, in rounds of at most
:data:`WAIT_POLL_SECONDS` so that progress shows; an unreachable shard is retried until the
timeout. What never appeared is in the :class:`NotReadyError`'s ``missing``. A partitioned
variable is ready when its layout and every part exist: the reply that finds its layout
(``partitioned``) adds its parts to what is waited for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from .. import _args
from .._core import Core
from .._exceptions import (
    BadRequestError,
    NotReadyError,
    ProtocolError,
    PSError,
    ShardUnavailableError,
)
from .._flow import Flow

__all__ = ["wait"]

#: The shard's own long-poll limit is 30 s; poll in shorter rounds so progress is visible.
WAIT_POLL_SECONDS = 10.0
#: Extra read time for a long-poll beyond the time the shard was asked to hold it.
WAIT_READ_SLACK = 10.0


def wait(core: Core, names: Any, timeout: float | None) -> Flow[None]:
    names = _args.names(names, "wait_ready", core.fleet)
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise BadRequestError(f"wait_ready timeout must be seconds >= 0 or None, got {timeout!r}")
    started = time.monotonic()
    deadline = math.inf if timeout is None else started + timeout
    missing = core.fleet.split(names)
    # Unreachable shards are retried until the deadline (by the shells), so a shard
    # reported unreachable means the time is up.
    unreachable = yield from core.check_fleet(deadline)
    first = True
    while True:
        missing = {shard: group for shard, group in missing.items() if group}
        if not missing:
            return None
        remaining = deadline - time.monotonic()
        if unreachable or (remaining <= 0 and not first):
            raise _not_ready(core, missing, unreachable, time.monotonic() - started)
        first = False
        poll = max(0.0, min(remaining, WAIT_POLL_SECONDS))
        batch = [
            core.post(
                shard,
                "wait",
                {"names": group, "timeout": poll},
                deadline,
                mutating=False,
                names=group,
                timeout=poll + WAIT_READ_SLACK,
            )
            for shard, group in core.fleet.chunks(missing)
        ]
        results = yield batch
        missing = {}
        for request, result in zip(batch, results):
            if isinstance(result, ShardUnavailableError):
                unreachable[request.shard] = result
                missing.setdefault(request.shard, []).extend(request.names)
                continue
            msg = core.accept(request, result).msg
            still = msg.get("missing")
            if not isinstance(still, list):
                url = core.url(request.shard)
                raise ProtocolError(f"shard {url} sent a wait reply without 'missing'", shard=url)
            missing.setdefault(request.shard, []).extend(n for n in still if isinstance(n, str))
            found = msg.get("partitioned")
            if found:
                for layout in core.parts.learn(found, core.url(request.shard)):
                    for shard, parts in core.fleet.split(layout.part_names()).items():
                        missing.setdefault(shard, []).extend(parts)


def _not_ready(
    core: Core, missing: dict[int, list[str]], unreachable: Mapping[int, PSError], waited: float
) -> NotReadyError:
    names = sorted(n for group in missing.values() for n in group)
    parts = []
    for shard, group in missing.items():
        url = core.url(shard)
        if shard in unreachable:
            parts.append(f"shard {url} was not reachable ({unreachable[shard].message})")
        elif group:
            parts.append(f"{sorted(group)} missing on shard {url}")
    return NotReadyError(
        f"variables not ready after {waited:.1f}s: {'; '.join(parts)}. Make sure a worker "
        "calls init(...) for them and every shard is running, or wait longer (timeout=...)",
        missing=names,
    )
