"""``make bench`` itself (bench/): one quick run of every case end to end, and the arithmetic of
its GOALS and SCALE sections on rows made up for the purpose.

The timings a run prints are not checked here (speed goals live in the benchmark, not in
tests); what is checked is that the command runs, measures what it says, and reads its own
results right.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import (
    broadcast,
    concurrency,
    failover,
    fanout,
    floor,
    frameworks,
    goals,
    link,
    netns,
    optimizers,
    replication,
    scale,
    shardsize,
    step,
    syncround,
    timing,
)
from bench import rows as rows_case
from bench.transfer import RAW, SDK, SDK_BF16, SDK_F16, SDK_F16_OUT, SDK_OUT, SDK_TLS
from tests.conftest import ROOT


def _bench(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_a_quick_run_measures_every_case_and_writes_its_json(tmp_path):
    """Every case, tiny sizes: a table per case, every system each case compares, the GOALS
    (each marked not measured, with what would measure it) and a SCALE section that says why
    it is not estimated, rather than failing on transfers too short for /proc's CPU clock."""
    run = _bench(
        "--quick", "--sizes", "1000", "--seconds", "0.2", "--rounds", "1", "--out", str(tmp_path)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for case in (
        "transfer:",
        "link:",
        "step:",
        "workers:",
        "snapshot:",
        "optimizers:",
        "broadcast:",
        "syncround:",
        "rows:",
        "shardsize:",
        "concurrency:",
        "fanout:",
        "frameworks:",
        "floor:",
        "replication:",
        "failover:",
    ):
        assert case in out
    assert "GOALS" in out and "SCALE: not estimated" in out
    (written,) = tmp_path.glob("*.json")
    data = json.loads(written.read_text())
    rows = data["results"]
    systems = {(r["case"], r["op"]): set() for r in rows}
    for r in rows:
        systems[r["case"], r["op"]].add(r["system"])
        # A broadcast may reach its actors before the learner reads its push's reply (< 0).
        assert r["reps"] >= 1 and (r["p50_ms"] > 0 or r["case"] == "broadcast")
        if r["case"] in ("transfer", "link", "step", "shardsize", "floor"):  # small: ten times 5
            assert r["reps"] == 5 * timing.SMALL_FACTOR, r
    for op in ("pull", "push"):
        assert systems["step", op] == {SDK, step.GROUP, RAW}
    # the pulls into out= buffers have pull rows only
    assert systems["transfer", "push"] == {SDK, SDK_TLS, SDK_F16, SDK_BF16, RAW}
    assert systems["transfer", "pull"] == {
        *systems["transfer", "push"],
        SDK_OUT,
        SDK_F16_OUT,
    }
    # the link case measures where it can make network namespaces (root, ip, tc)
    if netns.unavailable() is None:
        assert systems["link", "pull"] == {RAW, *link.SYSTEMS}
        assert systems["link", "push"] == {RAW, SDK, SDK_F16, SDK_BF16}
        assert "link (10 Gbit/s): CPU ms per call" in out
    else:
        assert "link: not measured: " in out and ("link", "pull") not in systems
    assert systems["workers", "push"] == {RAW, goals.ONE_SHARD, goals.TWO_SHARDS}
    assert {"paramshard", "raw file"} <= systems["snapshot", "write"]
    for op in optimizers.OPS:
        assert systems["optimizers", op] == {optimizers.APPLY, optimizers.NUMPY}
    assert systems["broadcast", "broadcast"] == {broadcast.SDK}  # Ray's row needs --peers
    assert systems["syncround", "step"] == {syncround.SYNC, syncround.ASYNC}
    for op in ("pull", "push"):  # TF's rows need --peers
        assert systems["rows", op] == {RAW, rows_case.ONE_SHARD, rows_case.TWO_SHARDS}
    for r in data["results"]:
        if r["case"] == "rows":  # a 1,000-row table: batches of 2,000 ids, 1,000 distinct
            assert r["size"] == 1000 and r["ids"] == 2000 and r["bytes"] == 2000 * rows_case.DIM * 4
            assert r["rows_per_s"] == pytest.approx(2000 * r["ops_per_s"])
    # --quick scales the scale cases down: shards of 10^2 and 10^3 variables, 1 and 4 workers,
    # fleets of 1 and 2 shards (and the smaller one called in turn)
    for op in ("push", "pull"):
        assert systems["shardsize", op] == {shardsize.label(100), shardsize.label(1000)}
        assert systems["fanout", op] == {
            fanout.label(1),
            fanout.label(2),
            fanout.label(2, in_turn=True),
        }
    assert systems["concurrency", "step"] == {concurrency.label(1), concurrency.label(4)}
    for r in rows:
        if r["case"] == "concurrency":
            assert (
                r["errors"] == 0 and r["idle"]["connections"] == concurrency.IDLE_CONNECTIONS_QUICK
            )
        if r["case"] == "shardsize":
            assert r["fill_s"] >= 0 and r["bytes"] == shardsize.HOT * 1000 * 4
        if r["case"] == "fanout":  # the CPU a call costs, on both sides, and what it allows
            assert r["client_cpu_us"] >= 0 and r["shards_cpu_us"] >= 0
            assert r["cpu_floor_us"] == pytest.approx(
                fanout.cpu_floor(r["client_cpu_us"], r["shards_cpu_us"], r["cores"])
            )
    assert "KB per connection" in out and "variables/s" in out
    # a framework's step copies nothing parameter-sized (torch's pull receives into the
    # parameters); its model is fixed, so its goals are measured at any size
    workers = (frameworks.NUMPY, frameworks.TORCH, frameworks.JAX)
    assert systems["frameworks", "step"] == set(workers)
    copies = {r["system"]: r["copied_bytes"] / r["param_bytes"] for r in rows if "param_bytes" in r}
    assert all(copies[w] <= 0.01 for w in workers), copies
    for op in floor.OPS:
        assert systems["floor", op] == {RAW, floor.APP, floor.IN_PROTOCOL, SDK}
    for op in ("push", "increment"):
        assert systems["replication", op] == {replication.ALONE, replication.REPLICATED}
    for r in rows:  # the CPU of each process per operation; a shard alone has no backup
        if r["case"] == "replication":
            assert set(r["cpu_ms"]) == {"worker", "shard", "backup"}
            assert (r["cpu_ms"]["backup"] is None) == (r["system"] == replication.ALONE)
    assert "replication: CPU ms per operation" in out
    assert systems["failover", "failover"] == {failover.LEASE, failover.FAILOVER}
    # the frameworks' goals and the small-request goals against the raw socket have their
    # figures at this size
    measured = [g for g in data["meta"]["goals"] if g["met"] is not None]
    assert {g["goal"] for g in measured} == {
        f"{frameworks.NUMPY} step: copies",
        f"{frameworks.TORCH} step: copies",
        f"{frameworks.JAX} step: copies",
        "4 KB pull latency",
        "100 x 4 KB pull in one step",
        "100 x 4 KB push+apply in one step",
        "failover: kill -9 -> first acked write",
    }
    assert data["meta"]["scale"] is None


def test_small_transfers_get_more_repetitions_and_big_ones_fewer():
    small, full = timing.SMALL_BYTES, timing.FULL_REPS_BYTES
    assert timing.reps_for(4_000, 30, 10) == timing.reps_for(small, 30, 10) == 300
    assert timing.reps_for(small + 1, 30, 10) == timing.reps_for(full, 30, 10) == 30
    assert timing.reps_for(2 * full, 30, 10) == 15
    assert timing.reps_for(100 * full, 30, 10) == 10  # never below --min-reps


@pytest.mark.parametrize(
    "args, says",
    [
        (["--sizes", "0"], "--sizes"),
        (["--sizes", "1e3,x"], "--sizes"),
        (["--cases", "transfer,nope"], "nope"),
        (["--reps", "0"], "--reps"),
        (["--seconds", "-1"], "--seconds"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(args, says, tmp_path):
    run = _bench(*args, "--out", str(tmp_path), timeout=60)
    assert run.returncode == 2
    assert says in run.stderr
    assert not list(tmp_path.glob("*.json"))


def _row(case, op, size, system, **figures):
    return {"case": case, "op": op, "size": size, "system": system, **figures}


def test_goals_are_ratios_of_rows_of_the_same_run():
    rows = [
        _row("transfer", "pull", 10**6, SDK, mb_per_s=1500.0),
        _row("transfer", "pull", 10**6, RAW, mb_per_s=2000.0),
        _row("transfer", "pull", 10**6, goals.TF, mb_per_s=1000.0),
        _row("transfer", "push", 10**6, SDK, mb_per_s=800.0),
        _row("transfer", "push", 10**6, RAW, mb_per_s=2000.0),
        _row("transfer", "pull", 1000, SDK, p50_ms=0.4),
        _row("transfer", "pull", 1000, goals.TF, p50_ms=1.0),
        _row("step", "pull", 1000, SDK, ops_per_s=1000.0),
        _row("step", "pull", 1000, goals.TF, ops_per_s=125.0),
    ]
    by = {(g["goal"], g["versus"]): g for g in goals.evaluate(rows)}
    pull_raw = by["pull 1,000,000 elements", RAW]
    assert pull_raw["met"] and pull_raw["ratio"] == pytest.approx(0.75)
    assert by["pull 1,000,000 elements", goals.TF]["ratio"] == pytest.approx(1.5)
    push_raw = by["push 1,000,000 elements", RAW]
    assert push_raw["met"] is False and push_raw["note"] == "missed: needs 1.25x the MB/s it has"
    assert by["push 1,000,000 elements", goals.TF]["met"] is None  # TF's row is missing
    latency = by["4 KB pull latency", goals.TF]
    assert latency["met"] and latency["ratio"] == pytest.approx(0.4)
    step = by["100 x 4 KB pull in one step", goals.TF]
    assert step["met"] is False and step["note"] == "missed: needs 1.25x the steps/s it has"
    workers = by["4 workers, 4 MB pushes, 2 shards", "1 shard"]
    assert workers["met"] is None and "workers case" in workers["note"]
    rounds = goals.evaluate(
        [
            _row("syncround", "step", 10**5, syncround.SYNC, median_s=0.06),
            _row("syncround", "step", 10**5, syncround.ASYNC, median_s=0.05),
            _row("syncround", "step", 1000, syncround.SYNC, median_s=0.5),  # too small to count
            _row("syncround", "step", 1000, syncround.ASYNC, median_s=0.01),
        ]
    )
    (sync_goal,) = [g for g in rounds if g["goal"].startswith("sync round")]
    assert sync_goal["met"] and sync_goal["ratio"] == pytest.approx(1.2)
    assert "MISSED" in goals.render(list(by.values()))


def test_the_float16_goal_is_judged_into_new_arrays_and_into_out_buffers_apart():
    """Each float16 pull row is set against the float32 pull made the same way, over the link
    (judged) and on loopback (shown beside it, not judged)."""
    n = 25_000_000
    by = {
        g["goal"]: g
        for g in goals.evaluate(
            [
                _row("transfer", "pull", n, SDK, mb_per_s=1000.0),
                _row("transfer", "pull", n, SDK_F16, mb_per_s=1200.0),
                _row("transfer", "pull", n, SDK_OUT, mb_per_s=2000.0),
                _row("transfer", "pull", n, SDK_F16_OUT, mb_per_s=3400.0),
                _row("link", "pull", n, SDK, mb_per_s=1000.0),
                _row("link", "pull", n, SDK_F16, mb_per_s=1800.0),
                _row("link", "pull", n, SDK_OUT, mb_per_s=1000.0),
                _row("link", "pull", n, SDK_F16_OUT, mb_per_s=1500.0),
            ]
        )
    }
    # loopback: shown, not judged (bound by memory, not by the bytes on the wire)
    fresh = by["float16 pull of 100 MB, loopback"]
    into = by["float16 pull into out=, loopback"]
    assert fresh["versus"] == SDK and fresh["ratio"] == pytest.approx(1.2)
    assert into["versus"] == SDK_OUT and into["ratio"] == pytest.approx(1.7)
    assert all(g["met"] is None and g["shown"] for g in (fresh, into))
    rendered = goals.render(list(by.values()))
    assert "2 shown and not judged" in rendered
    assert rendered.count("\nshown   float16 pull") == 2
    fresh = by[f"float16 pull of 100 MB, {link.RATE_LABEL}"]
    into = by[f"float16 pull into out=, {link.RATE_LABEL}"]
    assert fresh["versus"] == SDK and fresh["ratio"] == pytest.approx(1.8) and fresh["met"]
    assert into["versus"] == SDK_OUT and into["ratio"] == pytest.approx(1.5) and not into["met"]
    # without the link's rows (no root) its goals say what would measure them
    unmeasured = [g for g in goals.evaluate([]) if g["goal"].endswith(link.RATE_LABEL)]
    assert len(unmeasured) == 2
    assert all(g["met"] is None and "as root" in g["note"] for g in unmeasured)


def test_the_link_case_says_why_it_measures_nothing_where_it_cannot_make_a_namespace(tmp_path):
    """Without iproute2 on the path (or without root) the link case measures nothing, says
    why, and the run succeeds."""
    path = os.path.dirname(sys.executable)  # the interpreter's own directory: no ip, no tc
    run = _bench(
        "--cases",
        "link",
        "--quick",
        "--sizes",
        "1000",
        "--out",
        str(tmp_path),
        timeout=60,
        env={**os.environ, "PATH": path},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "link: not measured: needs " in run.stdout
    (written,) = tmp_path.glob("*.json")
    assert not [r for r in json.loads(written.read_text())["results"] if r["case"] == "link"]


def _namespaces(prefix: str) -> dict[str, list[int]]:
    """The network namespaces whose names start with ``prefix``, each with its processes."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]
    return {
        name: [
            int(pid)
            for pid in subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True
            ).stdout.split()
        ]
        for name in names
    }


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_a_link_run_killed_midway_leaves_no_namespace_and_no_process_behind(tmp_path):
    """SIGKILL of ``python -m bench`` while the link case runs: its namespaces, and the shard,
    raw socket server and driver running in them, are removed by the guard it left."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--cases", "link", "--sizes", "1e6", "--reps", "100000"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prefix = f"{netns.PREFIX}{bench.pid}-"
    try:
        deadline = time.monotonic() + 90
        found: dict[str, list[int]] = {}
        # until the shard and raw server (server side) and the driver (client side) run
        while not (len(found) == 2 and all(found.values())) and time.monotonic() < deadline:
            assert bench.poll() is None, "the bench exited before it was killed"
            time.sleep(0.2)
            found = _namespaces(prefix)
        assert len(found) == 2 and all(found.values()), found
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait()
    inside = [pid for pids in found.values() for pid in pids]
    deadline = time.monotonic() + 30
    while (_namespaces(prefix) or any(_alive(p) for p in inside)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _namespaces(prefix)
    assert not [p for p in inside if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers: count it gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_broadcast_goals_bound_the_p50_and_compare_it_with_ray():
    n = broadcast.DEFAULT_SIZES[0]
    by = {
        g["versus"]: g
        for g in goals.evaluate([_row("broadcast", "broadcast", n, broadcast.SDK, p50_ms=2.4)])
        if g["goal"].startswith("broadcast")
    }
    assert by["3 ms"]["met"] and by["3 ms"]["ratio"] == pytest.approx(0.8)
    assert by[broadcast.RAY]["met"] is None and "--peers" in by[broadcast.RAY]["note"]
    rows = [
        _row("broadcast", "broadcast", n, broadcast.SDK, p50_ms=4.5),
        _row("broadcast", "broadcast", n, broadcast.RAY, p50_ms=6.0),
    ]
    by = {g["versus"]: g for g in goals.evaluate(rows) if g["goal"].startswith("broadcast")}
    assert by["3 ms"]["met"] is False and by["3 ms"]["note"] == "missed: needs 1.50x less p50"
    assert by[broadcast.RAY]["met"] is False and by[broadcast.RAY]["ratio"] == pytest.approx(0.75)


def test_a_rows_batch_is_half_repeats_and_the_same_for_every_system():
    ids = rows_case.batch(10**6, 3)
    assert ids.dtype == np.int64 and ids.size == rows_case.BATCH
    assert np.unique(ids).size == rows_case.BATCH // 2 and 0 <= ids.min() and ids.max() < 10**6
    assert np.array_equal(ids, rows_case.batch(10**6, 3))
    assert not np.array_equal(ids, rows_case.batch(10**6, 4))
    small = rows_case.batch(10, 0)  # a table smaller than half a batch: every row, each twice
    assert small.size == 20 and np.array_equal(np.unique(small), np.arange(10))


def test_the_rows_goals_compare_each_fleet_with_tensorflow():
    n = rows_case.DEFAULT_SIZES[0]

    def rows_goals(table):
        return {g["goal"]: g for g in goals.evaluate(table) if "_rows" in g["goal"]}

    by = rows_goals(
        [
            _row("rows", "pull", n, rows_case.ONE_SHARD, ops_per_s=300.0),
            _row("rows", "pull", n, rows_case.TWO_SHARDS, ops_per_s=150.0),
            _row("rows", "pull", n, goals.TF, ops_per_s=100.0),
            _row("rows", "push", n, rows_case.ONE_SHARD, ops_per_s=200.0),
        ]
    )
    assert len(by) == 4 and all(g["versus"] == goals.TF for g in by.values())
    one = by["pull_rows 1,000,000x64, 1 shard"]
    assert one["met"] and one["ratio"] == pytest.approx(3.0) and one["target"] == ">= 2x"
    two = by["pull_rows 1,000,000x64, 2 shards"]
    assert two["met"] is False and two["note"] == "missed: needs 1.33x the rows/s it has"
    assert by["push_rows 1,000,000x64, 1 shard"]["note"] == "needs --peers"
    assert "not measured" in by["push_rows 1,000,000x64, 2 shards"]["note"]
    small = rows_goals([_row("rows", "pull", 1000, rows_case.ONE_SHARD, ops_per_s=1.0)])
    assert all(g["met"] is None for g in small.values())  # only the 10^6-row table counts


def test_the_scale_goals_bound_growth_in_variables_workers_and_shards():
    """Shard size: each bigger shard's time / the 10^2 shard's; workers: 64 against the best
    phase, p99 against p50, failed steps; fan-out: 16 shards against 1 and against in turn."""
    n = 1000
    rows = [
        _row("shardsize", "push", n, shardsize.label(100), median_s=0.010),
        _row("shardsize", "push", n, shardsize.label(10**4), median_s=0.011),
        _row("shardsize", "push", n, shardsize.label(10**6), median_s=0.0125),
        _row("concurrency", "step", n, concurrency.label(1), ops_per_s=500.0),
        _row("concurrency", "step", n, concurrency.label(16), ops_per_s=1000.0),
        _row(
            "concurrency",
            "step",
            n,
            concurrency.label(64),
            ops_per_s=900.0,
            p50_ms=60.0,
            p99_ms=700.0,
            errors=2,
        ),
        _row("fanout", "pull", n, fanout.label(1), median_s=0.001),
        _row(
            "fanout",
            "pull",
            n,
            fanout.label(16),
            median_s=0.003,
            mean_s=0.0032,
            cpu_floor_us=2000.0,
            cores=2,
        ),
        _row("fanout", "pull", n, fanout.label(16, in_turn=True), median_s=0.005),
    ]
    by = {(g["goal"], g["versus"], g["measure"]): g for g in goals.evaluate(rows)}
    small = by["push 100x4KB, 10,000 held", "100 held", "median time"]
    assert small["met"] and small["ratio"] == pytest.approx(1.1)
    big = by["push 100x4KB, 1,000,000 held", "100 held", "median time"]
    assert big["met"] is False and big["ratio"] == pytest.approx(1.25)
    assert by["pull 100x4KB, 10,000 held", "100 held", "median time"]["met"] is None
    crowd = by["64 workers on one shard", "best of 1-64", "steps/s"]
    assert crowd["met"] and crowd["ratio"] == pytest.approx(0.9)
    tail = by["64 workers on one shard", "their p50", "p99"]
    assert tail["met"] is False and tail["ratio"] == pytest.approx(700 / 60)
    failed = by["64 workers on one shard", "none", "failed steps"]
    assert failed["met"] is False and failed["ratio"] == 2
    one = by["pull in one call over 16 shards", fanout.label(1), "median time"]
    assert one["met"] and one["ratio"] == pytest.approx(3.0)
    in_turn = by["pull in one call over 16 shards", "16 in turn", "median time"]
    assert in_turn["met"] is False and in_turn["ratio"] == pytest.approx(0.6)
    cores = by["pull in one call over 16 shards", "cpu / 2 cores", "mean time"]
    assert cores["met"] is False and cores["ratio"] == pytest.approx(1.6)
    assert by["push in one call over 16 shards", fanout.label(1), "median time"]["met"] is None
    assert by["push in one call over 16 shards", "cpu / ? cores", "mean time"]["met"] is None


def test_the_fanout_floor_is_the_clients_thread_or_all_the_cpu_over_every_core():
    assert fanout.cpu_floor(0.9, 2.0, 2) == pytest.approx(1.45)
    assert fanout.cpu_floor(0.9, 0.1, 2) == pytest.approx(0.9)  # the client's thread
    assert fanout.cpu_floor(0.9, 2.0, 0) == pytest.approx(2.9)


def test_the_workers_goal_says_what_this_machines_cores_allow():
    """1 shard: 0.32 CPU ms per MB (one core: <= 3,125 MB/s); 2 shards: 0.4 ms/MB in the
    shards and 0.3 in the workers, so 2 cores allow 2 / 0.7 x 0.32 = 0.91x and 8 cores the two
    shards' own bound, 2 / 0.4 x 0.32 = 1.6x."""
    one = _row("workers", "push", 10**6, goals.ONE_SHARD, mb_per_s=2500.0, servers_cores_busy=0.8)
    two = _row(
        "workers",
        "push",
        10**6,
        goals.TWO_SHARDS,
        mb_per_s=2500.0,
        servers_cores_busy=1.0,
        workers_cores_busy=0.75,
    )
    assert goals.workers_ceiling(two, one, cores=2)["ratio"] == pytest.approx(0.32 * 2 / 0.7)
    assert goals.workers_ceiling(two, one, cores=8)["ratio"] == pytest.approx(1.6)
    assert goals.workers_ceiling(two, None) is None
    (goal,) = [g for g in goals.evaluate([one, two]) if g["goal"].startswith("4 workers")]
    assert goal["met"] is False and "allow at most" in goal["note"]


def test_scale_turns_measured_cpu_per_gb_into_shards_and_hosts():
    """0.25 + 0.5 CPU-s/GB at 256 GB/s each way: 192 cores, 192 one-core shards, 12 hosts of
    16 cores by CPU but 21 by 100 Gb/s NIC; and no estimate from CPU figures that read zero."""

    def transfer(op, system, cpu_s, gb):
        return _row("transfer", op, 10**7, system, server_cpu_s=cpu_s, server_gb=gb)

    rows = [
        transfer("pull", SDK, 0.5, 2.0),
        transfer("push", SDK, 1.0, 2.0),
        transfer("pull", RAW, 0.4, 2.0),
        transfer("push", RAW, 0.4, 2.0),
    ]
    est = scale.estimate(rows)
    assert est["cpu_s_per_gb_pull"] == pytest.approx(0.25)
    assert est["cpu_s_per_gb_push"] == pytest.approx(0.5)
    assert est["cores"] == pytest.approx(192.0)
    assert est["shards"] == 192 and est["hosts_by_cpu"] == 12 and est["hosts_by_nic"] == 21
    assert est["binds"] == "NIC" and est["raw_shards"] == 103
    assert "192 shards on 21 hosts" in scale.render(est)
    zero = [transfer("pull", SDK, 0.0, 0.004), transfer("push", SDK, 0.0, 0.004)]
    assert scale.estimate(zero) is None
    assert "not estimated" in scale.render(None)
    # small transfers' CPU is per-request work: not used; 10^6 is, when nothing bigger ran
    small = [{**r, "size": 10**5} for r in rows]
    assert scale.estimate(small) is None
    est = scale.estimate([{**r, "size": 10**6} for r in rows] + small)
    assert est["sizes"] == [10**6] and est["cpu_s_per_gb_pull"] == pytest.approx(0.25)


def test_the_step_cost_diagnostic_runs():
    """python -m bench.stepcost (not part of make bench): every figure it prints, tiny."""
    from bench import stepcost

    lines: list[str] = []
    figures = stepcost.run(3, 10, 5, out=lines.append)
    assert len(figures) == len(lines) == 34
    # the live split's CPU figures may be 0 over a few calls (a tick is 10 ms), the rest < 0
    assert all(us > 0 for k, us in figures.items() if ": " not in k)
    assert sum("live: wall" in k for k in figures) == 4
    assert any("the shard's protocol and app" in line for line in lines)


def test_the_row_cost_diagnostic_runs():
    """python -m bench.rowcost (not part of make bench): every figure it prints, tiny."""
    from bench import rowcost

    lines: list[str] = []
    figures = rowcost.run(300, 3, out=lines.append, fleets=(1,))
    assert len(lines) == len(figures) + 1  # and the column titles
    assert [k for k in figures if k.startswith("PSClient.") and ":" not in k] == [
        "PSClient.push_rows, 1 shard",
        "PSClient.pull_rows, 1 shard",
    ]
    in_process = [cpu for k, (_, cpu) in figures.items() if k.startswith("the ")]
    assert len(in_process) == 4 and all(cpu > 0 for cpu in in_process)


def test_the_small_request_goals_compare_with_the_raw_socket():
    """The floor case's 4 KB pull (p50, at most 4x the raw socket's) and the step case's
    100 x 4 KB pull and push+apply through a step group (steps/s, at least 0.9x and 0.75x the
    raw socket's)."""
    rows = [
        _row("floor", "pull", floor.DEFAULT_SIZES[0], SDK, p50_ms=0.2),
        _row("floor", "pull", floor.DEFAULT_SIZES[0], RAW, p50_ms=0.04),
        _row("floor", "pull", floor.DEFAULT_SIZES[0], floor.IN_PROTOCOL, p50_ms=0.1),
        _row("step", "pull", 1000, SDK, ops_per_s=200.0),  # the goals judge the group's rows
        _row("step", "pull", 1000, step.GROUP, ops_per_s=950.0),
        _row("step", "pull", 1000, RAW, ops_per_s=1000.0),
        _row("step", "push", 1000, step.GROUP, ops_per_s=500.0),
        _row("step", "push", 1000, RAW, ops_per_s=1000.0),
    ]
    by = {g["goal"]: g for g in goals.evaluate(rows) if g["versus"] == RAW}
    latency = by["4 KB pull latency"]
    assert latency["met"] is False and latency["ratio"] == pytest.approx(5.0)
    assert latency["note"] == "missed: needs 1.25x less p50"
    pull = by["100 x 4 KB pull in one step"]
    assert pull["met"] and pull["ratio"] == pytest.approx(0.95)
    push = by["100 x 4 KB push+apply in one step"]
    assert push["met"] is False and push["target"] == ">= 0.75x"
    missing = {g["goal"]: g for g in goals.evaluate([]) if g["versus"] == RAW}
    assert missing["4 KB pull latency"]["met"] is None
    assert "floor case" in missing["4 KB pull latency"]["note"]


def test_the_small_request_diagnostic_runs_in_one_process():
    """python -m bench.smallcost's in-process part (not part of make bench), tiny: the SDK's
    and the server's share of each small request, for the floor and the shard, and a profile
    of each side naming its own modules."""
    from bench import smallcost

    lines: list[str] = []
    figures = smallcost.run_in_process(20, profile=3, out=lines.append, layers=False)
    assert set(figures) == {
        (op, variant)
        for op in smallcost.OPS
        for variant in ("floor (in protocol)" if op == "pull" else "floor (app)", "paramshard")
    }
    assert all(sdk > 0 and server > 0 for sdk, server in figures.values())
    text = "\n".join(lines)
    assert "client_sdk" not in text.split("server side")[-1]
    assert text.count("server side:") == text.count("client side:") == 6
