"""``paramshard reshard`` run as an operator runs it: a process of its own on stopped fleets' data
dirs, its exit status and output returned for the test to judge."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_reshard(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``paramshard reshard ARGS`` from this checkout; whatever it exits with."""
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "reshard", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def reshard(
    sources: Sequence[Path], dest: Path, shards: int, *extra: str
) -> tuple[subprocess.CompletedProcess, list[Path]]:
    """Reshard ``sources`` into ``shards`` data dirs under ``dest``; the run (it must succeed:
    its stderr is the failure message otherwise) and the new dirs, in shard order."""
    run = run_reshard(
        "--from", *map(str, sources), "--to", str(dest), "--shards", str(shards), *extra
    )
    assert run.returncode == 0, run.stderr
    return run, [dest / f"shard-{j}" for j in range(shards)]
