"""What a client knows of its fleet: :class:`Fleet`.

The shard URLs in shard-index order and, for each shard: which names it owns (placement,
remembered per name), what its verbs take (the features and the ``max_request_names`` its
``/v1/cluster`` lists), whether it was checked against the list, and its incarnation, state
version and era (:func:`era`: what the values cached from it are keyed by). A shard's first
reply, and its first after a restart, is checked here: another index, fleet size or protocol
version is a :class:`FleetMismatchError` or :class:`ProtocolError`.

When a shard's incarnation changes (it restarted), the fleet logs one warning naming the shard
and the state version it came back at, has the values cached from it forgotten (``on_restart``)
and checks it again before the next call.

Thread-safe: one lock, never held across I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from . import wire
from ._args import valid_name
from ._exceptions import FleetMismatchError, ProtocolError
from .placement import shard_for

__all__ = ["PLACEMENT_CACHE", "Fleet", "era", "mismatch_message"]

#: Most names whose validation and placement a fleet remembers (then it starts over).
PLACEMENT_CACHE = 1 << 20

logger = logging.getLogger("client_sdk")


#: The most ids the SDK puts in one pull_rows or push_rows request.
MAX_TABLE_IDS = 1 << 16


def era(incarnation: str | None, deletions: str | None) -> str | None:
    """What values a shard sent are cached under: its incarnation (``x-paramshard-incarnation``),
    with its deletions count (``x-paramshard-deletions``) once it deleted anything. A version
    names one value only within an era: a restarted shard, or a variable deleted and made
    again, may reach the same version with another value."""
    if incarnation is None or not deletions:
        return incarnation
    return f"{incarnation}/{deletions}"


class Fleet:
    """The shards ``urls`` (in shard-index order) as this client knows them. Thread-safe.

    ``on_restart(shard)`` is called when a shard comes back with a new incarnation (under the
    fleet's lock: it must not call back into the fleet).
    """

    def __init__(self, urls: Sequence[str], on_restart: Callable[[int], None]) -> None:
        self.urls = urls
        self.n = n = len(urls)
        self._on_restart = on_restart
        self._lock = threading.Lock()
        self._checked = [False] * n
        #: Per shard: whether its verbs take tensor tables (its /v1/cluster lists the feature),
        #: and uniform ones with packed rows.
        self.tables = [False] * n
        self.packed = [False] * n
        #: Per shard: the features its /v1/cluster lists (:meth:`require` checks one), and
        #: whether it has embedding tables.
        self.features: list[frozenset[str]] = [frozenset()] * n
        self.embedding = [False] * n
        #: Entries one request to each shard may hold (its ``max_request_names``).
        self.max_names = [wire.MAX_REQUEST_NAMES] * n
        #: Ids one pull_rows or push_rows to each shard carries at most: its
        #: ``max_table_ids``, and never more than :data:`MAX_TABLE_IDS`.
        self.max_ids = [MAX_TABLE_IDS] * n
        #: The fleet's --partition-bytes (``/v1/cluster``): above it, init partitions a
        #: variable nobody said how to (client_sdk.partitions.auto_partitions).
        self.partition_bytes = 0
        #: Whether a shard held a partitioned variable's layout when it was checked.
        self.partitioned = False
        self._incarnation: list[str | None] = [None] * n
        #: The URL each incarnation was seen at: another URL is another replica of the index
        #: (a failover, ``_replicas.py``), not a restart.
        self._incarnation_url: list[str | None] = [None] * n
        self._era: list[str | None] = [None] * n
        #: Per shard: the last state version seen, and (old incarnation, that version) while
        #: a restart is noticed but not yet reported.
        self._state_version: list[int | None] = [None] * n
        self._restarted: dict[int, tuple[str, int | None]] = {}
        #: name -> owning shard, for names already validated and placed (see place)
        self.placed: dict[str, int] = {}

    def url(self, shard: int) -> str:
        return self.urls[shard]

    # -- placement -----------------------------------------------------------------------

    def place(self, name: str) -> int:
        """Validate ``name`` and remember its shard (a worker uses the same names each step,
        so hashing and validating them once is enough)."""
        shard = shard_for(valid_name(name), self.n)
        if len(self.placed) >= PLACEMENT_CACHE:
            self.placed.clear()
        self.placed[name] = shard
        return shard

    def split(self, names: Iterable[str]) -> dict[int, list[str]]:
        """Group names by owning shard, in shard order."""
        if self.n == 1:
            every = list(names)
            return {0: every} if every else {}
        placed = self.placed
        out: dict[int, list[str]] = {}
        for name in names:
            shard = placed.get(name)
            if shard is None:
                shard = self.place(name)
            group = out.get(shard)
            if group is None:
                out[shard] = [name]
            else:
                group.append(name)
        return dict(sorted(out.items()))

    def chunks(self, groups: Mapping[int, list[str]]) -> list[tuple[int, list[str]]]:
        """``(shard, names)`` per request: each shard's names in runs of at most the
        entries one request to it may hold (``max_request_names``, docs/PROTOCOL.md Limits)."""
        out = []
        for shard, names in groups.items():
            size = self.max_names[shard]
            if len(names) <= size:
                out.append((shard, names))
            else:
                out += [(shard, names[i : i + size]) for i in range(0, len(names), size)]
        return out

    # -- checks --------------------------------------------------------------------------

    def unchecked(self) -> list[int]:
        """The shards not yet checked against the list (all at first, one after a restart)."""
        with self._lock:
            return [i for i in range(self.n) if not self._checked[i]]

    def all_checked(self) -> bool:
        """Whether every shard is checked against the list now (:meth:`unchecked` is empty),
        read without the lock: a verb that finds it true has nothing to check first."""
        return all(self._checked)

    def checked(self, shard: int) -> None:
        with self._lock:
            self._checked[shard] = True

    def recheck(self, shard: int) -> None:
        """Check ``shard`` again before the next call (it refused a request as not its own)."""
        with self._lock:
            self._checked[shard] = False

    def check_identity(self, shard: int, headers: Mapping[str, str]) -> None:
        """Raise for a reply whose headers name another protocol version or another shard."""
        url = self.urls[shard]
        protocol = headers.get(wire.HEADER_PROTOCOL)
        if protocol is not None and protocol.strip() != str(wire.PROTOCOL_VERSION):
            raise ProtocolError(
                f"shard {url} speaks protocol version {protocol}, this SDK speaks "
                f"{wire.PROTOCOL_VERSION}: run the same paramshard version on workers and shards",
                shard=url,
            )
        ident = headers.get(wire.HEADER_SHARD)
        if ident is not None and ident.strip() != f"{shard}/{self.n}":
            index, _, total = ident.strip().partition("/")
            raise FleetMismatchError(
                mismatch_message(url, shard, self.n, index, total),
                shard=url,
                code="fleet_mismatch",
            )

    def check_cluster(self, shard: int, info: Mapping[str, Any]) -> None:
        """Check a shard's ``GET /v1/cluster`` against the list, and learn what it takes."""
        url = self.urls[shard]
        index, total = info.get("shard_index"), info.get("num_shards")
        if not isinstance(index, int) or not isinstance(total, int):
            raise ProtocolError(
                f"GET {url}/v1/cluster has no shard_index/num_shards: is this URL "
                "a paramshard shard?",
                shard=url,
            )
        protocol = info.get("protocol_version")
        if protocol is not None and protocol != wire.PROTOCOL_VERSION:
            raise ProtocolError(
                f"shard {url} speaks protocol version {protocol}, this SDK speaks "
                f"{wire.PROTOCOL_VERSION}: run the same paramshard version on workers and shards",
                shard=url,
            )
        if index != shard or total != self.n:
            raise FleetMismatchError(
                mismatch_message(url, shard, self.n, index, total),
                shard=url,
                code="fleet_mismatch",
                details={"shard_index": index, "num_shards": total},
            )
        features = info.get("features")
        if not isinstance(features, list):
            features = []
        self.tables[shard] = wire.FEATURE_TABLES in features
        self.packed[shard] = self.tables[shard] and wire.FEATURE_PACKED in features
        self.features[shard] = frozenset(f for f in features if isinstance(f, str))
        self.embedding[shard] = wire.FEATURE_EMBEDDING_TABLES in features
        ids = info.get("max_table_ids")
        if type(ids) is int and ids > 0:
            self.max_ids[shard] = min(ids, MAX_TABLE_IDS)
        limit = info.get("max_request_names")
        if type(limit) is int and limit > 0:
            self.max_names[shard] = limit
        held = info.get("partitioned")
        if type(held) is int and held > 0:  # layouts exist: look unknown names up before writes
            self.partitioned = True
        split = info.get("partition_bytes")
        if type(split) is int and split >= 0:  # the fleet's --partition-bytes (shard 0's rules)
            if shard == 0 or not self.partition_bytes:
                self.partition_bytes = split
        incarnation = info.get("incarnation")
        if isinstance(incarnation, str):
            self.note_incarnation(shard, incarnation)

    def require(self, shard: int, feature: str, needed_by: str) -> None:
        """:class:`~client_sdk.ProtocolError` naming the shard, unless its /v1/cluster lists
        ``feature`` (``needed_by``: what needs it, for the message)."""
        if feature not in self.features[shard]:
            url = self.urls[shard]
            raise ProtocolError(
                f"shard {url} does not have {feature!r} (its /v1/cluster does not list it in "
                f"'features'), which {needed_by} needs: the shard runs an older paramshard; "
                "upgrade the shards to this SDK's version (pip install -U paramshard) and "
                "restart them",
                shard=url,
            )

    # -- incarnations --------------------------------------------------------------------

    def incarnation(self, shard: int) -> str | None:
        """The shard's incarnation as last seen (``None`` before its first reply)."""
        return self._incarnation[shard]

    def era(self, shard: int) -> str | None:
        """The shard's era (:func:`era`) as last seen: the one to look cached values up by."""
        return self._era[shard]

    def note_incarnation(
        self,
        shard: int,
        incarnation: str | None,
        state_version: str | None = None,
        era: str | None = None,
    ) -> None:
        """Track the shard's incarnation, state version and era (``None``: not said); on a
        restart have what was cached from it dropped, check it again before the next call,
        and log one warning once the restarted shard has said which state version it came
        back at."""
        if incarnation is None:
            return
        version = int(state_version) if state_version and state_version.isdigit() else None
        report = None
        with self._lock:
            known = self._incarnation[shard]
            if era is not None or known != incarnation:
                self._era[shard] = era
            if known != incarnation:
                url = self.urls[shard]
                switched = self._incarnation_url[shard] != url
                self._incarnation[shard] = incarnation
                self._incarnation_url[shard] = url
                if known is not None:
                    self._checked[shard] = False
                    if not switched:  # a failover to another replica is logged as one
                        self._restarted[shard] = (known, self._state_version[shard])
                    self._on_restart(shard)
                self._state_version[shard] = None
            if version is not None:
                self._state_version[shard] = version
                if shard in self._restarted:
                    report = self._restarted.pop(shard)
        if report is not None and version is not None:  # a report waits for the version
            old, last_seen = report
            seen = "" if last_seen is None else f"; this client last saw it at {last_seen}"
            lost = (
                ""
                if last_seen is None or last_seen <= version
                else f", so up to {last_seen - version} update(s) since its last snapshot were lost"
            )
            logger.warning(
                "shard %d (%s) restarted (incarnation %s -> %s) and came back at state version "
                "%d%s%s; dropped the values cached from it and carrying on",
                shard,
                self.urls[shard],
                old,
                incarnation,
                version,
                seen,
                lost,
            )


def mismatch_message(url: str, position: int, n: int, index: Any, total: Any) -> str:
    """What to fix when the shard at ``position`` of ``n`` says it is ``index`` of ``total``."""
    if total != n and str(total) != str(n):
        return (
            f"shard {url} reports a fleet of {total} shards but {n} are listed: list every "
            f"shard, in --shard-index order, in {wire.ENV_SHARDS} (or the shards argument)"
        )
    return (
        f"shard {url} reports index {index} of {total} but is listed at position "
        f"{position}: the {wire.ENV_SHARDS} order (or the shards argument) must match each "
        "shard's --shard-index"
    )
