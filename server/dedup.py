"""Which writes of each worker a shard has applied, so a retried write is applied once.

Every write a worker sends (push, assign, increment) may carry ``worker_id`` and ``seq``; the
SDK numbers them from one counter per worker, so a worker's seqs only go up, and a retry reuses
the seq of the attempt it repeats. Per worker the shard keeps

* ``high``: the highest seq applied, and
* a window of the ``WINDOW`` seqs below and including ``high``, as a bitmap (bit ``i`` set:
  seq ``high - i`` was applied), plus the results of recent increments (a retried increment
  must answer the value the first attempt got).

:meth:`DedupTable.check` says whether a seq is ``"new"``, a ``"duplicate"`` or ``"expired"``
(below the window: the shard can no longer tell, so it refuses rather than risk applying a write
twice). The SDK retries within a deadline, in which a worker issues far fewer than ``WINDOW``
writes, so a retry never falls below the window in practice.

At most ``max_workers`` workers are remembered; the one seen least recently is forgotten first
(a retry from it would then be applied again: logged). The table goes into every snapshot
(:meth:`export` / :meth:`load`), so a retry that lands after a restart is still recognised.

Not thread-safe: the store calls it from the event-loop thread only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WINDOW", "DedupTable", "WorkerRecord"]

logger = logging.getLogger("paramshard.server")

#: Seqs tracked exactly below a worker's highest applied seq.
WINDOW = 1 << 16
#: Increment results remembered per worker (a retried increment answers the original value).
MAX_RESULTS = 256
MAX_WORKERS = 100_000


@dataclass
class WorkerRecord:
    """What one worker did on this shard; ``bits`` is the window bitmap below ``high``."""

    high: int = -1
    bits: int = 0
    results: dict[int, list] = field(default_factory=dict)
    applied: int = 0
    duplicates: int = 0
    expired: int = 0
    last_seen: float = 0.0

    def status(self, seq: int) -> str:
        if seq > self.high:
            return "new"
        back = self.high - seq
        if back >= WINDOW:
            return "expired"
        return "duplicate" if (self.bits >> back) & 1 else "new"

    def mark(self, seq: int) -> None:
        if seq > self.high:
            shift = seq - self.high
            self.bits = ((self.bits << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
            self.high = seq
            floor = seq - WINDOW
            if self.results and min(self.results) <= floor:
                self.results = {s: r for s, r in self.results.items() if s > floor}
        else:
            self.bits |= 1 << (self.high - seq)

    def summary(self, worker_id: str) -> dict[str, Any]:
        return {"worker_id": worker_id, "last_seen": self.last_seen, "applied": self.applied,
                "duplicates": self.duplicates, "expired": self.expired, "high_seq": self.high}


class DedupTable:
    """Per-worker high-water marks and windows of applied seqs (see the module docstring)."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._workers: OrderedDict[str, WorkerRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def check(self, worker_id: str, seq: int) -> str:
        """``"new"``, ``"duplicate"`` or ``"expired"``; changes nothing."""
        record = self._workers.get(worker_id)
        return "new" if record is None else record.status(seq)

    def result(self, worker_id: str, seq: int) -> list | None:
        """The result recorded with ``seq`` (increments), if still remembered."""
        record = self._workers.get(worker_id)
        return None if record is None else record.results.get(seq)

    def record(self, worker_id: str, seq: int, result: list | None = None) -> None:
        """Remember that ``seq`` was applied (with an increment's ``[value, version]``)."""
        record = self._touch(worker_id)
        record.mark(seq)
        record.applied += 1
        if result is not None:
            record.results[seq] = result
            if len(record.results) > MAX_RESULTS:
                del record.results[min(record.results)]

    def count(self, worker_id: str, outcome: str) -> None:
        """Count a refused retry (``"duplicate"`` or ``"expired"``) against the worker."""
        record = self._touch(worker_id)
        if outcome == "duplicate":
            record.duplicates += 1
        elif outcome == "expired":
            record.expired += 1

    def summaries(self) -> list[dict[str, Any]]:
        return [r.summary(w) for w, r in sorted(self._workers.items())]

    def _touch(self, worker_id: str) -> WorkerRecord:
        record = self._workers.get(worker_id)
        if record is None:
            record = self._workers[worker_id] = WorkerRecord()
            if len(self._workers) > self.max_workers:
                gone, _ = self._workers.popitem(last=False)
                logger.warning("forgetting the seqs of worker %r (least recently seen of more "
                               "than %d workers): a late retry from it would be applied again",
                               gone, self.max_workers)
        else:
            self._workers.move_to_end(worker_id)
        record.last_seen = time.time()
        return record

    # -- snapshots ----------------------------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """A JSON-ready copy of the table (for a snapshot manifest)."""
        return {
            "window": WINDOW,
            "workers": {
                w: {"high": r.high, "bits": format(r.bits, "x"),
                    "results": [[s, *res] for s, res in sorted(r.results.items())],
                    "applied": r.applied, "duplicates": r.duplicates, "expired": r.expired,
                    "last_seen": r.last_seen}
                for w, r in self._workers.items()
            },
        }

    @classmethod
    def load(cls, data: Any, max_workers: int = MAX_WORKERS) -> DedupTable:
        """Rebuild a table from :meth:`export`'s output; ``ValueError`` if it is malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("workers"), dict):
            raise ValueError("dedup table: expected {'window', 'workers': {...}}")
        window = data.get("window")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"dedup table: bad window {window!r}")
        table = cls(max_workers)
        for worker_id, raw in data["workers"].items():
            try:
                record = WorkerRecord(
                    high=_as_int(raw["high"]),
                    bits=int(raw["bits"], 16) if raw["bits"] else 0,
                    results={_as_int(r[0]): list(r[1:3]) for r in raw["results"]},
                    applied=_as_int(raw["applied"]), duplicates=_as_int(raw["duplicates"]),
                    expired=_as_int(raw["expired"]), last_seen=float(raw["last_seen"]))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"dedup table: bad record for worker {worker_id!r}: "
                                 f"{exc!r}") from None
            if window > WINDOW:  # written with a wider window: keep what fits ours
                record.bits &= (1 << WINDOW) - 1
            table._workers[str(worker_id)] = record
        return table

    @classmethod
    def merge(cls, tables: list[DedupTable]) -> DedupTable:
        """One table holding every worker's seqs from all ``tables`` (for resharding)."""
        out = cls(max(t.max_workers for t in tables) if tables else MAX_WORKERS)
        for table in tables:
            for worker_id, r in table._workers.items():
                mine = out._workers.get(worker_id)
                if mine is None:
                    out._workers[worker_id] = WorkerRecord(
                        r.high, r.bits, dict(r.results), r.applied, r.duplicates, r.expired,
                        r.last_seen)
                    continue
                if r.high > mine.high:
                    mine.bits, mine.high, other_bits, other_high = r.bits, r.high, mine.bits, \
                        mine.high
                else:
                    other_bits, other_high = r.bits, r.high
                back = mine.high - other_high
                if back < WINDOW:
                    mine.bits |= (other_bits << back) & ((1 << WINDOW) - 1)
                mine.results.update(r.results)
                mine.applied += r.applied
                mine.duplicates += r.duplicates
                mine.expired += r.expired
                mine.last_seen = max(mine.last_seen, r.last_seen)
        return out


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an int, got {value!r}")
    return value
