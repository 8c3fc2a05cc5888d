"""CPU time of a server process, read from ``/proc/<pid>/stat`` around the work it serves.

``utime + stime`` (fields 14 and 15) cover every thread of the process, in clock ticks
(``SC_CLK_TCK``, 100 per second here: 10 ms). One read costs tens of microseconds and is taken
outside the timed region. A single short operation is below the tick, but the counter is
cumulative, so the sum over many repetitions is right to within a tick or two of the total:
read ``cpu_s`` of a row over all its repetitions, not per operation.

Linux only; elsewhere :func:`cpu_seconds` returns ``None`` and the figures are left out.
"""

from __future__ import annotations

import os

__all__ = ["CpuMeter", "MachineMeter", "cpu_seconds", "cpu_split", "machine_busy_seconds"]

_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds used so far by process ``pid`` (all its threads), or ``None``
    if it cannot be read (no /proc, or the process is gone)."""
    split = cpu_split(pid)
    return None if split is None else split[0] + split[1]


def cpu_split(pid: int) -> tuple[float, float] | None:
    """User and system CPU seconds used so far by process ``pid`` (all its threads), or
    ``None`` if they cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The name (field 2) is in parentheses and may hold spaces: split after its last ")".
    fields = stat.rsplit(b")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of the whole line
    return utime * _TICK, stime * _TICK


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores of the machine have spent busy so far (``/proc/stat``: every
    state but idle and iowait), or ``None`` without /proc."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) * _TICK  # guest time is already in user


class MachineMeter:
    """Busy CPU seconds of the whole machine (every process, ours or not) inside ``with``
    blocks; ``seconds`` is ``None`` without /proc. Not thread-safe."""

    def __init__(self) -> None:
        self.seconds: float | None = 0.0
        self._before: float | None = None

    def __enter__(self) -> MachineMeter:
        self._before = machine_busy_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        after = machine_busy_seconds()
        if self.seconds is None or after is None or self._before is None:
            self.seconds = None
        else:
            self.seconds += after - self._before


class CpuMeter:
    """Adds up the CPU time processes ``pids`` spend inside ``with meter:`` blocks.

    ``seconds`` is ``None`` if any of them cannot be read. Not thread-safe."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = list(pids)
        self.seconds: float | None = 0.0
        self._before: float | None = None

    def _now(self) -> float | None:
        total = 0.0
        for pid in self.pids:
            s = cpu_seconds(pid)
            if s is None:
                return None
            total += s
        return total

    def __enter__(self) -> CpuMeter:
        self._before = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        after = self._now()
        if self.seconds is None or after is None or self._before is None:
            self.seconds = None
        else:
            self.seconds += after - self._before
