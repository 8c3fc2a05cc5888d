"""Turn result rows into the printed table and the JSON file."""

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

__all__ = ["add_ratios", "machine", "table", "write_json"]


def add_ratios(rows: list[dict]) -> None:
    """Give every row ``vs_reference`` = reference median time / its median time (for the same
    bytes: its MB/s / the reference's MB/s). 1.0 is as fast as the reference, 0.5 half as fast."""
    refs = {_group(r): r for r in rows if r.get("reference")}
    for r in rows:
        ref = refs.get(_group(r))
        r["vs_reference"] = (ref["median_s"] / r["median_s"]) if ref and r["median_s"] else None


def _group(row: dict) -> tuple:
    return row["case"], row["op"], row.get("size")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _rate(mb_per_s: float | None) -> str:
    if mb_per_s is None:
        return "-"
    return format(mb_per_s, ",.0f" if mb_per_s >= 100 else ".3g")


def table(rows: Sequence[dict], descriptions: dict[str, str]) -> str:
    """One block per case; inside it one line per system, grouped by (op, size)."""
    out: list[str] = []
    head = (f"{'op':<6}{'elements':>12}{'MB':>9}  {'system':<14}{'MB/s':>9}{'vs ref':>8}"
            f"{'p50 ms':>10}{'p99 ms':>10}{'reps':>6}")
    case = group = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            out += ["", f"{case}: {descriptions.get(case, '')}", head, "-" * len(head)]
        g = _group(r)
        first = g != group
        group = g
        size = r.get("size")
        mb = r["bytes"] / 1e6 if "bytes" in r else None
        out.append(
            (f"{r['op']:<6}{size:>12,}{_num(mb, '.3g'):>9}" if first and size is not None
             else f"{r['op'] if first else '':<6}{'':>12}{'':>9}")
            + f"  {r['system']:<14}{_rate(r.get('mb_per_s')):>9}"
            + f"{_num(r.get('vs_reference'), '.2f'):>7}x"
            + f"{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['reps']:>6}"
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
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "commit": commit or None,
        "packages": {d: version(d) for d in ("numpy", "msgpack", "httpx2", "fastapi", "uvicorn",
                                              "uvloop", "httptools")},
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
