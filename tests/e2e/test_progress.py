"""Long CLI work shows progress on a terminal and stays quiet in logs: ``paramshard reshard``
and the restore of ``paramshard serve`` at start, each run once with standard error on a
pseudo-terminal (the progress line is drawn: a share, the bytes, ``done``) and once on a pipe
or a file (not a byte of it); and :class:`server.progress.Progress` itself, against a stream
that says it is a terminal and one that does not.
"""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import numpy as np

from server import persistence
from server.progress import Progress
from server.store import ParameterStore
from tests.conftest import ROOT
from tests.helpers.eventually import eventually

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_only() -> None:
    clock = iter(float(t) for t in range(100))
    shown = Terminal()
    p = Progress(shown, clock=lambda: next(clock))
    p.begin("restoring x", 4096)
    p.add(1024)
    p.add(3072)
    p.end()
    text = shown.getvalue()
    assert "restoring x:   0% (0 B of 4.0 KiB)" in text
    assert "restoring x:  25% (1.0 KiB of 4.0 KiB)" in text
    assert text.endswith("restoring x: done, 4.0 KiB in 4.0s\n")
    quiet = io.StringIO()
    p = Progress(quiet)
    p.begin("restoring x", 4096)
    p.add(4096)
    p.end()
    assert quiet.getvalue() == ""


def write_checkpoint(data_dir, megabytes: int = 8) -> None:
    """A one-shard checkpoint ``ck`` of a few variables, ``megabytes`` in all."""
    store = ParameterStore(0, 1)
    n = megabytes * (1 << 20) // 4 // 4
    store.init({f"v{i}": (np.full(n, i, np.float32), None) for i in range(4)})
    persistence.write_snapshot(data_dir, 1, store.capture(), incarnation="x", checkpoint="ck")


def run_on_terminal(
    args: list[str], until: str | None, timeout: float = 60.0
) -> tuple[str, object]:
    """Run ``args`` with standard error on a pseudo-terminal until it prints ``until`` (None:
    until it exits); its terminal output and the process."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while (until is None or until.encode() not in seen) and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the process closed its end
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
    return seen.decode(errors="replace"), proc


def test_reshard_shows_progress_on_a_terminal_and_nothing_on_a_pipe(tmp_path) -> None:
    write_checkpoint(tmp_path / "src")
    args = [sys.executable, "-m", "server.cli", "reshard", "--from", str(tmp_path / "src")]
    shown, proc = run_on_terminal([*args, "--to", str(tmp_path / "a"), "--shards", "2"], None)
    assert proc.wait(60) == 0
    assert "reading 1 snapshot(s):" in shown and "%" in shown, shown
    assert "writing 2 shard(s): done, 8.0 MiB" in shown, shown
    piped = subprocess.run(
        [*args, "--to", str(tmp_path / "b"), "--shards", "2"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.returncode == 0, piped.stderr
    assert "reading" not in piped.stderr and "\r" not in piped.stderr, piped.stderr
    assert "rewritten for 2" in piped.stdout


def test_a_restore_at_start_shows_progress_on_a_terminal_only(tmp_path) -> None:
    data = tmp_path / "data"
    write_checkpoint(data)
    serve = [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--data-dir", str(data)]
    shown, proc = run_on_terminal(serve, "restoring snapshot-")
    try:
        assert "restoring snapshot-" in shown, shown
    finally:
        proc.terminate()
        proc.wait(30)
    log = tmp_path / "serve.log"
    port_file = tmp_path / "port"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*serve, "--port-file", str(port_file)], cwd=ROOT, env=ENV, stderr=f, stdout=f
        )
    try:
        eventually(lambda: "restored snapshot" in log.read_text(), "the shard restored")
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "restoring snapshot-" not in text and "\r" not in text, text
