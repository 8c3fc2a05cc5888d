"""Scale on paper: from the shard's measured CPU-seconds per GB, how many shards a big model
needs. Printed at the end of a run as SCALE; bench/README.md shows its latest result.

The scenario: a model of 10^9 float32 parameters (4 GB), 64 workers, each pushing
its whole gradient and pulling the whole model once a second: 256 GB/s into the fleet and
256 GB/s out of it.

The assumptions, stated here once and printed with the result:

* a shard is one process with one event loop, so it keeps at most **one core** busy;
* shards run on hosts of **16 cores** with a **100 Gb/s NIC** (12.5 GB/s each way, full
  duplex), up to one shard per core;
* the CPU cost per GB is the one measured here for the biggest transfers (sizes >= 10^7
  pooled: CPU-seconds summed / GB summed; else >= 10^6; smaller ones are not used, their CPU
  is per-request work), on this machine's cores, and it stays the same
  per byte when a shard's slice is smaller (a shard's share of one push is 4 GB / shards:
  tens of MB at these fleet sizes, the size measured);
* nothing else runs on the shard hosts, and the network between workers and shards is not
  the bottleneck beyond the shard hosts' NICs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .transfer import RAW, SDK

__all__ = ["HOST_CORES", "HOST_NIC_GB_S", "MODEL_BYTES", "WORKERS", "estimate", "render"]

MODEL_BYTES = 10**9 * 4
WORKERS = 64
STEPS_PER_S = 1.0
CORES_PER_SHARD = 1.0
HOST_CORES = 16
HOST_NIC_GB_S = 100 / 8  # 100 Gb/s, each direction
#: Smallest transfer (elements) whose CPU per GB counts; 10^7 and up are preferred.
MIN_SIZE = 10**6


def _pooled(rows: Sequence[dict], system: str, op: str) -> tuple[float, list[int]] | None:
    """CPU-seconds per GB of ``system`` for ``op`` over the biggest transfer sizes measured."""
    measured = [
        r
        for r in rows
        if r["case"] == "transfer"
        and r["system"] == system
        and r["op"] == op
        and r.get("server_cpu_s") is not None
    ]
    if not measured:
        return None
    # Below 10^6 elements a transfer's CPU is per-request work, not per-byte: no basis for a
    # fleet moving GB/s.
    floor = 10**7 if any(r["size"] >= 10**7 for r in measured) else MIN_SIZE
    use = [r for r in measured if r["size"] >= floor]
    gb = sum(r["server_gb"] for r in use)
    cpu = sum(r["server_cpu_s"] for r in use)
    # /proc counts CPU time in clock ticks (10 ms here): transfers too short to register one
    # measure nothing, not a server that costs nothing.
    return (cpu / gb if gb and cpu > 0 else None), [r["size"] for r in use]


def estimate(rows: Sequence[dict]) -> dict | None:
    """The arithmetic as a dict (JSON-ready), or ``None`` without CPU measurements."""
    pull, push = _pooled(rows, SDK, "pull"), _pooled(rows, SDK, "push")
    if pull is None or push is None or pull[0] is None or push[0] is None:
        return None
    gb_each_way = WORKERS * STEPS_PER_S * MODEL_BYTES / 1e9
    cores = gb_each_way * (pull[0] + push[0])
    shards = math.ceil(cores / CORES_PER_SHARD)
    hosts_cpu = math.ceil(shards / HOST_CORES)
    hosts_nic = math.ceil(gb_each_way / HOST_NIC_GB_S)
    out = {
        "cpu_s_per_gb_pull": pull[0],
        "cpu_s_per_gb_push": push[0],
        "sizes": pull[1],
        "gb_per_s_each_way": gb_each_way,
        "cores": cores,
        "shards": shards,
        "hosts_by_cpu": hosts_cpu,
        "hosts_by_nic": hosts_nic,
        "binds": "CPU" if hosts_cpu > hosts_nic else "NIC",
        # pull+push CPU per GB at which the hosts the NIC needs have just enough cores
        "nic_binds_at_cpu_s_per_gb": hosts_nic * HOST_CORES * CORES_PER_SHARD / gb_each_way,
        "per_shard_gb_per_s_each_way": gb_each_way / shards,
    }
    raw_pull, raw_push = _pooled(rows, RAW, "pull"), _pooled(rows, RAW, "push")
    if raw_pull and raw_push and raw_pull[0] is not None and raw_push[0] is not None:
        out["raw_cpu_s_per_gb"] = raw_pull[0] + raw_push[0]
        out["raw_shards"] = math.ceil(gb_each_way * out["raw_cpu_s_per_gb"] / CORES_PER_SHARD)
    return out


def render(est: dict | None) -> str:
    if est is None:
        return (
            "\nSCALE: not estimated (no shard CPU figures: needs /proc and the transfer case "
            "with sizes of at least 10^6 elements, long enough to register in /proc's CPU "
            "clock: 10^7, the default, does)"
        )
    sizes = ", ".join(f"{n:,}" for n in est["sizes"])
    g = est["gb_per_s_each_way"]
    lines = [
        "",
        f"SCALE on paper: 10^9 float32 parameters ({MODEL_BYTES / 1e9:g} GB), {WORKERS} workers, "
        f"each pushing and pulling the whole model every {1 / STEPS_PER_S:g} s",
        f"  traffic: {WORKERS} x {MODEL_BYTES / 1e9:g} GB = {g:g} GB/s pushed in and {g:g} GB/s "
        f"pulled out",
        f"  shard CPU measured here (sizes {sizes}): {est['cpu_s_per_gb_pull']:.3f} CPU-s/GB "
        f"pulled + {est['cpu_s_per_gb_push']:.3f} CPU-s/GB pushed",
        f"  cores: {g:g} x ({est['cpu_s_per_gb_pull']:.3f} + {est['cpu_s_per_gb_push']:.3f}) = "
        f"{est['cores']:.1f} cores; at {CORES_PER_SHARD:g} core per shard: {est['shards']} shards "
        f"({est['per_shard_gb_per_s_each_way']:.2f} GB/s each way per shard)",
        f"  hosts ({HOST_CORES} cores, {HOST_NIC_GB_S * 8:g} Gb/s NIC): {est['hosts_by_cpu']} by "
        f"CPU, {est['hosts_by_nic']} by NIC ({g:g} / {HOST_NIC_GB_S:g} GB/s): "
        f"{est['binds']} binds first (the NIC binds once pull+push costs <= "
        f"{est['nic_binds_at_cpu_s_per_gb']:.2f} CPU-s/GB)",
        f"  so: {est['shards']} shards on {max(est['hosts_by_cpu'], est['hosts_by_nic'])} hosts "
        f"(~{math.ceil(est['shards'] / max(est['hosts_by_cpu'], est['hosts_by_nic']))} per host)",
    ]
    if "raw_shards" in est:
        lines.append(
            f"  floor: the raw socket server spends {est['raw_cpu_s_per_gb']:.3f} CPU-s "
            f"per GB pulled+pushed: {est['raw_shards']} single-core servers for the same "
            f"traffic"
        )
    return "\n".join(lines)
