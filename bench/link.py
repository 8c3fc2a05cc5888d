"""Pull and push of one float32 variable over a 10 Gbit/s link: the transfer case's
repetitions (:func:`bench.transfer.one_size`) between a shard and a client in two network
namespaces joined by a cable shaped to :data:`RATE` (:mod:`bench.netns`), next to a raw TCP
socket over the same cable.

On loopback a 100 MB value moves in about the time memory takes to copy it (20-25 ms), so
half precision saves little there: the bytes it leaves out cost about what narrowing and
widening them does. On a network the bytes are what costs. This case is where the float16
goal (:mod:`bench.goals`) is judged; the loopback rows stay beside it.

The shard (``paramshard serve``) and the raw socket's server run in the server's namespace,
and a driver (``python -m bench.link --client ...``, this module) in the client's: it pulls and
pushes in float32, float16 and bfloat16, into new arrays and into ``out=`` buffers, times each
call, reads the shard's CPU from ``/proc`` (one pid namespace: the same pids) and prints the
rows as one JSON line.

Needs root and iproute2 (``ip``, ``tc``); elsewhere the case measures nothing and says why
(:func:`notes`), and the goals judged on it say "not measured".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from server import launcher

from . import netns, processes
from .context import Context
from .transfer import (
    RAW,
    SDK,
    SDK_BF16,
    SDK_BF16_OUT,
    SDK_F16,
    SDK_F16_OUT,
    SDK_OUT,
    one_size,
)

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "RATE", "RATE_LABEL", "SYSTEMS", "notes", "run"]

#: The cable's rate, in tc's syntax and as the report says it.
RATE, RATE_LABEL = "10gbit", "10 Gbit/s"
DESCRIPTION = (
    f"one float32 variable, 1 shard over a {RATE_LABEL} link (two network namespaces); "
    "pull and push in float32, float16, bfloat16 vs a raw TCP socket"
)
DEFAULT_SIZES = (25_000_000,)
#: The SDK's systems, in the order the report lists them (each on a variable of its own but
#: the plain one and out= float32, as in the transfer case).
SYSTEMS = (SDK, SDK_OUT, SDK_F16, SDK_F16_OUT, SDK_BF16, SDK_BF16_OUT)
_WIRE = {SDK_F16: "float16", SDK_F16_OUT: "float16", SDK_BF16: "bfloat16", SDK_BF16_OUT: "bfloat16"}
#: Seconds the driver may take per 100 MB moved once (generous: a loaded machine).
_SECONDS_PER_100MB = 3.0
#: Why the last run measured nothing (for :func:`notes`), or ``None``.
_skipped: str | None = None


class _Fleet(launcher.Fleet):
    """One shard started in the server's namespace. It is ready once it reported its port:
    nothing in this namespace can reach it (the driver asks it for ``/healthz`` itself)."""

    def __init__(self, pair: netns.LinkPair, logdir: Path) -> None:
        super().__init__(
            1,
            host=pair.address("server"),
            extra_args=("--log-level", "warning"),
            logdir=logdir,
        )
        self._pair = pair

    def command(self, i: int) -> list[str]:
        return self._pair.command("server", super().command(i))

    def answers(self, i: int, ready: bool = False, timeout: float = 1.0) -> bool:
        return self.learn_port(i)


def run(ctx: Context) -> list[dict]:
    global _skipped
    _skipped = netns.unavailable()
    if _skipped is not None:
        return []
    sizes = ctx.sizes_for(DEFAULT_SIZES)
    logdir = ctx.logdir / "link"
    logdir.mkdir(exist_ok=True)
    procs = []
    with netns.LinkPair(RATE) as pair:
        fleet = _Fleet(pair, logdir)
        try:
            fleet.start_all()
            raw_log = logdir / "rawsock.log"
            host = pair.address("server")
            raw = processes.spawn(
                pair.command("server", [sys.executable, "-m", "bench.rawsock", "--host", host]),
                raw_log,
                pipes=True,
            )
            procs.append(raw)
            words = processes.LineReader(raw, raw_log, "raw socket server").readline(60).split()
            if len(words) != 2 or words[0] != "port":
                raise RuntimeError(f"raw socket server did not start:\n{processes.tail(raw_log)}")
            spec = {
                "url": fleet.urls[0],
                "raw": [host, int(words[1])],
                "pids": {"shard": fleet.pids, "raw": [raw.pid]},
                "sizes": list(sizes),
                "reps": ctx.reps,
                "min_reps": ctx.min_reps,
                "warmup": ctx.warmup,
            }
            driver_log = logdir / "driver.log"
            driver = processes.spawn(
                pair.command("client", [sys.executable, "-m", "bench.link", "--client"]),
                driver_log,
                pipes=True,
            )
            procs.append(driver)
            assert driver.stdin is not None
            driver.stdin.write(json.dumps(spec).encode() + b"\n")
            driver.stdin.flush()
            moved = sum(sizes) * 4 * (ctx.warmup + ctx.reps) * 2 * (len(SYSTEMS) + 1)
            timeout = 120 + _SECONDS_PER_100MB * moved / 1e8
            line = processes.LineReader(driver, driver_log, "link driver").readline(timeout)
        finally:
            for proc in procs:
                processes.stop(proc, grace=5.0)
            fleet.close()
    rows: list[dict] = json.loads(line)
    order = {system: k for k, system in enumerate((RAW, *SYSTEMS))}
    rows.sort(key=lambda r: (r["op"] != "pull", r["size"], order.get(r["system"], 99)))
    return rows


def notes(rows: list[dict]) -> str:
    """Why the case measured nothing, if it did not; else the client's CPU per call."""
    if _skipped is not None:
        return f"\nlink: not measured: {_skipped}"
    mine = [r for r in rows if r["case"] == "link" and r.get("client_cpu_ms") is not None]
    if not mine:
        return ""
    out = [
        "",
        f"link ({RATE_LABEL}): CPU ms per call, the client (every thread) and the shard",
        f"{'op':<6}{'elements':>14}  {'system':<22}{'client':>8}{'shard':>8}",
    ]
    for r in mine:
        shard = r.get("server_cpu_s")
        per_call = "-" if shard is None else format(shard / r["reps"] * 1e3, ".1f")
        out.append(
            f"{r['op']:<6}{r['size']:>14,}  {r['system']:<22}"
            f"{r['client_cpu_ms']:>8.1f}{per_call:>8}"
        )
    return "\n".join(out)


