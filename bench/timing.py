"""Repetition counts and summaries of timed samples.

A result row is a plain dict (so it goes to JSON as is) made by :func:`summarize`:
``median_s``, ``p50_ms``, ``p99_ms``, ``min_ms``, ``max_ms``, ``reps``, ``ops_per_s`` =
1 / median time and, for transfers, ``mb_per_s`` = bytes / median time (MB = 10^6 bytes).
With few repetitions p99 is close to the maximum: read it as "the slow end", not as a tail
estimate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

__all__ = ["Stopwatch", "reps_for", "summarize"]

MB = 1e6
#: Sizes up to this many bytes get the full repetition count; bigger ones proportionally fewer.
FULL_REPS_BYTES = 8 << 20
#: Transfers of at most this many bytes get :data:`SMALL_FACTOR` times the repetition count:
#: each takes a millisecond or so, and with 30 of them the median of the 100 x 4 KB step moves
#: by up to a quarter from one run to the next.
SMALL_BYTES = 512 * 1024
SMALL_FACTOR = 10


def reps_for(nbytes: int, reps: int, min_reps: int) -> int:
    """How many timed repetitions a transfer of ``nbytes`` gets: ``SMALL_FACTOR * reps`` up
    to :data:`SMALL_BYTES`, ``reps`` up to 8 MiB, then scaled down by size, never below
    ``min_reps``."""
    if nbytes <= SMALL_BYTES:
        return reps * SMALL_FACTOR
    if nbytes <= FULL_REPS_BYTES:
        return reps
    return max(min_reps, min(reps, round(reps * FULL_REPS_BYTES / nbytes)))


def summarize(seconds: Sequence[float], nbytes: int | None = None) -> dict:
    s = np.asarray(seconds, dtype=float)
    if s.size == 0:
        raise ValueError("no samples")
    median = float(np.median(s))
    row = {
        "reps": int(s.size),
        "median_s": median,
        "p50_ms": median * 1e3,
        "p99_ms": float(np.percentile(s, 99)) * 1e3,
        "min_ms": float(s.min()) * 1e3,
        "max_ms": float(s.max()) * 1e3,
        "ops_per_s": 1.0 / median if median > 0 else float("inf"),
    }
    if nbytes is not None:
        row["bytes"] = int(nbytes)
        row["mb_per_s"] = nbytes / MB / median if median > 0 else float("inf")
    return row


class Stopwatch:
    """Collects wall-clock samples: ``with sw: work()`` adds one (perf_counter)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples.append(time.perf_counter() - self._t0)
