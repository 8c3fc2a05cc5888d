"""``paramshard demo``: a local fleet trains a classifier, checked against one process.

    paramshard demo                      # 2 shards, 4 workers, then keeps the fleet up (on a TTY)
    paramshard demo --shards 3 --workers 2 --steps 300 --no-wait

What it does, in order:

1. starts ``--shards`` shard processes (:class:`server.launcher.Fleet`) on ports they pick (or on
   ``--base-port``, ``--base-port + 1``, ...) and waits until each answers ``/healthz``;
2. starts ``--workers`` processes running :mod:`server.demo.digits_worker` (Downpour SGD on
   scikit-learn's digits, :mod:`server.demo.workers`) and shows their progress lines as they
   come;
3. pulls the trained weights from the fleet, measures their held-out accuracy, trains the same
   model with the same optimizer for the same number of gradient steps in this one process
   (no parameter server, :mod:`server.demo.reference`), and prints the two side by side;
4. prints URLs to look inside the shards; on a terminal it keeps the fleet up until Enter or
   Ctrl-C, otherwise (or with ``--no-wait``) it stops it.

Every process it started is stopped before it returns, also on Ctrl-C, SIGTERM or a failure
(then with a non-zero status and a message saying what failed). Everything it runs is part of
the installed package, so it runs from a wheel as from a source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from client_sdk import wire

from ..launcher import Fleet, LaunchError
from . import digits_worker
from .reference import train_one_process
from .workers import Printer, WorkerFailed, Workers

__all__ = ["build_parser", "run_demo"]

PROG = "paramshard demo"


class DemoError(Exception):
    """Something the demo cannot go on from; the message says what and what to do."""


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- the demo ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Start a local fleet, train a small network on scikit-learn's digits with "
        "asynchronous workers (Downpour SGD), and compare its held-out accuracy with "
        "the same training in one process.",
    )
    p.add_argument("--shards", type=int, metavar="N", default=2, help="shard processes (default 2)")
    p.add_argument(
        "--workers", type=int, metavar="M", default=4, help="worker processes (default 4)"
    )
    p.add_argument(
        "--steps",
        type=int,
        metavar="S",
        default=500,
        help="gradient steps per worker (default 500)",
    )
    p.add_argument(
        "--batch-size", type=int, metavar="B", default=32, help="examples per step (default 32)"
    )
    p.add_argument(
        "--n-fetch",
        type=int,
        metavar="N",
        default=1,
        help="workers pull fresh weights every n steps (default 1)",
    )
    p.add_argument(
        "--lr", type=float, metavar="LR", default=0.05, help="Adagrad learning rate (default 0.05)"
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="SEED",
        default=0,
        help="seeds the data split, initial weights and batches (default 0)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address the shards bind (default 127.0.0.1)"
    )
    p.add_argument(
        "--base-port",
        type=int,
        metavar="P",
        default=0,
        help="shard i listens on base-port + i; 0 (the default) picks free ports",
    )
    p.add_argument(
        "--log-every",
        type=int,
        metavar="N",
        default=0,
        help="workers print progress every n steps (default: 5 lines per worker)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        default=600.0,
        help="give up if the workers have not finished after this many seconds",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="stop the fleet at the end even on a terminal (default: on a terminal, "
        "keep it up for inspection until Enter or Ctrl-C)",
    )
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, lo in (
        ("shards", 1),
        ("workers", 1),
        ("steps", 1),
        ("batch_size", 1),
        ("n_fetch", 1),
        ("log_every", 0),
    ):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(args, name)}")
    if args.shards > 64 or args.workers > 64:
        p.error("--shards and --workers are at most 64 in the demo")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.base_port and not 1 <= args.base_port <= 65535 - args.shards + 1:
        p.error(
            f"--base-port must be 0 (free ports) or 1..{65535 - args.shards + 1}, "
            f"got {args.base_port}"
        )
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(wire.ENV_PREFIX)}


def _on_signal(signum: int, frame: Any) -> None:
    raise _Interrupted(signum)


def run_demo(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run the demo (see the module docstring); returns the exit status.

    Blocks until the demo is over. Installs SIGINT/SIGTERM handlers while it runs (when called
    from the main thread) and restores the previous ones.
    """
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    _check_args(parser, args)
    say = Printer(out or sys.stdout, err or sys.stderr)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    logdir = Path(tempfile.mkdtemp(prefix="paramshard-demo-"))
    n = args.shards
    fleet = Fleet(
        n,
        host=args.host,
        ports=[args.base_port + i if args.base_port else 0 for i in range(n)],
        env=_child_env(),
        logdir=logdir,
    )
    workers = Workers(fleet.env, say)
    keep_logs = False
    try:
        return _run(args, fleet, workers, say)
    except (DemoError, LaunchError, WorkerFailed) as exc:
        keep_logs = True
        say(f"{PROG}: error: {exc}", error=True)
        return 1
    except (_Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        say(
            f"\n{PROG}: interrupted ({signal.Signals(signum).name}); stopping the fleet", error=True
        )
        return 128 + signum
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        try:
            stopped = workers.stop()
            stopped += sum(p is not None and p.poll() is None for p in fleet.procs)
            fleet.close(grace=10.0)
            if stopped:
                say(f"{PROG}: stopped {stopped} process(es)")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if keep_logs:
                say(f"{PROG}: shard logs kept in {logdir}", error=True)
            else:
                shutil.rmtree(logdir, ignore_errors=True)


def _run(args: argparse.Namespace, fleet: Fleet, workers: Workers, say: Printer) -> int:
    if importlib.util.find_spec("sklearn") is None:
        raise DemoError(
            "scikit-learn is not installed; the demo trains on its digits data set: "
            "pip install 'paramshard[demo]'"
        )
    worker = digits_worker
    data = worker.load_data(args.seed)
    total = args.workers * args.steps
    say(
        f"{PROG}: {args.shards} shard(s), {args.workers} worker(s) x {args.steps} steps "
        f"(batch {args.batch_size}, Adagrad lr {args.lr:g}, pull every {args.n_fetch} step(s)) "
        f"on scikit-learn's digits: {len(data.y_train)} training, {len(data.y_test)} held-out "
        "images"
    )

    t0 = time.perf_counter()
    for i in range(fleet.n):
        fleet.start(i, wait=False)
    for i in range(fleet.n):
        try:
            fleet.wait(i)
        except LaunchError as exc:
            raise DemoError(f"{exc}{_port_hint(fleet, i)}") from None
    for i, (url, pid) in enumerate(zip(fleet.urls, fleet.pids)):
        say(f"  shard {i}/{args.shards}  {url}  (pid {pid})")

    log_every = args.log_every or max(1, args.steps // 5)
    for i in range(args.workers):
        worker_args = [
            "--shards",
            ",".join(fleet.urls),
            "--worker-index",
            str(i),
            "--num-workers",
            str(args.workers),
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--n-fetch",
            str(args.n_fetch),
            "--lr",
            repr(args.lr),
            "--seed",
            str(args.seed),
            "--log-every",
            str(log_every),
        ]
        workers.start(worker_args, f"[w{i}]")
    say("  workers " + ", ".join(f"w{i} (pid {p.pid})" for i, p in enumerate(workers.procs)))
    workers.wait(args.timeout, check=lambda: _check_shards(fleet))
    t_fleet = time.perf_counter() - t0

    from client_sdk import PSClient, PSError  # the worker SDK, as a worker would use it

    try:
        with PSClient(fleet.urls, worker_id="demo") as ps:
            params = {k: np.array(v) for k, v in ps.pull(list(worker.PARAM_NAMES)).items()}
            global_step = int(ps.increment(worker.STEP_COUNTER, 0))
    except PSError as exc:
        raise DemoError(f"could not pull the trained weights from the fleet: {exc}") from exc
    acc_ps = worker.accuracy(params, data.X_test, data.y_test)

    t1 = time.perf_counter()
    ref = train_one_process(
        data, steps=total, batch_size=args.batch_size, lr=args.lr, seed=args.seed
    )
    t_ref = time.perf_counter() - t1
    acc_ref = worker.accuracy(ref, data.X_test, data.y_test)

    diff = 100 * (acc_ps - acc_ref)
    plural = "s" if args.workers > 1 else ""
    say("")
    say(
        f"held-out accuracy ({len(data.y_test)} images) after {total} gradient steps of "
        f"batch {args.batch_size}:"
    )
    say(
        f"  {f'parameter server, {args.workers} async worker{plural}':<36}{100 * acc_ps:6.2f} %   "
        f"{t_fleet:.1f} s with start-up, global_step {global_step}"
    )
    say(f"  {'one process, no parameter server':<36}{100 * acc_ref:6.2f} %   {t_ref:.1f} s")
    say(f"  {'difference':<36}{diff:+6.2f} points")
    if abs(diff) > 2:
        say(
            "  (more than 2 points apart: stale gradients from many workers or a high --lr "
            "can do that; try --n-fetch 1 or a lower --lr)"
        )

    name = worker.PARAM_NAMES[0]
    urls = fleet.urls
    links = [
        (f"{urls[0]}/v1/variables", "the variables of shard 0"),
        (f"{urls[_owner(name, len(urls))]}/v1/variables/{name}", "one variable (add ?values=true)"),
        (f"{urls[0]}/v1/cluster", "the shard itself"),
        (f"{urls[0]}/docs", "every endpoint"),
    ]
    width = max(len(url) for url, _ in links) + 3
    say("")
    say("look inside:")
    for url, what in links:
        say(f"  {url:<{width}}{what}")
    say(f"  paramshard status --shards {','.join(urls)}")

    if not args.no_wait and sys.stdin.isatty() and say.out.isatty():
        say("")
        say("The fleet is still up. Press Enter (or Ctrl-C) to stop it.")
        try:
            _wait_for_enter(fleet)
        except (_Interrupted, KeyboardInterrupt):
            say("")  # asked for: not an interruption
    say(f"{PROG}: stopping the fleet")
    return 0


def _owner(name: str, num_shards: int) -> int:
    from client_sdk.placement import shard_for

    return shard_for(name, num_shards)


def _port_hint(fleet: Fleet, i: int) -> str:
    if "address already in use" in fleet.tail(i).lower():
        return "\nis the port in use? pick another --base-port, or 0 for ports the shards pick"
    return ""


def _check_shards(fleet: Fleet) -> None:
    """Raise :class:`DemoError` if a shard exited."""
    for i in range(fleet.n):
        code = fleet.poll(i)
        if code is not None:
            raise DemoError(fleet.describe_exit(i, code) + _port_hint(fleet, i))


def _wait_for_enter(fleet: Fleet) -> None:
    done = threading.Event()

    def read() -> None:
        try:
            sys.stdin.readline()
        finally:
            done.set()

    threading.Thread(target=read, daemon=True, name="demo-enter").start()
    while not done.wait(0.2):
        _check_shards(fleet)


if __name__ == "__main__":
    sys.exit(run_demo())
