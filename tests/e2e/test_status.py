"""``paramshard status`` as a user runs it against shard processes: pushes/s and pulls/s while a
worker trains (and none for a shard nobody writes to), the last snapshot's age, the auth
column, ``--watch`` refreshing ``--count`` times with the exit status of the last table, and
bad ``--interval``/``--count``/``--timeout`` values refused as usage errors.
"""

from __future__ import annotations

import threading

import httpx2
import numpy as np
import pytest

from client_sdk import PSClient
from client_sdk.placement import shard_for
from tests.e2e.test_cli import run_cli
from tests.helpers.ports import refused_port

HEADER = "URL SHARD INCARNATION VARIABLES BYTES PUSHES/S PULLS/S SNAPSHOT AUTH HEALTHY".split()


def rows(stdout: str) -> list[dict[str, str]]:
    """Every table row of ``stdout`` (one or several tables) as ``{column: cell}``, cut at the
    columns of the table's header line (cells are padded to the header's columns)."""
    out = []
    starts: list[int] = []
    for line in stdout.splitlines():
        if line.startswith("URL "):
            starts = [line.index(column) for column in HEADER]
            continue
        if not line.strip() or not starts:
            continue
        bounds = [*starts[1:], None]
        out.append({c: line[a:b].strip() for c, a, b in zip(HEADER, starts, bounds)})
    return out


def test_status_shows_rates_snapshot_age_and_watches(fleet_factory) -> None:
    fleet = fleet_factory(2, data=True)
    urls = list(fleet.urls)
    name = next(f"w{k}" for k in range(99) if shard_for(f"w{k}", 2) == 1)
    stop = threading.Event()

    def worker() -> None:
        with PSClient(shards=urls, worker_id="status-worker") as ps:
            ps.init({name: np.zeros(8, np.float32)})
            while not stop.is_set():
                ps.pull([name])
                ps.push({name: np.ones(8, np.float32)})
                stop.wait(0.01)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        r = httpx2.post(
            urls[1] + "/v1/snapshot",
            content=b"\x80",
            timeout=30,
            headers={"content-type": "application/msgpack"},
        )
        assert r.status_code == 200, r.text
        done = run_cli("status", "--shards", ",".join(urls), "--interval", "1")
        assert done.returncode == 0, done.stdout + done.stderr
        first, second = rows(done.stdout)
        assert float(second["PUSHES/S"]) > 0 and float(second["PULLS/S"]) > 0, done.stdout
        assert first["PUSHES/S"] == "0.0" and first["PULLS/S"] == "0.0", done.stdout
        assert second["SNAPSHOT"].endswith("s ago"), done.stdout
        assert first["SNAPSHOT"] == "none", done.stdout
        assert second["AUTH"] and second["HEALTHY"] == "yes"

        watched = run_cli(
            "status", "--shards", ",".join(urls), "--watch", "--interval", "0.2", "--count", "3"
        )
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert watched.stdout.count("INCARNATION") == 3
        assert len(rows(watched.stdout)) == 6
    finally:
        stop.set()
        thread.join(timeout=30)

    with refused_port() as port:
        shards = ",".join([*urls, f"http://127.0.0.1:{port}"])
        down = run_cli("status", "--shards", shards, "--watch", "--interval", "0.2", "--count", "2")
    assert down.returncode == 1
    assert [r["HEALTHY"] for r in rows(down.stdout)][-1] == "down"


@pytest.mark.parametrize(
    "args",
    [
        ("--interval", "0"),
        ("--interval", "nan"),
        ("--interval", "soon"),
        ("--count", "0"),
        ("--count", "x"),
        ("--timeout", "-1"),
    ],
)
def test_bad_status_flags_are_usage_errors(args: tuple[str, str]) -> None:
    done = run_cli("status", "--shards", "http://127.0.0.1:1", "--watch", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert args[0] in done.stderr
