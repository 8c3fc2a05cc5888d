"""Which writes of each worker a shard has applied, so a retried write is applied once.

Every write a worker sends (push, assign, increment) may carry ``worker_id`` and ``seq``; the
SDK numbers them from one counter per worker, so a worker's seqs only go up, and a retry reuses
the seq of the attempt it repeats. A seq is an int in ``0..MAX_SEQ`` (a signed 64-bit int; the
data plane refuses any other). Per worker the shard keeps

* ``high``: the highest seq applied, and a window of the ``WINDOW`` seqs below and including
  it, as a bitmap (bit ``i`` set: seq ``high - i`` was applied);
* after a jump of ``WINDOW`` or more above ``high`` (a worker restarted under the same id, whose
  counter starts at the clock, or a seq far too high sent by someone else), the window the jump
  left behind: ``low`` and its bitmap. Nothing between the two windows was applied, so writes
  that go on below the jump (the worker's own, when the jump was not its) are still told apart
  exactly: one write cannot lock a worker out. A second such jump drops the lower window;
* the results of recent increments (a retried increment must answer the value the first
  attempt got).

:meth:`DedupTable.check` says whether a seq is ``"new"``, a ``"duplicate"`` or ``"expired"``
(below the windows: the shard can no longer tell, so it refuses rather than risk applying a
write twice). The SDK retries within a deadline, in which a worker issues far fewer than
``WINDOW`` writes, so a retry never falls below the window in practice.

The table is bounded: a worker not seen for ``idle_seconds`` (``--dedup-idle-seconds``) is
forgotten, and at most ``max_workers`` (``--dedup-max-workers``) are remembered, the one seen
least recently forgotten first. A forgotten worker's next write starts a new record; a retry
of a write from before would be applied again (logged), which is why a client must not retry a
write for longer than the idle time (the SDK gives up after its ``retry_deadline``). The table
goes into every snapshot (:meth:`export` / :meth:`load`), so a retry that lands after a restart
is still recognised; a bitmap with few seqs set is written as the list of their offsets, so
a record costs the snapshot in proportion to the writes it remembers.

Not thread-safe: the store calls it from the event-loop thread only.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .staleness import EMPTY, Window

__all__ = [
    "IDLE_SECONDS",
    "MAX_SEQ",
    "MAX_WORKERS",
    "STALENESS_BOUNDS",
    "WINDOW",
    "DedupTable",
    "Totals",
    "WorkerRecord",
]

logger = logging.getLogger("paramshard.server")

#: Seqs tracked exactly below a worker's highest applied seq.
WINDOW = 1 << 16
_MASK = (1 << WINDOW) - 1
#: The highest seq a write may carry (a signed 64-bit int, as versions).
MAX_SEQ = (1 << 63) - 1
#: Increment results remembered per worker (a retried increment answers the original value).
MAX_RESULTS = 256
#: Workers remembered at most (``--dedup-max-workers``).
MAX_WORKERS = 10_000
#: A worker not seen for this long is forgotten (``--dedup-idle-seconds``; 0: never).
IDLE_SECONDS = 3600.0


def _overlay(high: int, bits: int, src_high: int, src_bits: int) -> int:
    """``bits`` (a window at ``high``) with the seqs of the window ``src_bits`` at ``src_high``
    that fall inside it set too."""
    if src_high <= high:
        back = high - src_high
        return bits | ((src_bits << back) & _MASK) if back < WINDOW else bits
    ahead = src_high - high
    return bits | (src_bits >> ahead) if ahead < WINDOW else bits


#: The upper bounds of :attr:`Totals.staleness`'s buckets (versions), the last one open.
STALENESS_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 1024)


class Totals:
    """The shard's writes since it started, all workers together, in plain ints that only go up
    (the metrics read them; a forgotten worker's counts stay in them).

    ``writes``: keyed writes applied, retries answered as duplicates, retries refused as
    expired; ``pushes``: pushes applied; ``gradients``: their gradients applied, accepted into a
    sync round, dropped by a variable's mode, applied with a scaled step; ``staleness``: how
    many applied pushes that said versions had each largest staleness, by the buckets of
    :data:`STALENESS_BOUNDS` (one more for above the last), with their sum in
    ``staleness_sum``.
    """

    __slots__ = ("gradients", "pushes", "staleness", "staleness_sum", "writes")

    def __init__(self) -> None:
        self.writes = [0, 0, 0]
        self.pushes = 0
        self.gradients = [0, 0, 0, 0]
        self.staleness = [0] * (len(STALENESS_BOUNDS) + 1)
        self.staleness_sum = 0


@dataclass
class WorkerRecord:
    """What one worker did on this shard: the window below ``high`` (``bits``) and, after a
    jump, the one below ``low`` (``low_bits``; ``low`` is -1 when there is none)."""

    high: int = -1
    bits: int = 0
    results: dict[int, list] = field(default_factory=dict)
    applied: int = 0
    duplicates: int = 0
    expired: int = 0
    last_seen: float = 0.0
    low: int = -1
    low_bits: int = 0
    #: Its gradients (one per variable and push) applied, accepted into a sync round, dropped
    #: by a variable's mode, applied with a scaled step; and the staleness of its latest
    #: pushes (each with its largest). Shown by ``GET /v1/workers``, not kept in snapshots.
    gradients: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    staleness: Window | None = None

    def status(self, seq: int) -> str:
        if seq > self.high:
            return "new"
        back = self.high - seq
        if back < WINDOW:
            return "duplicate" if (self.bits >> back) & 1 else "new"
        low = self.low
        if low < 0 or low - seq >= WINDOW:
            return "expired"
        if seq > low:  # between the windows: nothing was applied there
            return "new"
        return "duplicate" if (self.low_bits >> (low - seq)) & 1 else "new"

    def mark(self, seq: int) -> None:
        """Remember ``seq`` as applied (its :meth:`status` was ``"new"``)."""
        high = self.high
        if seq > high:
            shift = seq - high
            if shift >= WINDOW:  # a jump: the window behind it becomes the lower one
                if self.bits:
                    self.low, self.low_bits = high, self.bits
                self.bits = 1
            else:
                if self.low >= 0:  # what leaves the window joins the lower one, just below
                    bottom = seq - WINDOW
                    self.low_bits = _overlay(
                        bottom, self.bits >> (WINDOW - shift), self.low, self.low_bits
                    )
                    self.low = bottom
                self.bits = ((self.bits << shift) | 1) & _MASK
            self.high = seq
            self._prune()
        elif high - seq < WINDOW:
            self.bits |= 1 << (high - seq)
        elif seq > self.low:  # the lower window moves up (it stays below the other)
            shift = seq - self.low
            self.low_bits = ((self.low_bits << shift) | 1) & _MASK if shift < WINDOW else 1
            self.low = seq
            self._prune()
        else:
            self.low_bits |= 1 << (self.low - seq)

    def _prune(self) -> None:
        """Drop the results of seqs below every window."""
        floor = (self.low if self.low >= 0 else self.high) - WINDOW
        if self.results and min(self.results) <= floor:
            self.results = {s: r for s, r in self.results.items() if s > floor}

    def summary(self, worker_id: str) -> dict[str, Any]:
        return {
            "worker_id": worker_id,
            "last_seen": self.last_seen,
            "applied": self.applied,
            "duplicates": self.duplicates,
            "expired": self.expired,
            "high_seq": self.high,
            "gradients": dict(zip(("applied", "accepted", "dropped", "scaled"), self.gradients)),
            "staleness": dict(EMPTY) if self.staleness is None else self.staleness.summary(),
        }


class DedupTable:
    """Per-worker high-water marks and windows of applied seqs (see the module docstring)."""

    def __init__(self, max_workers: int = MAX_WORKERS, idle_seconds: float = IDLE_SECONDS) -> None:
        self.max_workers = max_workers
        self.idle_seconds = idle_seconds
        #: Least recently seen first.
        self._workers: OrderedDict[str, WorkerRecord] = OrderedDict()
        self.totals = Totals()

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
        if worker_id not in self._workers:
            logger.info(
                "worker %s first seen (seq %d)",
                worker_id[:256],
                seq,
                extra={"event": "worker_first_seen", "worker": worker_id, "seq": seq},
            )
        record = self._touch(worker_id)
        record.mark(seq)
        record.applied += 1
        self.totals.writes[0] += 1
        if result is not None:
            record.results[seq] = result
            if len(record.results) > MAX_RESULTS:
                del record.results[min(record.results)]

    def gradients(
        self,
        worker_id: str,
        applied: int,
        accepted: int,
        dropped: int,
        scaled: int,
        staleness: int | None,
    ) -> None:
        """Count what became of the gradients of a push :meth:`record` just recorded, and its
        largest staleness (None: it said no version)."""
        totals = self.totals
        totals.pushes += 1
        totals.gradients[0] += applied
        if accepted or dropped or scaled:
            totals.gradients[1] += accepted
            totals.gradients[2] += dropped
            totals.gradients[3] += scaled
        if staleness is not None:
            totals.staleness[bisect_left(STALENESS_BOUNDS, staleness)] += 1
            if staleness > 0:  # a version said from after a restart counts as 0
                totals.staleness_sum += staleness
        record = self._workers.get(worker_id)
        if record is None:
            return
        counts = record.gradients
        counts[0] += applied
        if accepted or dropped or scaled:
            counts[1] += accepted
            counts[2] += dropped
            counts[3] += scaled
        if staleness is not None:
            window = record.staleness
            if window is None:
                window = record.staleness = Window()
            window.add(staleness)

    def count(self, worker_id: str, outcome: str) -> None:
        """Count a refused retry (``"duplicate"`` or ``"expired"``) against the worker."""
        record = self._touch(worker_id)
        if outcome == "duplicate":
            record.duplicates += 1
            self.totals.writes[1] += 1
        elif outcome == "expired":
            record.expired += 1
            self.totals.writes[2] += 1

    def records(self) -> list[tuple[str, WorkerRecord]]:
        """``(worker_id, record)`` of every worker remembered, least recently seen first."""
        self.forget_idle()
        return list(self._workers.items())

    def summaries(self) -> list[dict[str, Any]]:
        self.forget_idle()
        return [r.summary(w) for w, r in sorted(self._workers.items())]

    def bound(self, max_workers: int, idle_seconds: float) -> None:
        """Set the bounds, and forget what is past them now (a table restored from a
        snapshot written under other bounds, or long ago)."""
        self.max_workers = max_workers
        self.idle_seconds = idle_seconds
        self.forget_idle()
        extra = len(self._workers) - max_workers
        for _ in range(max(0, extra)):
            self._workers.popitem(last=False)
        if extra > 0:
            logger.warning(
                "forgot the seqs of the %d least recently seen workers (more than "
                "--dedup-max-workers %d)",
                extra,
                max_workers,
            )

    def forget_idle(self, now: float | None = None) -> None:
        """Forget the workers not seen for ``idle_seconds``: O(1) when there are none (the
        least recently seen comes first)."""
        if not self.idle_seconds or not self._workers:
            return
        cutoff = (time.time() if now is None else now) - self.idle_seconds
        workers = self._workers
        gone = 0
        while workers and next(iter(workers.values())).last_seen < cutoff:
            workers.popitem(last=False)
            gone += 1
        if gone:
            logger.info(
                "forgot the seqs of %d worker(s) not seen for %g s (--dedup-idle-seconds)",
                gone,
                self.idle_seconds,
            )

    def _touch(self, worker_id: str) -> WorkerRecord:
        now = time.time()
        self.forget_idle(now)
        record = self._workers.get(worker_id)
        if record is None:
            record = self._workers[worker_id] = WorkerRecord()
            if len(self._workers) > self.max_workers:
                gone, _ = self._workers.popitem(last=False)
                logger.warning(
                    "forgetting the seqs of worker %r (least recently seen of more "
                    "than %d workers, --dedup-max-workers): a late retry from it "
                    "would be applied again",
                    gone,
                    self.max_workers,
                )
        else:
            self._workers.move_to_end(worker_id)
        record.last_seen = now
        return record

    # -- snapshots ----------------------------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """A JSON-ready copy of the table (for a snapshot manifest), least recently seen
        first."""
        self.forget_idle()
        workers = {}
        for w, r in self._workers.items():
            entry = {
                "high": r.high,
                "bits": _bits_out(r.bits),
                "results": [[s, *res] for s, res in sorted(r.results.items())],
                "applied": r.applied,
                "duplicates": r.duplicates,
                "expired": r.expired,
                "last_seen": r.last_seen,
            }
            if r.low >= 0:
                entry["low"] = r.low
                entry["low_bits"] = _bits_out(r.low_bits)
            workers[w] = entry
        return {"window": WINDOW, "workers": workers}

    @classmethod
    def load(
        cls, data: Any, max_workers: int = MAX_WORKERS, idle_seconds: float = IDLE_SECONDS
    ) -> DedupTable:
        """Rebuild a table from :meth:`export`'s output; ``ValueError`` if it is malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("workers"), dict):
            raise ValueError("dedup table: expected {'window', 'workers': {...}}")
        window = data.get("window")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"dedup table: bad window {window!r}")
        table = cls(max_workers, idle_seconds)
        records = []
        for worker_id, raw in data["workers"].items():
            try:
                record = WorkerRecord(
                    high=_as_int(raw["high"]),
                    bits=_bits_in(raw["bits"]),
                    results={_as_int(r[0]): list(r[1:3]) for r in raw["results"]},
                    applied=_as_int(raw["applied"]),
                    duplicates=_as_int(raw["duplicates"]),
                    expired=_as_int(raw["expired"]),
                    last_seen=float(raw["last_seen"]),
                    low=_as_int(raw.get("low", -1)),
                    low_bits=_bits_in(raw.get("low_bits", "")),
                )
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise ValueError(
                    f"dedup table: bad record for worker {worker_id!r}: {exc!r}"
                ) from None
            if window > WINDOW:  # written with a wider window: keep what fits ours
                record.bits &= _MASK
                record.low_bits &= _MASK
            records.append((str(worker_id), record))
        records.sort(key=lambda item: item[1].last_seen)  # least recently seen first
        table._workers.update(records)
        return table

    @classmethod
    def merge(cls, tables: list[DedupTable]) -> DedupTable:
        """One table holding every worker's seqs from all ``tables`` (for resharding): per
        worker, the highest window, with every other window's seqs that fall in it, and below
        it one window with the rest that fit; seqs that fit neither count as expired (never
        as new)."""
        out = cls(
            max(t.max_workers for t in tables) if tables else MAX_WORKERS,
            max(t.idle_seconds for t in tables) if tables else IDLE_SECONDS,
        )
        records: dict[str, list[WorkerRecord]] = {}
        for table in tables:
            for worker_id, r in table._workers.items():
                records.setdefault(worker_id, []).append(r)
        merged = []
        for worker_id, rs in records.items():
            windows = sorted(
                (
                    (h, b)
                    for r in rs
                    for h, b in ((r.high, r.bits), (r.low, r.low_bits))
                    if h >= 0 and b
                ),
                reverse=True,
            )
            m = WorkerRecord(
                applied=sum(r.applied for r in rs),
                duplicates=sum(r.duplicates for r in rs),
                expired=sum(r.expired for r in rs),
                last_seen=max(r.last_seen for r in rs),
            )
            if windows:
                m.high, m.bits = windows[0]
                for h, b in windows[1:]:
                    m.bits = _overlay(m.high, m.bits, h, b)
                if len(windows) > 1:
                    m.low = min(m.high - WINDOW, windows[1][0])
                    for h, b in windows[1:]:
                        m.low_bits = _overlay(m.low, m.low_bits, h, b)
                    if not m.low_bits:
                        m.low = -1
            else:
                m.high = max(r.high for r in rs)
            for r in rs:
                m.results.update(r.results)
            merged.append((worker_id, m))
        merged.sort(key=lambda item: item[1].last_seen)
        out._workers.update(merged)
        return out


def _bits_out(bits: int) -> str | list[int]:
    """A window's bitmap for a manifest: hex, or the offsets of its set bits when that is
    shorter (a window with few seqs set far apart)."""
    text = format(bits, "x")
    count = bits.bit_count()
    if count * 8 >= len(text):
        return text
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def _bits_in(value: Any) -> int:
    if isinstance(value, str):
        return int(value, 16) if value else 0
    if isinstance(value, list):
        bits = 0
        for offset in value:
            if not _as_int(offset) >= 0 or offset >= WINDOW:
                raise ValueError(f"bit offset {offset!r} outside the window")
            bits |= 1 << offset
        return bits
    raise ValueError(f"expected a hex string or a list of offsets, got {value!r}")


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an int, got {value!r}")
    return value
