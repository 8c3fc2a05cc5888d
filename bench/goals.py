"""The GOALS section: the project's speed goals, each a ratio of two figures from the same run.

* pull and push+apply of >= 10^6 elements: >= 0.5 x the raw socket's MB/s, and >= 1.2 x
  TensorFlow's gRPC parameter server's;
* a 4 KB pull's p50 latency <= 0.5 x TensorFlow's;
* 100 x 4 KB pulled in one step: >= 10 x TensorFlow's steps/s;
* 4 workers pushing 4 MB against 2 shards: aggregate >= 1.3 x the same against 1 shard;
* each optimizer's update of a 2.5·10^7-element float32 variable: <= 1.25 x the time of the
  same formula as a plain in-place numpy sequence;
* broadcast of a 1 MB model to 8 waiting actors: p50 <= 3 ms from the push's reply until every
  actor holds it, and <= 0.5 x the same pattern on Ray's object store;
* a sync round of 4 workers <= 1.5 x an async step of the same 4 on the same model (10 x
  10^5 float32 or bigger);
* rows of an embedding table of 10^6 x 64 float32, batches of 4,096 ids: ``pull_rows`` and
  ``push_rows`` through 1 and through 2 shards, each >= 2 x the rows/s of TensorFlow's gRPC
  parameter server doing the same lookup and sparse update;
* a pull of a 100 MB float32 variable with ``wire_dtype="float16"``: >= 1.6 x the float32
  pull's MB/s, both counted in the float32 bytes delivered; into new arrays, and into ``out=``
  buffers (float16 into its buffer vs float32 into its buffer: the transfer without the
  allocator's fresh pages). Judged over a 10 Gbit/s link (:mod:`bench.link`), and shown on
  loopback too, where a transfer is bound by memory, not by the bytes on the wire;
* costs that stay flat as a fleet grows (:func:`_scale_goals`): a push and a pull of 100 x 4 KB
  on a shard holding 10^4 and 10^6 variables <= 1.2 x the time on one holding 10^2; 64
  workers on one shard: aggregate steps/s >= 0.8 x the best of 1, 4, 16 and 64, their p99 <=
  10 x their p50, no step failed; one SDK call over 16 shards <= 4 x the time of the same call
  to 1 shard, and <= 0.5 x the 16 shards called one after another;
* a framework worker's step (pull, forward/backward, push; :mod:`bench.frameworks`): the
  bytes the SDK copies outside the socket <= 0.01 x the parameters' bytes (no
  parameter-sized copy), for the numpy worker, torch's and jax's;
* small requests against the raw socket (:mod:`bench.floor`, :mod:`bench.step`): a 4 KB
  pull's p50 <= 4 x the raw socket's round trip of the same bytes; 100 x 4 KB in one step
  through a step group >= 0.9 x the raw socket's rate moving the same 400 KB in one message
  for a pull, and >= 0.75 x for a push+apply;
* a push of 4 MB through a primary that answers once its one backup applied it (a replica
  group, :mod:`bench.replication`): >= 0.6 x the MB/s of the same push to a shard alone.
* failover (:mod:`bench.failover`): from a kill -9 of a primary elected in etcd to the first
  write a worker sees acknowledged by the new one, p50 <= 1.5 x the lease TTL (3 s at the
  default 2 s).

:func:`evaluate` returns one dict per goal (JSON-ready); :func:`render` prints them. A goal
whose figures were not measured in this run says what would measure it (``--peers`` for the
TensorFlow ones, a size of 10^6 or more for the bandwidth ones).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from . import (
    broadcast,
    concurrency,
    failover,
    fanout,
    floor,
    frameworks,
    optimizers,
    replication,
    shardsize,
    step,
)
from . import rows as row_case
from .link import RATE_LABEL
from .peers import PEERS
from .syncround import ASYNC, SYNC
from .transfer import RAW, SDK, SDK_F16, SDK_F16_OUT, SDK_OUT

__all__ = ["evaluate", "render", "workers_ceiling"]

TF = PEERS["tf"].label
ONE_SHARD, TWO_SHARDS = row_case.ONE_SHARD, row_case.TWO_SHARDS


def _find(rows: Sequence[dict], case: str, op: str, size: int, system: str) -> dict | None:
    return next(
        (
            r
            for r in rows
            if r["case"] == case
            and r["op"] == op
            and r.get("size") == size
            and r["system"] == system
        ),
        None,
    )


def _goal(
    what: str,
    versus: str,
    measure: str,
    mine: dict | None,
    theirs: dict | None,
    key: str,
    at_least: bool,
    target: float,
    missing: str,
) -> dict:
    goal = {
        "goal": what,
        "versus": versus,
        "measure": measure,
        "target": f"{'>=' if at_least else '<='} {target:g}x",
    }
    if mine is None or theirs is None or not theirs.get(key) or not mine.get(key):
        return {**goal, "ratio": None, "met": None, "note": missing}
    ratio = mine[key] / theirs[key]
    met = ratio >= target if at_least else ratio <= target
    if met:
        note = ""
    elif at_least:
        note = f"missed: needs {target / ratio:.2f}x the {measure} it has"
    else:
        note = f"missed: needs {ratio / target:.2f}x less {measure}"
    return {**goal, "ratio": ratio, "met": met, "note": note}


def evaluate(rows: Sequence[dict]) -> list[dict]:
    """One dict per goal: ``goal``, ``versus``, ``measure``, ``target``, ``ratio`` (or
    ``None``), ``met`` (or ``None`` if not measured) and a ``note``."""
    out: list[dict] = []
    big = sorted({r["size"] for r in rows if r["case"] == "transfer" and r["size"] >= 10**6})
    for op in ("pull", "push"):
        if not big:
            for versus in (RAW, TF):
                out.append(
                    _goal(
                        f"{op} >= 10^6 elements",
                        versus,
                        "MB/s",
                        None,
                        None,
                        "mb_per_s",
                        True,
                        0.5 if versus == RAW else 1.2,
                        "not measured: run with a size >= 1e6",
                    )
                )
        for n in big:
            what = f"{op} {n:,} elements"
            mine = _find(rows, "transfer", op, n, SDK)
            out.append(
                _goal(
                    what,
                    RAW,
                    "MB/s",
                    mine,
                    _find(rows, "transfer", op, n, RAW),
                    "mb_per_s",
                    True,
                    0.5,
                    "not measured",
                )
            )
            out.append(
                _goal(
                    what,
                    TF,
                    "MB/s",
                    mine,
                    _find(rows, "transfer", op, n, TF),
                    "mb_per_s",
                    True,
                    1.2,
                    "needs --peers",
                )
            )
    out += _half_goals(rows)
    out.append(
        _goal(
            "4 KB pull latency",
            TF,
            "p50",
            _find(rows, "transfer", "pull", 1000, SDK),
            _find(rows, "transfer", "pull", 1000, TF),
            "p50_ms",
            False,
            0.5,
            "needs --peers"
            if _find(rows, "transfer", "pull", 1000, SDK)
            else "not measured: run the transfer case with size 1e3 and --peers",
        )
    )
    out.append(
        _goal(
            "100 x 4 KB pull in one step",
            TF,
            "steps/s",
            _find(rows, "step", "pull", 1000, SDK),
            _find(rows, "step", "pull", 1000, TF),
            "ops_per_s",
            True,
            10.0,
            "needs --peers"
            if _find(rows, "step", "pull", 1000, SDK)
            else "not measured: run the step case with --peers",
        )
    )
    two, one = (
        _find(rows, "workers", "push", 10**6, TWO_SHARDS),
        _find(rows, "workers", "push", 10**6, ONE_SHARD),
    )
    workers_goal = _goal(
        "4 workers, 4 MB pushes, 2 shards",
        "1 shard",
        "aggregate MB/s",
        two,
        one,
        "mb_per_s",
        True,
        1.3,
        "not measured: run the workers case at size 1e6",
    )
    ceiling = workers_ceiling(two, one)
    if ceiling is not None and workers_goal["met"] is False:
        workers_goal["note"] += (
            f"; this machine's {ceiling['cores']} cores allow at most {ceiling['ratio']:.2f}x "
            f"at this run's CPU per MB (bench/README.md)"
        )
    out.append(workers_goal)
    big = optimizers.DEFAULT_SIZES[0]
    for op in optimizers.OPS:
        out.append(
            _goal(
                f"{op} update of {big:,}",
                "plain numpy",
                "median time",
                _find(rows, "optimizers", op, big, optimizers.APPLY),
                _find(rows, "optimizers", op, big, optimizers.NUMPY),
                "median_s",
                False,
                1.25,
                f"not measured: run the optimizers case at size {big:.2g}",
            )
        )
    out += _broadcast_goals(rows)
    # the model the goal is about: 10^5 elements a variable or more (smaller ones measure the
    # per-request overhead, which both modes share)
    rounds = sorted({r["size"] for r in rows if r["case"] == "syncround" and r["size"] >= 10**5})
    for n in rounds or [None]:
        out.append(
            _goal(
                "sync round, 4 workers" + ("" if n is None else f", {n:,}"),
                "async step",
                "time per step",
                None if n is None else _find(rows, "syncround", "step", n, SYNC),
                None if n is None else _find(rows, "syncround", "step", n, ASYNC),
                "median_s",
                False,
                1.5,
                "not measured: run the syncround case with a size >= 1e5",
            )
        )
    out += _rows_goals(rows)
    out += _scale_goals(rows)
    out += _copy_goals(rows)
    out += _floor_goals(rows)
    out += _replication_goals(rows)
    out += _failover_goals(rows)
    return out


def _replication_goals(rows: Sequence[dict]) -> list[dict]:
    """A push of 4 MB or more through a primary that waits for its backup, next to one shard
    alone (smaller pushes measure the round trips, not the bytes)."""
    sizes = sorted(
        {r["size"] for r in rows if r["case"] == "replication" and r["size"] >= 10**6}
    ) or [None]
    return [
        _goal(
            "push" + ("" if n is None else f" {n * 4 / 1e6:g} MB") + ", primary + 1 backup",
            replication.ALONE,
            "MB/s",
            None if n is None else _find(rows, "replication", "push", n, replication.REPLICATED),
            None if n is None else _find(rows, "replication", "push", n, replication.ALONE),
            "mb_per_s",
            True,
            0.6,
            "not measured: run the replication case with a size >= 1e6",
        )
        for n in sizes
    ]


def _copy_goals(rows: Sequence[dict]) -> list[dict]:
    out = []
    for system in (frameworks.NUMPY, frameworks.TORCH, frameworks.JAX):
        r = next((r for r in rows if r["case"] == "frameworks" and r["system"] == system), None)
        goal = {
            "goal": f"{system} step: copies",
            "versus": "parameters",
            "measure": "bytes copied",
            "target": "<= 0.01x",
        }
        if r is None:
            note = "not measured: run the frameworks case" + (
                "" if system == frameworks.NUMPY else f" with {system.split()[0]} installed"
            )
            out.append({**goal, "ratio": None, "met": None, "note": note})
            continue
        ratio = r["copied_bytes"] / r["param_bytes"]
        met = ratio <= 0.01
        note = "" if met else f"missed: {r['copied_bytes']:,} bytes copied per step"
        out.append({**goal, "ratio": ratio, "met": met, "note": note})
    return out


def _floor_goals(rows: Sequence[dict]) -> list[dict]:
    """Small requests next to the raw socket: the floor case's 4 KB pull, the step case's
    100 x 4 KB pull and push+apply."""
    n = floor.DEFAULT_SIZES[0]
    return [
        _goal(
            "4 KB pull latency",
            RAW,
            "p50",
            _find(rows, "floor", "pull", n, SDK),
            _find(rows, "floor", "pull", n, RAW),
            "p50_ms",
            False,
            4.0,
            "not measured: run the floor case at its default size",
        ),
        *(
            _goal(
                f"100 x 4 KB {label} in one step",
                RAW,
                "steps/s",
                _find(rows, "step", op, 1000, step.GROUP),
                _find(rows, "step", op, 1000, RAW),
                "ops_per_s",
                True,
                target,
                "not measured: run the step case at its default size",
            )
            for op, label, target in (("pull", "pull", 0.9), ("push", "push+apply", 0.75))
        ),
    ]


def _rows_goals(rows: Sequence[dict]) -> list[dict]:
    n = row_case.DEFAULT_SIZES[0]
    out = []
    for op in ("pull", "push"):
        for system in (ONE_SHARD, TWO_SHARDS):
            mine = _find(rows, "rows", op, n, system)
            out.append(
                _goal(
                    f"{op}_rows {n:,}x{row_case.DIM}, {system.removeprefix('paramshard ')}",
                    TF,
                    "rows/s",
                    mine,
                    _find(rows, "rows", op, n, TF),
                    "ops_per_s",
                    True,
                    2.0,
                    "needs --peers" if mine else f"not measured: run the rows case at {n:.0e}",
                )
            )
    return out


def workers_ceiling(two: dict | None, one: dict | None, cores: int | None = None) -> dict | None:
    """The best 2-shard / 1-shard ratio of the workers case that this machine's cores allow at
    the CPU per MB the run measured (bench/README.md, "What holds the workers goal back"):
    one shard keeps at most one core busy, so it serves at most 1000 / s MB/s (``s``: its CPU
    ms per MB); two shards at most 2000 / s2, and with the workers at most cores x 1000 /
    (s2 + w2) (``s2``, ``w2``: the shards' and the workers' CPU ms per MB against 2 shards).
    ``None`` without the CPU figures."""
    cores = cores or os.cpu_count()
    try:
        s = 1e3 * one["servers_cores_busy"] / one["mb_per_s"]  # type: ignore[index]
        s2 = 1e3 * two["servers_cores_busy"] / two["mb_per_s"]  # type: ignore[index]
        w2 = 1e3 * two["workers_cores_busy"] / two["mb_per_s"]  # type: ignore[index]
    except (TypeError, KeyError, ZeroDivisionError):
        return None
    if not cores or s <= 0 or s2 <= 0:
        return None
    best = min(cores / (s2 + w2), 2 / s2) * s
    return {"cores": cores, "ratio": best, "s": s, "s2": s2, "w2": w2}


#: A call over 16 shards, at most this many times the same call to 1 shard (bench/README.md,
#: GOALS, says why on 2 cores), and at most this share of the 16 shards called in turn.
FANOUT_VS_ONE = 4.0
FANOUT_VS_IN_TURN = 0.5
#: ... and its mean time at most this many times the least its CPU allows on the machine's cores
#: (:func:`bench.fanout.cpu_floor`): the SDK and the shards wait for nothing but the cores.
FANOUT_VS_CPU_FLOOR = 1.3


def _scale_goals(rows: Sequence[dict]) -> list[dict]:
    """The goals of the shardsize, concurrency and fanout cases (at their default sizes)."""
    out = []
    n = shardsize.DEFAULT_SIZES[0]
    base = shardsize.HELD[0]
    for op in ("push", "pull"):
        theirs = _find(rows, "shardsize", op, n, shardsize.label(base))
        for held in shardsize.HELD[1:]:
            out.append(
                _goal(
                    f"{op} 100x4KB, {held:,} held",
                    f"{base:,} held",
                    "median time",
                    _find(rows, "shardsize", op, n, shardsize.label(held)),
                    theirs,
                    "median_s",
                    False,
                    1.2,
                    "not measured: run the shardsize case at its defaults, without --quick",
                )
            )
    n = concurrency.DEFAULT_SIZES[0]
    most = concurrency.WORKERS[-1]
    phases = [r for r in rows if r["case"] == "concurrency" and r.get("size") == n]
    crowd = _find(rows, "concurrency", "step", n, concurrency.label(most))
    missing = "not measured: run the concurrency case at its defaults, without --quick"
    best = max(phases, key=lambda r: r["ops_per_s"], default=None)
    out.append(
        _goal(
            f"{most} workers on one shard",
            "best of 1-64",
            "steps/s",
            crowd,
            best,
            "ops_per_s",
            True,
            0.8,
            missing,
        )
    )
    out.append(
        _goal(
            f"{most} workers on one shard",
            "their p50",
            "p99",
            crowd and {"ms": crowd["p99_ms"]},
            crowd and {"ms": crowd["p50_ms"]},
            "ms",
            False,
            10.0,
            missing,
        )
    )
    errors = None if crowd is None else crowd["errors"]
    out.append(
        {
            "goal": f"{most} workers on one shard",
            "versus": "none",
            "measure": "failed steps",
            "target": "= 0",
            "ratio": errors,
            "met": None if errors is None else errors == 0,
            "note": missing if errors is None else ("" if not errors else f"{errors} failed"),
        }
    )
    n = fanout.DEFAULT_SIZES[0]
    most = fanout.SHARDS[-1]
    versus = (
        (fanout.label(1), fanout.label(1), FANOUT_VS_ONE),
        (f"{most} in turn", fanout.label(most, in_turn=True), FANOUT_VS_IN_TURN),
    )
    for op in ("push", "pull"):
        mine = _find(rows, "fanout", op, n, fanout.label(most))
        for shown, system, target in versus:
            out.append(
                _goal(
                    f"{op} in one call over {most} shards",
                    shown,
                    "median time",
                    mine,
                    _find(rows, "fanout", op, n, system),
                    "median_s",
                    False,
                    target,
                    "not measured: run the fanout case at its defaults, without --quick",
                )
            )
        floor = None
        if mine is not None and mine.get("cpu_floor_us"):
            floor = {"mean_s": mine["cpu_floor_us"] / 1e6}
        out.append(
            _goal(
                f"{op} in one call over {most} shards",
                f"cpu / {mine.get('cores', '?') if mine else '?'} cores",
                "mean time",
                mine,
                floor,
                "mean_s",
                False,
                FANOUT_VS_CPU_FLOOR,
                "not measured: run the fanout case at its defaults on Linux (/proc)",
            )
        )
    return out


#: The broadcast goal's bound on the p50, in ms (a pseudo-row to compare with).
BROADCAST_P50_MS = 3.0


def _broadcast_goals(rows: Sequence[dict]) -> list[dict]:
    n = broadcast.DEFAULT_SIZES[0]
    mine = _find(rows, "broadcast", "broadcast", n, broadcast.SDK)
    not_run = "not measured: run the broadcast case at its default size"
    return [
        _goal(
            "broadcast 1 MB to 8 actors",
            f"{BROADCAST_P50_MS:g} ms",
            "p50",
            mine,
            {"p50_ms": BROADCAST_P50_MS},
            "p50_ms",
            False,
            1.0,
            not_run,
        ),
        _goal(
            "broadcast 1 MB to 8 actors",
            broadcast.RAY,
            "p50",
            mine,
            _find(rows, "broadcast", "broadcast", n, broadcast.RAY),
            "p50_ms",
            False,
            0.5,
            "needs --peers with ray" if mine else not_run,
        ),
    ]


def _failover_goals(rows: Sequence[dict]) -> list[dict]:
    """Failover of a primary elected in etcd: from the kill to the first write acknowledged
    by the new primary, p50 <= 1.5 x the lease TTL (3 s with the default 2 s)."""
    return [
        _goal(
            "failover: kill -9 -> first acked write",
            failover.LEASE,
            "p50",
            _find(rows, "failover", "failover", None, failover.FAILOVER),
            _find(rows, "failover", "failover", None, failover.LEASE),
            "p50_ms",
            False,
            1.5,
            "not measured: run the failover case (it needs etcd: apt-get install etcd-server)",
        )
    ]


def _half_goals(rows: Sequence[dict]) -> list[dict]:
    """The float16 pull of 100 MB against the float32 one, into new arrays and into ``out=``
    buffers: over the link (:mod:`bench.link`), then on loopback (:mod:`bench.transfer`)."""
    half = 25_000_000  # 100 MB of float32
    out = []
    for case, where, missing in (
        (
            "link",
            RATE_LABEL,
            "not measured: run the link case (as root, with iproute2) at the size 25000000",
        ),
        ("transfer", "loopback", "not measured: run the transfer case with the size 25000000"),
    ):
        for what, mine, theirs in (
            ("float16 pull of 100 MB", SDK_F16, SDK),
            ("float16 pull into out=", SDK_F16_OUT, SDK_OUT),
        ):
            out.append(
                _goal(
                    f"{what}, {where}",
                    theirs,
                    "MB/s",
                    _find(rows, case, "pull", half, mine),
                    _find(rows, case, "pull", half, theirs),
                    "mb_per_s",
                    True,
                    1.6,
                    missing,
                )
            )
            if case == "transfer" and out[-1]["ratio"] is not None:
                out[-1] = {**out[-1], "met": None, "shown": True, "note": LOOPBACK_SHOWN}
    return out


#: Why the loopback float16 rows are shown beside the link's and not judged.
LOOPBACK_SHOWN = (
    "shown, not judged: loopback moves 100 MB at memory speed, so halving the bytes saves "
    "about what the casts cost; judged over the link"
)


def render(goals: Sequence[dict]) -> str:
    met = sum(1 for g in goals if g["met"])
    measured = sum(1 for g in goals if g["met"] is not None)
    shown = sum(1 for g in goals if g.get("shown"))
    lines = [
        "",
        f"GOALS: {met} of {measured} measured goals met ({len(goals) - measured - shown} not "
        "measured in this run" + (f", {shown} shown and not judged)" if shown else ")"),
        f"{'':<8}{'goal':<34}{'vs':<14}{'measure':<16}{'ratio':>7}  {'target':<8}",
    ]
    for g in goals:
        if g.get("shown"):
            status = "shown"
        else:
            status = "-" if g["met"] is None else ("met" if g["met"] else "MISSED")
        ratio = "-" if g["ratio"] is None else f"{g['ratio']:.2f}x"
        lines.append(
            f"{status:<8}{g['goal']:<34}{g['versus']:<14}{g['measure']:<16}"
            f"{ratio:>7}  {g['target']:<8}  {g['note']}".rstrip()
        )
    return "\n".join(lines)
