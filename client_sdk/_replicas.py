"""The replicas of each shard index, and which one a client sends to now: :class:`Replicas`.

A shard index may be served by a group of replicas, one primary and its backups (the shards'
``--replica-group``); the shard list names them with ``|``::

    PARAMSHARD_SHARDS="http://a0:7100|http://b0:7100,http://a1:7100|http://b1:7100"

(``,`` separates the indexes, in ``--shard-index`` order; ``|`` the replicas of one index, in
any order). A client sends each request to the replica it takes for the primary, at first the
first one listed. When that one cannot be reached, times out, or answers 421 ``not_primary``
(it is a backup, or stepped down), :func:`find_primary` asks every replica of the group for
its ``GET /v1/cluster`` and takes the one that says it is primary at the highest epoch (or the
primary a replica names, when none says so itself); the request is then sent there again, as it
was: a write with the same ``worker_id`` and ``seq``, which the new primary applies at most
once (its dedup table is replicated). ``_transport.py`` decides when (both shells alike).

Only the listed replicas are ever used: a primary named in a reply but not in the list is not
followed. Thread-safe: the current choice is one list item per index, replaced whole.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from . import wire
from ._flow import Reply

__all__ = ["Replicas", "choose", "not_primary"]

logger = logging.getLogger("client_sdk")


class Replicas:
    """``groups[i]``: the replicas of shard index ``i``; ``current[i]``: the one used now."""

    def __init__(self, groups: Sequence[Sequence[str]]) -> None:
        self.groups: tuple[tuple[str, ...], ...] = tuple(tuple(g) for g in groups)
        #: The URL each index's requests go to; read by the senders at every exchange.
        self.current: list[str] = [g[0] for g in self.groups]
        #: The highest epoch seen for each index's primary (0: none yet).
        self.epochs = [0] * len(self.groups)
        self._lock = threading.Lock()

    def replicated(self, shard: int) -> bool:
        return len(self.groups[shard]) > 1

    def every_url(self) -> list[str]:
        return [u for g in self.groups for u in g]

    def follow(self, shard: int, url: str, epoch: int) -> bool:
        """Send index ``shard``'s requests to ``url`` (one of its group) from now on, unless a
        primary of a higher epoch was seen; ``True`` when that changed where they go."""
        if url not in self.groups[shard]:
            return False
        with self._lock:
            if epoch < self.epochs[shard]:
                return False
            self.epochs[shard] = epoch
            if self.current[shard] == url:
                return False
            old, self.current[shard] = self.current[shard], url
        logger.warning(
            "shard %d: %s is not its primary (now); following the primary %s (epoch %d)",
            shard,
            old,
            url,
            epoch,
        )
        return True


def not_primary(reply: Reply) -> tuple[bool, str | None]:
    """Whether ``reply`` is a 421 ``not_primary``, and the primary's URL it names (or None)."""
    if reply.status != 421:
        return False, None
    ctype = (reply.headers.get("content-type") or "").split(";")[0].strip().lower()
    try:
        if ctype in (wire.MSGPACK, wire.FRAME):
            msg: Any = wire.unpack(reply.content, ctype)
        elif ctype == wire.JSON:
            msg = json.loads(bytes(reply.content))
        else:
            return False, None
    except (wire.WireError, ValueError):
        return False, None
    err = msg.get("error") if isinstance(msg, dict) else None
    if not isinstance(err, dict) or err.get("code") != "not_primary":
        return False, None
    details = err.get("details")
    primary = details.get("primary") if isinstance(details, dict) else None
    return True, primary if isinstance(primary, str) else None


def choose(group: Sequence[str], answers: Sequence[Reply | None]) -> tuple[str, int] | None:
    """The primary of ``group`` from its replicas' ``GET /v1/cluster`` (``answers[r]`` of
    ``group[r]``, ``None`` for no answer): ``(url, epoch)`` of the replica that says it is
    primary at the highest epoch; else the primary the replica of the highest epoch names (when
    listed in ``group``); ``None`` when none knows one."""
    says: list[tuple[int, str]] = []
    names: list[tuple[int, str]] = []
    for url, reply in zip(group, answers):
        if reply is None or reply.status != 200:
            continue
        try:
            info = json.loads(bytes(reply.content))
        except ValueError:
            continue
        view = info.get("replication") if isinstance(info, dict) else None
        if not isinstance(view, dict):
            continue
        epoch = view.get("epoch")
        if type(epoch) is not int:
            continue
        if view.get("role") == "primary":
            says.append((epoch, url))
        named = view.get("primary")
        if isinstance(named, str) and named in group:
            names.append((epoch, named))
    if says:
        epoch, url = max(says)
        return url, epoch
    if names:
        epoch, url = max(names)
        return url, epoch
    return None
