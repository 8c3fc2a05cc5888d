"""``python -m bench`` (``make bench``): run the benchmark cases, print a table, save JSON.

    python -m bench                          # every case, default sizes
    python -m bench --quick                  # fewer repetitions: a smoke run
    python -m bench --peers                  # with TF, PyTorch RPC, Ray, Redis (make bench-peers)
    python -m bench --peers tf,redis --cases transfer,step
    python -m bench --sizes 1e5,2.5e7 --reps 20
    python -m bench --cases transfer --list

Prints one table per case, the servers' CPU-seconds per GB, the GOALS and the SCALE
estimate. Results go to ``bench/results/<UTC timestamp>.json`` (``--out`` to change the
directory).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from . import CASES, frameworks, goals, scale
from .context import Context
from .peers import missing, parse_peers
from .report import add_ratios, cpu_table, machine, table, write_json
from .workers import busy_table

RESULTS = Path(__file__).resolve().parent / "results"


def _sizes(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--sizes takes element counts like 1e5,1000000,2.5e7; got {part!r}"
            ) from None
        if value < 1 or value != int(value) or value > 2**40:
            raise argparse.ArgumentTypeError(f"--sizes: {part!r} is not a whole count >= 1")
        out.append(int(value))
    return tuple(out)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _cases(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    return names


def _peers(text: str) -> tuple[str, ...]:
    try:
        return parse_peers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--peers: {exc}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.05 <= value <= 600:
        raise argparse.ArgumentTypeError(f"expected seconds between 0.05 and 600, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases",
        type=_cases,
        default=list(CASES),
        help=f"comma-separated cases to run (default all: {', '.join(CASES)})",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="variable sizes in float32 elements, e.g. 1e5,1e6,2.5e7 (default: each case's own)",
    )
    p.add_argument(
        "--reps",
        type=_positive,
        default=None,
        help="timed repetitions per size up to 8 MiB (ten times as many up to 512 "
        "KiB); bigger sizes get proportionally fewer, at least --min-reps "
        "(default 30, --quick 5)",
    )
    p.add_argument(
        "--min-reps",
        dest="min_reps",
        type=_positive,
        default=None,
        help="fewest timed repetitions of any size (default 10, --quick 2)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument(
        "--seconds",
        type=_seconds,
        default=None,
        help="how long each phase of the workers case runs (default 1.5, --quick 0.3)",
    )
    p.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="how often the workers case repeats its phases (default 2, --quick 1)",
    )
    p.add_argument(
        "--peers",
        type=_peers,
        nargs="?",
        const="all",
        default=(),
        help="also measure the peers: 'all' (the default when given without a value) "
        "or a comma-separated subset of tf,torch,ray,redis. They install with "
        "`make bench-peers` (its own virtualenv, .venv-peers)",
    )
    p.add_argument("--quick", action="store_true", help="few repetitions: check that it runs")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"JSON directory (default {RESULTS})")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modules = {name: importlib.import_module(CASES[name]) for name in args.cases}
    descriptions = {name: m.DESCRIPTION for name, m in modules.items()}
    if args.list:
        for name, desc in descriptions.items():
            print(f"{name:<12}{desc}")
        return 0
    if args.warmup < 0:
        print("--warmup must be >= 0", file=sys.stderr)
        return 2
    if args.peers and (lacking := missing(args.peers)):
        print(
            "--peers: this environment lacks what they need:\n  "
            + "\n  ".join(lacking)
            + "\nRun `make bench-peers` (installs the `peers` extra into .venv-peers and "
            "redis-server from Debian), or use that virtualenv: .venv-peers/bin/python -m "
            "bench --peers",
            file=sys.stderr,
        )
        return 2
    reps = args.reps or (5 if args.quick else 30)
    min_reps = min(reps, args.min_reps or (2 if args.quick else 10))
    ctx = Context(
        sizes=args.sizes,
        reps=reps,
        min_reps=min_reps,
        warmup=args.warmup,
        peer_names=args.peers,
        seconds=args.seconds or (0.3 if args.quick else 1.5),
        rounds=args.rounds or (1 if args.quick else 2),
        quick=args.quick,
    )
    rows: list[dict] = []
    started = time.time()
    failed = True
    try:
        for name, module in modules.items():
            t0 = time.perf_counter()
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows += module.run(ctx)
            print(f"  {name} took {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        failed = False
    finally:
        ctx.close(keep_logs=failed)
        if failed:
            print(f"process logs kept in {ctx.logdir}", file=sys.stderr)
    add_ratios(rows)
    goal_list = goals.evaluate(rows)
    estimate = scale.estimate(rows)
    meta = {
        "started": started,
        "argv": sys.argv[1:] if argv is None else argv,
        "settings": {
            "sizes": args.sizes,
            "reps": reps,
            "min_reps": min_reps,
            "warmup": args.warmup,
            "cases": args.cases,
            "peers": args.peers,
            "seconds": ctx.seconds,
            "rounds": ctx.rounds,
            "quick": args.quick,
        },
        "machine": machine(),
        "goals": goal_list,
        "scale": estimate,
    }
    path = write_json(rows, meta, args.out)  # first: the measurements outlive a printing bug
    print(table(rows, descriptions))
    print(frameworks.render(rows))
    print(cpu_table(rows))
    print(busy_table(rows))
    for module in modules.values():
        if hasattr(module, "notes"):
            print(module.notes(rows))
    print(goals.render(goal_list))
    print(scale.render(estimate))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
