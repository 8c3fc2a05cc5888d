"""The replicas of each shard index, and which one a client sends to now: :class:`Replicas`.

A shard index may be served by a group of replicas, one primary and its backups (the shards'
``--replica-group``); the shard list names them with ``|``::

    PARAMSHARD_SHARDS="http://a0:7100|http://b0:7100,http://a1:7100|http://b1:7100"

(``,`` separates the indexes, in ``--shard-index`` order; ``|`` the replicas of one index, in
any order). A client sends each request to the replica it takes for the primary, at first the
first one listed. When that one cannot be reached, times out, answers 421 ``not_primary``
(it is a backup, or stepped down), or has not answered for a lease TTL (cut off, frozen:
``_stalls.py``), every replica of the group is asked for its ``GET /v1/cluster`` and
:func:`choose` takes the one that says it is primary at the highest epoch (or the primary a
replica names, when none says so itself); the request is then sent there again, as it was: a
write with the same ``worker_id`` and ``seq``, which the new primary applies at most once (its
dedup table is replicated). ``_transport.py`` decides when (both shells alike),
``_following.py`` asks.

A read a backup may answer (``pull(..., allow_backup=True)``) goes to one backup of the
index, :meth:`Replicas.reader`: each client takes one of the replicas other than the primary by
a number of its own drawn at random, so that many readers (broadcast actors) spread over the
backups and each keeps its connection to one; a backup that fails a read
(:meth:`Replicas.shun`) is passed over for :data:`SHUN_SECONDS`, its reads going to the primary
meanwhile. The era of the values each backup sent (:meth:`Replicas.era`) is kept apart from
the primary's: a version is reused only with the replica that sent its value.

Only the listed replicas are ever used: a primary named in a reply but not in the list is not
followed. Thread-safe: the current choice is one list item per index, replaced whole.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from . import wire
from ._flow import Reply

__all__ = ["SHUN_SECONDS", "Replicas", "choose", "not_primary"]

logger = logging.getLogger("client_sdk")

#: Seconds a backup that failed a read is passed over by :meth:`Replicas.reader`.
SHUN_SECONDS = 10.0


class Replicas:
    """``groups[i]``: the replicas of shard index ``i``; ``current[i]``: the one used now."""

    def __init__(self, groups: Sequence[Sequence[str]]) -> None:
        self.groups: tuple[tuple[str, ...], ...] = tuple(tuple(g) for g in groups)
        #: The URL each index's requests go to; read by the senders at every exchange.
        self.current: list[str] = [g[0] for g in self.groups]
        #: The highest epoch seen for each index's primary (0: none yet).
        self.epochs = [0] * len(self.groups)
        self._lock = threading.Lock()
        #: Which backup this client reads from (:meth:`reader`): its own, drawn at random.
        self._spread = random.randrange(1 << 30)
        #: Backup URL -> until when (``time.monotonic()``) it is passed over for reads.
        self._shunned: dict[str, float] = {}
        #: Backup URL -> the era of the last values it sent this client.
        self._eras: dict[str, str | None] = {}

    def replicated(self, shard: int) -> bool:
        return len(self.groups[shard]) > 1

    def every_url(self) -> list[str]:
        return [u for g in self.groups for u in g]

    def reader(self, shard: int) -> str | None:
        """The backup of index ``shard`` a read that a backup may answer goes to (module
        docstring); ``None``: none now (a group of one, or every backup passed over), so it
        goes to the primary."""
        group = self.groups[shard]
        if len(group) == 1:
            return None
        primary = self.current[shard]
        shunned = self._shunned
        if shunned:
            now = time.monotonic()
            backups = [u for u in group if u != primary and shunned.get(u, 0.0) <= now]
        else:
            backups = [u for u in group if u != primary]
        return backups[self._spread % len(backups)] if backups else None

    def shun(self, url: str) -> None:
        """Pass backup ``url`` over for reads for :data:`SHUN_SECONDS` (it failed one)."""
        self._shunned[url] = time.monotonic() + SHUN_SECONDS
        logger.info(
            "backup %s did not answer a read; reading from the primary for %.0f s",
            url,
            SHUN_SECONDS,
        )

    def era(self, url: str) -> str | None:
        """The era of the values backup ``url`` sent this client last (``None``: none yet)."""
        return self._eras.get(url)

    def note_era(self, url: str, era: str | None) -> None:
        self._eras[url] = era

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
