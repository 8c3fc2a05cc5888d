"""A history checker for replication: what workers saw acknowledged against the state a
replica ends with.

Each worker records every write it sent (:meth:`History.sent`) and what became of it
(:meth:`History.acked` with the answer, or nothing: it failed or never came back). Writes are
chosen so that the final state tells which of them were applied, and how often:

* a **push** of a one-hot gradient (1.0 at a coordinate no other write uses) to a float32
  variable under SGD with lr=1: each application subtracts 1 there, so the coordinate reads 0
  (not applied), -1 (applied once) or less (applied twice: a lost dedup);
* an **increment** by 1 of a counter: the counter is the number applied, and each applied one
  answered a value of its own.

:meth:`History.check` says every way the final state breaks "every acknowledged write applied
exactly once, no write applied twice": an acknowledged push not applied (lost) or applied
twice; any coordinate below -1; a counter below the acknowledged increments or above the ones
sent; two acknowledged increments that answered the same value.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["History"]


@dataclass
class History:
    """Writes sent and acknowledged, by every worker (thread-safe)."""

    #: (worker, verb, args) of every write sent.
    sent_writes: list[tuple[str, str, Any]] = field(default_factory=list)
    #: (worker, verb, args, answer) of every write acknowledged.
    acked_writes: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sent(self, worker: str, verb: str, args: Any) -> None:
        with self._lock:
            self.sent_writes.append((worker, verb, args))

    def acked(self, worker: str, verb: str, args: Any, answer: Any) -> None:
        with self._lock:
            self.acked_writes.append((worker, verb, args, answer))

    def count(self, verb: str) -> tuple[int, int]:
        """(sent, acknowledged) writes of ``verb``."""
        return (
            sum(1 for w in self.sent_writes if w[1] == verb),
            sum(1 for w in self.acked_writes if w[1] == verb),
        )

    def check(self, pushed: np.ndarray, counter: int) -> list[str]:
        """What is wrong with a final state whose pushed variable is ``pushed`` and whose
        counter is ``counter`` (an empty list: nothing)."""
        problems = []
        sent_at = {args for _, verb, args in self.sent_writes if verb == "push"}
        acked_at = {args for _, verb, args, _ in self.acked_writes if verb == "push"}
        for at in sorted(acked_at):
            if pushed[at] != -1.0:
                problems.append(f"acknowledged push at {at} reads {pushed[at]} (want -1)")
        for at in sorted(sent_at - acked_at):
            if pushed[at] not in (0.0, -1.0):
                problems.append(f"unacknowledged push at {at} reads {pushed[at]} (0 or -1)")
        untouched = np.ones(pushed.shape, bool)
        untouched[list(sent_at)] = False
        if np.any(pushed[untouched] != 0):
            problems.append("a coordinate no push was sent to changed")
        sent, acked = self.count("increment")
        if not acked <= counter <= sent:
            problems.append(
                f"counter {counter}: below the {acked} acknowledged increments or above the "
                f"{sent} sent"
            )
        values = [answer for _, verb, _, answer in self.acked_writes if verb == "increment"]
        if len(set(values)) != len(values):
            problems.append("two acknowledged increments answered the same value")
        if values and max(values) > counter:
            problems.append(f"an increment answered {max(values)}, above the counter {counter}")
        return problems