# -- the driver, in the client's namespace -----------------------------------------------------


def _drive(spec: dict) -> list[dict]:
    """Wait for the shard, then run :func:`bench.transfer.one_size` per size over the link."""
    from client_sdk import PSClient

    from .rawsock import RawClient

    url = spec["url"]
    if not _wait(url + "/healthz", 60.0):
        raise RuntimeError(f"the shard at {url} did not answer /healthz over the link in 60 s")
    shard, raw_pids = spec["pids"]["shard"], spec["pids"]["raw"]
    pids = {RAW: raw_pids, **{s: shard for s in SYSTEMS}}
    with tempfile.TemporaryDirectory(prefix="paramshard-link-") as tmp:
        ctx = Context(
            sizes=tuple(spec["sizes"]),
            reps=spec["reps"],
            min_reps=spec["min_reps"],
            warmup=spec["warmup"],
            logdir=Path(tmp),
        )
        plain = PSClient([url], worker_id="bench-link")
        halves = {
            wire: PSClient([url], worker_id=f"bench-link-{wire}", wire_dtype=wire)
            for wire in ("float16", "bfloat16")
        }
        try:
            with RawClient(*spec["raw"]) as raw:
                clients = {s: halves[_WIRE[s]] if s in _WIRE else plain for s in SYSTEMS}
                rows = []
                for n in ctx.sizes_for(DEFAULT_SIZES):
                    rows += one_size(ctx, n, clients, raw, [], pids, case="link")
        finally:
            plain.close()
            for client in halves.values():
                client.close()
    return rows


def _wait(url: str, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.answers(url):
            return True
        time.sleep(0.1)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.link", description=__doc__.splitlines()[0])
    p.add_argument(
        "--client",
        action="store_true",
        required=True,
        help="run as the driver: read the run's spec (JSON) from stdin, print the rows",
    )
    p.parse_args(argv)
    spec = json.loads(sys.stdin.readline())
    print(json.dumps(_drive(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
