"""``paramshard status``: a fleet's shards as a table, once or refreshed in place (``--watch``).

Each round probes every shard (:func:`server.probes.probe_fleet`: its ``/v1/cluster`` and
``/healthz``) and prints one row per shard: where it sits in the fleet, its incarnation, what
it holds, pushes and pulls per second, the age of its last snapshot, whether it checks tokens,
and whether it is up. A rate is the change of the shard's ``pushes_applied`` /
``pulls_answered`` between two readings over the time between them: a single ``status`` reads
twice, ``--interval`` apart; ``--watch`` reads once per round. A shard that restarted between
two readings (a new incarnation) shows no rate that round.

A shard index served by a replica group is listed with ``|`` (``a0|b0,a1|b1``, as
``PARAMSHARD_SHARDS`` lists it): each replica gets a row of its own, with its ``ROLE``,
``EPOCH`` and ``LSN`` (the newest write it holds) as it says them, and ``LAG`` and ``IN-SYNC``
as the group's primary (the replica saying it is primary at the highest epoch) says them: the
writes the primary holds that the backup has not acknowledged yet, and whether the primary
waits for it before acknowledging a write. Those columns are shown whenever the list names a
group.

The exit status says whether every shard was up and in fleet order, and every group had its
primary (0), or not (1): after the one table, or after the last round of ``--watch`` (when
``--count`` rounds are done, or at Ctrl-C). On a terminal ``--watch`` redraws the table in
place; otherwise each round's table follows the last, a blank line between.

Nothing here imports the web stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from .probes import probe_fleet
from .progress import human_bytes
from .replication.group import in_sync, lag, primary_of

__all__ = [
    "Reading",
    "group_primary",
    "human_bytes",
    "replica_cells",
    "replication_of",
    "run",
    "table",
]

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
#: The columns a list naming replica groups adds, after ``SHARD``.
_REPLICA_COLUMNS = ("ROLE", "EPOCH", "LSN", "LAG", "IN-SYNC")
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


def replication_of(res: dict[str, Any]) -> dict[str, Any]:
    info = res.get("info")
    rep = info.get("replication") if isinstance(info, dict) else None
    return rep if isinstance(rep, dict) else {}


def group_primary(results: list[dict[str, Any]]) -> int | None:
    """Which of a group's probe results is its primary (server/replication/group.py's rule)."""
    return primary_of([replication_of(res) for res in results])


def replica_cells(url: str, rep: dict[str, Any], primary: dict[str, Any] | None) -> list[str]:
    """ROLE, EPOCH, LSN as replica ``url`` says them; LAG, IN-SYNC as the primary says them
    (server/replication/group.py)."""
    cells = [str(rep.get("role", "?")), str(rep.get("epoch", "?")), str(rep.get("lsn", "-"))]
    if primary is None:
        return [*cells, "?", "?"]
    if primary is rep:
        return [*cells, "-", "-"]
    behind = lag(primary, rep, url)
    listed = "yes" if in_sync(primary, rep, url) else "no"
    return [*cells, "?" if behind is None else str(behind), listed]


def table(
    groups: list[list[str]], reading: Reading, before: Reading | None = None
) -> tuple[list[str], bool]:
    """The table's lines for ``reading`` (one probe result per replica, in the order of
    ``groups`` flattened; rates against ``before``), and whether every shard is up and in
    fleet order, with one primary per group."""
    replicated = any(len(g) > 1 for g in groups)
    extra = _REPLICA_COLUMNS if replicated else ()
    header = (*_HEADER[:2], *extra, *_HEADER[2:])
    rows = [header]
    ok = True
    now = time.time()
    dt = reading.at - before.at if before is not None else 0.0
    n = len(groups)
    k = 0
    for i, group in enumerate(groups):
        results = reading.results[k : k + len(group)]
        priors = before.results[k : k + len(group)] if before is not None else [{}] * len(group)
        k += len(group)
        p = group_primary(results) if replicated else None
        primary = replication_of(results[p]) if p is not None else None
        if len(group) > 1 and p is None:
            ok = False
        for url, res, prior_res in zip(group, results, priors):
            info = res.get("info")
            if info is None:
                ok = False
                rows.append((url, "?", *(["-"] * len(extra)), *(["-"] * 7), "down"))
                continue
            slot = f"{info.get('shard_index')}/{info.get('num_shards')}"
            health = "yes" if res["healthy"] else "no"
            if (info.get("shard_index"), info.get("num_shards")) != (i, n):
                health = f"mismatch (listed as {i}/{n})"
            ok = ok and health == "yes"
            prior = prior_res.get("info") if before is not None else None
            cells = replica_cells(url, replication_of(res), primary) if replicated else []
            rows.append(
                (
                    url,
                    slot,
                    *cells,
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
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return lines, ok


def run(
    groups: list[list[str]],
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
    until Ctrl-C); 0 if every shard was up and in order in the last one (and every group had
    its primary), else 1. ``groups[i]``: the replicas of shard index ``i`` (one URL for an
    index without replicas). The probes go through ``proxy`` if given, else straight to the
    shards."""
    urls = [u for group in groups for u in group]
    redraw = watch and out.isatty()
    ok = False
    rounds = 0
    try:
        before = Reading(probe_fleet(urls, timeout, proxy), time.monotonic())
        while True:
            sleep(interval)
            reading = Reading(probe_fleet(urls, timeout, proxy), time.monotonic())
            lines, ok = table(groups, reading, before)
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
