"""An example script of examples/ run as a user runs it: its own process group (the worker
processes it starts go with it), its output captured, killed whole if it outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: Path, args: list[str], env: Mapping[str, str], timeout: float) -> str:
    """``python SCRIPT ARGS`` from the repository root with ``env`` (ROOT first on PYTHONPATH);
    its stdout and stderr together. It must exit 0: its output's tail is the failure otherwise."""
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the workers it starts are killed with it
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    return out
