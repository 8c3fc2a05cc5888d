"""``paramshard demo``: a local fleet trains a classifier, checked against one process.

    paramshard demo                      # 2 shards, 4 workers, then keeps the fleet up (on a TTY)
    paramshard demo --shards 3 --workers 2 --steps 300 --no-wait

What it does, in order:

1. starts ``--shards`` shard processes (``python -m server.cli serve ...``) on free ports (or on
   ``--base-port``, ``--base-port + 1``, ...) and waits until each answers ``/healthz``;
2. starts ``--workers`` processes running ``examples/digits_worker.py`` (Downpour SGD on
   scikit-learn's digits) and shows their progress lines as they come;
3. pulls the trained weights from the fleet, measures their held-out accuracy, trains the same
   model with the same optimizer for the same number of gradient steps in this one process
   (no parameter server), and prints the two side by side;
4. prints URLs to look inside the shards; on a terminal it keeps the fleet up until Enter or
   Ctrl-C, otherwise (or with ``--no-wait``) it stops it.

Every process it started is stopped before it returns, also on Ctrl-C, SIGTERM or a failure
(then with a non-zero status and a message saying what failed). The worker script is looked up
in the source checkout (``examples/`` next to ``server/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from client_sdk import wire
from client_sdk.optimizers import Adagrad

from . import optim
from .cli import client_host, healthy

__all__ = ["find_worker_script", "load_worker_module", "run_demo", "train_one_process"]

PROG = "paramshard demo"
ROOT = Path(__file__).resolve().parent.parent
WORKER_SCRIPT = Path("examples") / "digits_worker.py"
STARTUP_TIMEOUT = 60.0


class DemoError(Exception):
    """Something the demo cannot go on from; the message says what and what to do."""


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- the worker script and the one-process reference ----------------------------------------


def find_worker_script() -> Path:
    """``examples/digits_worker.py`` of the source checkout this package runs from.

    Raises :class:`DemoError` when it is missing (e.g. an install from a wheel, which carries
    no examples).
    """
    path = ROOT / WORKER_SCRIPT
    if not path.is_file():
        raise DemoError(
            f"the demo's worker script is missing: {path} does not exist. The demo runs from a "
            "source checkout of paramshard (git clone, then `pip install -e '.[demo]'` or "
            "`make demo`); an installed wheel does not include examples/."
        )
    return path


def load_worker_module(path: Path | None = None) -> types.ModuleType:
    """Import ``examples/digits_worker.py`` as a module (for its data, model and metrics)."""
    path = path or find_worker_script()
    spec = importlib.util.spec_from_file_location("digits_worker", path)
    if spec is None or spec.loader is None:
        raise DemoError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_one_process(
    worker: types.ModuleType, data: Any, *, steps: int, batch_size: int, lr: float, seed: int
) -> dict[str, np.ndarray]:
    """The reference: ``steps`` Adagrad steps on mini-batches of the whole training set, in this
    process, with the shard's own optimizer code (``server/optim.py``) and the workers' initial
    weights. Blocks (CPU only); returns the final weights.
    """
    opt = Adagrad(lr=lr)
    params = worker.init_params(seed)
    state = {name: optim.init_state(opt, value) for name, value in params.items()}
    rng = np.random.default_rng([seed, 1 << 20])
    n = len(data.y_train)
    for _ in range(steps):
        batch = rng.choice(n, size=batch_size, replace=n < batch_size)
        _, grads = worker.loss_and_grads(params, data.X_train[batch], data.y_train[batch])
        for name, grad in grads.items():
            optim.apply(opt, params[name], grad, state[name], scratch=True)
    return params


# -- processes --------------------------------------------------------------------------------


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text) or "    (empty log)"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Printer:
    """Prints lines from several threads without interleaving them (errors to ``err``)."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self.lock = threading.Lock()

    def __call__(self, text: str = "", *, error: bool = False) -> None:
        stream = self.err if error else self.out
        with self.lock:
            if error:
                self.out.flush()
            stream.write(text + "\n")
            stream.flush()


