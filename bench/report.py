"""Turn result rows into the printed tables and the JSON file."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["add_ratios", "cpu_table", "machine", "table", "write_json"]


def add_ratios(rows: list[dict]) -> None:
    """Give every row ``vs_reference``: its rate / the reference's rate in the same
    (case, op, size) group. Rates are MB/s where both rows have one (for the same bytes that
    is reference median time / its median time), else operations per second. 1.0 is as fast
    as the reference, 0.5 half as fast."""
    refs = {_group(r): r for r in rows if r.get("reference")}
    for r in rows:
        ref = refs.get(_group(r))
        key = "mb_per_s" if ref and "mb_per_s" in ref and "mb_per_s" in r else "ops_per_s"
        r["vs_reference"] = r[key] / ref[key] if ref and ref.get(key) else None


def _group(row: dict) -> tuple:
    return row["case"], row["op"], row.get("size")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return format(x, ",.0f" if x >= 100 else ".3g")


def _mb(x: float | None) -> str:
    if x is None:
        return "-"
    return format(x, ",.0f" if x >= 100 else ".3g")


def _size_label(row: dict) -> str:
    if row.get("label"):
        return row["label"]
    return "" if row.get("size") is None else f"{row['size']:,}"


def table(rows: Sequence[dict], descriptions: dict[str, str]) -> str:
    """One block per case; inside it one line per system, grouped by (op, size)."""
    out: list[str] = []
    head = (
        f"{'op':<8}{'elements':>14}{'MB':>8}  {'system':<22}{'MB/s':>8}{'ops/s':>8}"
        f"{'vs ref':>8}{'p50 ms':>10}{'p99 ms':>10}{'reps':>6}"
    )
    case = group = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            out += ["", f"{case}: {descriptions.get(case, '')}", head, "-" * len(head)]
        g = _group(r)
        first = g != group
        group = g
        mb = r["bytes"] / 1e6 if "bytes" in r else None
        out.append(
            (
                f"{r['op']:<8}{_size_label(r):>14}{_mb(mb):>8}"
                if first
                else f"{'':<8}{'':>14}{'':>8}"
            )
            + f"  {r['system']:<22}{_rate(r.get('mb_per_s')):>8}{_rate(r.get('ops_per_s')):>8}"
            + f"{_num(r.get('vs_reference'), '.2f'):>7}x"
            + f"{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['reps']:>6}"
        )
    return "\n".join(out)


def cpu_table(rows: Sequence[dict]) -> str:
    """Server CPU-seconds per GB moved, for the rows that measured it (``server_cpu_s``) at
    sizes of 10^6 elements or more (below that the total is a few 10 ms clock ticks)."""
    measured = [
        r
        for r in rows
        if r.get("server_cpu_s_per_gb") is not None and (r.get("size") or 0) >= 10**6
    ]
    if not measured:
        return ""
    head = (
        f"{'op':<6}{'elements':>14}  {'system':<22}{'server CPU s':>13}{'GB moved':>10}"
        f"{'CPU s/GB':>10}"
    )
    out = [
        "",
        "server CPU: utime+stime of the server process(es) from /proc/<pid>/stat, summed "
        "over the timed repetitions (sizes >= 10^6)",
        head,
        "-" * len(head),
    ]
    for r in measured:
        out.append(
            f"{r['op']:<6}{_size_label(r):>14}  {r['system']:<22}"
            f"{r['server_cpu_s']:>13.3f}{r['server_gb']:>10.3f}"
            f"{r['server_cpu_s_per_gb']:>10.3f}"
        )
    return "\n".join(out)


def machine() -> dict:
    """What the numbers were measured on."""

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "loadavg": load,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "commit": commit or None,
        "packages": {
            d: version(d)
            for d in (
                "numpy",
                "msgpack",
                "httpx2",
                "fastapi",
                "uvicorn",
                "uvloop",
                "httptools",
                "tensorflow-cpu",
                "torch",
                "ray",
                "redis",
            )
        },
    }


def write_json(rows: Sequence[dict], meta: dict, directory: Path) -> Path:
    """Write ``{"meta", "results"}`` to ``directory/<UTC timestamp>.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = directory / f"{stamp}.json"
    n = 1
    while path.exists():
        n += 1
        path = directory / f"{stamp}-{n}.json"
    path.write_text(json.dumps({"meta": meta, "results": list(rows)}, indent=2) + "\n")
    return path
