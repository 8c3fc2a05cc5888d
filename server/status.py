"""``paramshard status``: a fleet's shards as a table, once or refreshed in place (``--watch``).

Each round probes every shard (:func:`server.probes.probe_fleet`: its ``/v1/cluster`` and
``/healthz``) and prints one row per shard: where it sits in the fleet, its incarnation, what
it holds, pushes and pulls per second, the age of its last snapshot, whether it checks tokens,
and whether it is up. A rate is the change of the shard's ``pushes_applied`` /
``pulls_answered`` between two readings over the time between them: a single ``status`` reads
twice, ``--interval`` apart; ``--watch`` reads once per round. A shard that restarted between
two readings (a new incarnation) shows no rate that round.

The exit status says whether every shard was up and in fleet order (0) or not (1): after the
one table, or after the last round of ``--watch`` (when ``--count`` rounds are done, or at
Ctrl-C). On a terminal ``--watch`` redraws the table in place; otherwise each round's table
follows the last, a blank line between.

Nothing here imports the web stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from .probes import probe_fleet
from .progress import human_bytes

__all__ = ["Reading", "human_bytes", "run", "table"]

_HEADER = (
    "URL",
    "SHARD",
    "INCARNATION",
    "VARIABLES",
    "BYTES",
    "PUSHES/S",
    "PULLS/S",
    "SNAPSHOT",
    "AUTH",
    "HEALTHY",
)
_CLEAR = "\x1b[H\x1b[2J"


@dataclass
class Reading:
    """One round's probes of the fleet, and when they were taken (``time.monotonic()``)."""

    results: list[dict[str, Any]]
    at: float


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _snapshot(info: dict[str, Any], now: float) -> str:
    snap = info.get("last_snapshot") or info.get("restored")
    if isinstance(snap, dict) and isinstance(snap.get("created_at"), (int, float)):
        return _age(max(0.0, now - snap["created_at"]))
    return "none" if info.get("data_dir") else "no data dir"


def _auth(auth: Any) -> str:
    """The shard's auth mode (``/v1/cluster``'s ``auth.mode``), ``-`` when it says none."""
    mode = auth.get("mode") if isinstance(auth, dict) else auth
    return str(mode) if isinstance(mode, str) and mode else "-"


def _rate(info: dict[str, Any], before: dict[str, Any] | None, key: str, dt: float) -> str:
    if before is None or dt <= 0 or before.get("incarnation") != info.get("incarnation"):
        return "-"
    now, then = info.get(key), before.get(key)
    if not isinstance(now, int) or not isinstance(then, int) or now < then:
        return "-"
    return f"{(now - then) / dt:.1f}"


def table(
    urls: list[str], reading: Reading, before: Reading | None = None
) -> tuple[list[str], bool]:
    """The table's lines for ``reading`` (rates against ``before``), and whether every shard
    is up and in fleet order."""
    rows = [_HEADER]
    ok = True
    now = time.time()
    dt = reading.at - before.at if before is not None else 0.0
    for i, (url, res) in enumerate(zip(urls, reading.results)):
        info = res.get("info")
        if info is None:
            ok = False
            rows.append((url, "?", "-", "-", "-", "-", "-", "-", "-", "down"))
            continue
        slot = f"{info.get('shard_index')}/{info.get('num_shards')}"
        health = "yes" if res["healthy"] else "no"
        if (info.get("shard_index"), info.get("num_shards")) != (i, len(urls)):
            health = f"mismatch (listed as {i}/{len(urls)})"
        ok = ok and health == "yes"
        prior = before.results[i].get("info") if before is not None else None
        rows.append(
            (
                url,
                slot,
                str(info.get("incarnation", "?")),
                str(info.get("variables", "?")),
                human_bytes(int(info.get("bytes", 0))),
                _rate(info, prior, "pushes_applied", dt),
                _rate(info, prior, "pulls_answered", dt),
                _snapshot(info, now),
                _auth(info.get("auth")),
                health,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return lines, ok


def run(
    urls: list[str],
    timeout: float,
    *,
    proxy: str | None = None,
    watch: bool = False,
    interval: float = 1.0,
    count: int | None = None,
    out: TextIO,
    err: TextIO,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print the fleet's table (``watch``: every ``interval`` seconds, ``count`` times or
    until Ctrl-C); 0 if every shard was up and in order in the last one, else 1. The probes
    go through ``proxy`` if given, else straight to the shards."""
    redraw = watch and out.isatty()
    ok = False
    rounds = 0
    try:
        before = Reading(probe_fleet(urls, timeout, proxy), time.monotonic())
        while True:
            sleep(interval)
            reading = Reading(probe_fleet(urls, timeout, proxy), time.monotonic())
            lines, ok = table(urls, reading, before)
            if redraw:
                out.write(_CLEAR)
            elif rounds:
                out.write("\n")
            out.write("\n".join(lines) + "\n")
            errors = [f"{u}: {r['error']}" for u, r in zip(urls, reading.results) if "error" in r]
            if errors:
                (out if redraw else err).write("\n".join(errors) + "\n")
            out.flush()
            rounds += 1
            before = reading
            if not watch or (count is not None and rounds >= count):
                break
    except KeyboardInterrupt:
        out.write("\n")
    return 0 if ok else 1