class _Fleet:
    """The demo's child processes: shards, then workers. ``stop()`` ends all of them."""

    def __init__(self, logdir: Path, env: dict[str, str], say: _Printer) -> None:
        self.logdir = logdir
        self.env = env
        self.say = say
        self.shards: list[subprocess.Popen] = []
        self.shard_logs: list[Path] = []
        self.urls: list[str] = []
        self.workers: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []

    # shards
    def start_shards(self, n: int, host: str, base_port: int) -> None:
        ports = (
            [base_port + i for i in range(n)] if base_port else [_free_port(host) for _ in range(n)]
        )
        for i, port in enumerate(ports):
            log = self.logdir / f"shard{i}.log"
            cmd = [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--shard-index",
                str(i),
                "--num-shards",
                str(n),
                "--host",
                host,
                "--port",
                str(port),
            ]
            with open(log, "wb") as f:
                self.shards.append(
                    subprocess.Popen(
                        cmd,
                        cwd=ROOT,
                        env=self.env,
                        stdin=subprocess.DEVNULL,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            self.shard_logs.append(log)
            self.urls.append(f"http://{client_host(host)}:{port}")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        pending = set(range(len(self.shards)))
        while pending:
            for i in sorted(pending):
                self.check_shard(i)
                if healthy(self.urls[i]):
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                i = min(pending)
                raise DemoError(
                    f"shard {i} ({self.urls[i]}) did not answer /healthz within "
                    f"{STARTUP_TIMEOUT:g} s; its log ends with:\n"
                    f"{_tail(self.shard_logs[i])}"
                )
            time.sleep(0.05)

    def check_shard(self, i: int) -> None:
        code = self.shards[i].poll()
        if code is not None:
            hint = (
                "; is the port in use? pick another --base-port, or 0 for free ports"
                if "address already in use" in _tail(self.shard_logs[i]).lower()
                else ""
            )
            raise DemoError(
                f"shard {i} ({self.urls[i]}) {_exit_reason(code)}{hint}; its log "
                f"ends with:\n{_tail(self.shard_logs[i])}"
            )

    # workers
    def start_worker(self, cmd: list[str], tag: str) -> None:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.workers.append(proc)
        reader = threading.Thread(
            target=self._relay, args=(proc, tag), daemon=True, name=f"demo-relay-{tag}"
        )
        reader.start()
        self.readers.append(reader)

    def _relay(self, proc: subprocess.Popen, tag: str) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.say(line if line.startswith(tag) else f"{tag} {line}")

    def wait_workers(self, timeout: float) -> None:
        """Block until every worker exited 0; raise DemoError at the first failure."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(len(self.shards)):
                self.check_shard(i)
            codes = [w.poll() for w in self.workers]
            for i, code in enumerate(codes):
                if code not in (None, 0):
                    self.readers[i].join(2.0)
                    raise DemoError(
                        f"worker w{i} {_exit_reason(code)} (its output, if any, is above)"
                    )
            if all(code == 0 for code in codes):
                for r in self.readers:
                    r.join(5.0)
                return
            if time.monotonic() > deadline:
                raise DemoError(f"the workers did not finish within {timeout:g} s (--timeout)")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM every child still running, SIGKILL what is left after ``timeout``; returns how
        many had to be stopped. Blocks until all have exited."""
        running = [p for p in self.workers + self.shards if p.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in running:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for r in self.readers:
            r.join(2.0)
        for p in self.workers:
            if p.stdout is not None:
                p.stdout.close()
        return len(running)


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
    env = {k: v for k, v in os.environ.items() if not k.startswith(wire.ENV_PREFIX)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
    say = _Printer(out or sys.stdout, err or sys.stderr)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    logdir = Path(tempfile.mkdtemp(prefix="paramshard-demo-"))
    fleet = _Fleet(logdir, _child_env(), say)
    keep_logs = False
    try:
        return _run(args, fleet, say)
    except DemoError as exc:
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
            stopped = fleet.stop()
            if stopped:
                say(f"{PROG}: stopped {stopped} process(es)")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if keep_logs:
                say(f"{PROG}: shard logs kept in {logdir}", error=True)
            else:
                shutil.rmtree(logdir, ignore_errors=True)


def _run(args: argparse.Namespace, fleet: _Fleet, say: _Printer) -> int:
    script = find_worker_script()
    if importlib.util.find_spec("sklearn") is None:
        raise DemoError(
            "scikit-learn is not installed; the demo trains on its digits data set: "
            "pip install 'paramshard[demo]'"
        )
    worker = load_worker_module(script)
    data = worker.load_data(args.seed)
    total = args.workers * args.steps
    say(
        f"{PROG}: {args.shards} shard(s), {args.workers} worker(s) x {args.steps} steps "
        f"(batch {args.batch_size}, Adagrad lr {args.lr:g}, pull every {args.n_fetch} step(s)) "
        f"on scikit-learn's digits: {len(data.y_train)} training, {len(data.y_test)} held-out "
        "images"
    )

    t0 = time.perf_counter()
    fleet.start_shards(args.shards, args.host, args.base_port)
    fleet.wait_healthy()
    for i, (url, proc) in enumerate(zip(fleet.urls, fleet.shards)):
        say(f"  shard {i}/{args.shards}  {url}  (pid {proc.pid})")

    log_every = args.log_every or max(1, args.steps // 5)
    for i in range(args.workers):
        cmd = [
            sys.executable,
            str(script),
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
        fleet.start_worker(cmd, f"[w{i}]")
    say("  workers " + ", ".join(f"w{i} (pid {p.pid})" for i, p in enumerate(fleet.workers)))
    fleet.wait_workers(args.timeout)
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
        worker, data, steps=total, batch_size=args.batch_size, lr=args.lr, seed=args.seed
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


def _wait_for_enter(fleet: _Fleet) -> None:
    done = threading.Event()

    def read() -> None:
        try:
            sys.stdin.readline()
        finally:
            done.set()

    threading.Thread(target=read, daemon=True, name="demo-enter").start()
    while not done.wait(0.2):
        for i in range(len(fleet.shards)):
            fleet.check_shard(i)


if __name__ == "__main__":
    sys.exit(run_demo())
