"""``paramshard up``: a local fleet in the foreground, kept running until it is asked to stop.

:func:`run_fleet` starts the shards (:class:`server.launcher.Fleet`), prints their URLs and the
``export PARAMSHARD_SHARDS=...`` line for workers, then watches them:

* a shard that exits while ``up`` runs (a crash, a kill, a SIGINT or SIGTERM sent to it alone)
  is started again on the same port with the same data dir, after a line saying so and a
  pause that doubles with every failure in a row (:data:`FIRST_DELAY`, at most
  :data:`MAX_DELAY`). A shard with a data dir comes back with its newest snapshot; workers
  see its requests fail and retried meanwhile (the SDK retries until its deadline);
* a shard that fails more than ``restart_limit`` times in a row, each within
  :data:`QUICK_FAILURE` seconds of its start (a shard that cannot start, say), is given up on:
  ``up`` says so, stops the other shards and exits 1. ``restart_limit`` 0 restores no shard:
  the first exit stops the fleet;
* SIGINT (Ctrl-C) or SIGTERM to ``up`` itself stops every shard (SIGTERM, SIGKILL after
  :data:`server.launcher.STOP_GRACE` seconds: each finishes its requests and writes its final
  snapshot) and exits 0, or 1 after a line naming each shard that did not stop cleanly (its
  final snapshot failed, or it had to be killed).

A shard that fails to come up at the start stops the fleet at once (exit 1): that is a setting
or a port to fix, not a crash to ride out. The shards run in ``up``'s process group, so a
terminal's Ctrl-C reaches them too and they stop as ``up`` does.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from client_sdk import wire

from .launcher import START_TIMEOUT, Fleet, LaunchError, exit_reason

__all__ = [
    "DEFAULT_RESTART_LIMIT",
    "FIRST_DELAY",
    "MAX_DELAY",
    "QUICK_FAILURE",
    "port_free",
    "run_fleet",
]

#: Failures in a row (each within QUICK_FAILURE seconds of its start) after which a shard is
#: given up on (``--restart-limit``).
DEFAULT_RESTART_LIMIT = 5
#: A shard that exits within this many seconds of its start failed quickly.
QUICK_FAILURE = 30.0
#: Seconds before the first restart; doubled for every quick failure in a row.
FIRST_DELAY = 0.5
#: The longest pause before a restart, in seconds.
MAX_DELAY = 10.0
_TICK = 0.1


def port_free(host: str, port: int) -> bool:
    """True if a server could bind ``host:port`` now (as uvicorn binds: SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class _Stop:
    """Set by SIGINT/SIGTERM while ``up`` runs."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __bool__(self) -> bool:
        return self.signal is not None


@dataclass
class _Watch:
    """What ``up`` knows of one shard: ``up``, ``waiting`` (to be restarted at ``at``) or
    ``starting`` (restarted, not answering yet: until ``at``)."""

    state: str = "up"
    at: float = 0.0
    #: Quick failures in a row.
    failures: int = 0


def run_fleet(
    n: int,
    *,
    host: str,
    base_port: int,
    data_dir: Path | None,
    extra_args: list[str],
    env: dict[str, str],
    restart_limit: int = DEFAULT_RESTART_LIMIT,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run ``n`` shards on ``base_port + i`` (0: ports the shards pick) until SIGINT/SIGTERM;
    returns the exit status. Blocks. ``extra_args`` go to every shard's ``serve``; shard i's
    data dir is ``data_dir/shard-i``; ``env`` is the shards' environment."""
    from .reshard import shard_dir

    out = out or sys.stdout
    err = err or sys.stderr

    def say(text: str, error: bool = False) -> None:
        stream = err if error else out
        stream.write(text + "\n")
        stream.flush()

    ports = [base_port + i if base_port else 0 for i in range(n)]
    taken = [(i, p) for i, p in enumerate(ports) if p and not port_free(host, p)]
    if taken:
        which = ", ".join(f"{p} (shard {i})" for i, p in taken)
        say(
            f"paramshard up: error: port(s) {which} on {host} already in use: stop what uses "
            f"them or pick another --base-port (0: ports the shards pick)",
            error=True,
        )
        return 1

    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    fleet = Fleet(
        n,
        host=host,
        ports=ports,
        data_dirs=[shard_dir(data_dir, i) for i in range(n)] if data_dir is not None else None,
        extra_args=extra_args,
        env=env,
        own_session=False,  # a terminal's Ctrl-C reaches the shards as it reaches `up`
    )
    status = 1
    try:
        status = _run(fleet, stop, restart_limit, say)
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the stopping short
            signal.signal(sig, signal.SIG_IGN)
        try:
            running = [fleet.poll(i) is None for i in range(n)]
            codes = fleet.close()
            say("paramshard: all shards stopped")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if status != 0:
        return status
    # A shard asked to stop exits 0 once its final snapshot is written (or it has no data
    # dir): any other status means what it held since its last snapshot is not on disk.
    failed = [(i, code) for i, code in enumerate(codes) if running[i] and code not in (0, None)]
    for i, code in failed:
        why = (
            "its final snapshot was not written; its data dir keeps the snapshots written before"
            if fleet.data_dirs
            else "it did not stop cleanly"
        )
        say(
            f"paramshard up: error: shard {i} ({fleet.urls[i]}) {exit_reason(code)} while "
            f"stopping: {why} (see its log above)",
            error=True,
        )
    return 1 if failed else 0


def _run(fleet: Fleet, stop: _Stop, restart_limit: int, say: Any) -> int:
    """Start the shards, say where they are, and keep them running until ``stop``; the exit
    status so far (1: a shard did not come up, or was given up on)."""
    n = fleet.n
    try:
        for i in range(n):
            fleet.start(i, wait=False)
        for i in range(n):
            fleet.wait(i, cancelled=lambda: bool(stop))
    except LaunchError as exc:
        say(f"paramshard up: error: {exc}\nstopping the other shards", error=True)
        return 1
    if not stop:
        say(f"paramshard: {n} shard(s) up")
        for i, (url, pid) in enumerate(zip(fleet.urls, fleet.pids)):
            say(f"  shard {i}/{n}  {url}  (pid {pid})")
        say(f"export {wire.ENV_SHARDS}={','.join(fleet.urls)}")
        say("Press Ctrl-C to stop.")
        if _watch(fleet, stop, restart_limit, say) is not None:
            return 1
    return 0


def _watch(fleet: Fleet, stop: _Stop, restart_limit: int, say: Any) -> int | None:
    """Keep the fleet running until ``stop``; returns the index of a shard given up on."""
    shards = [_Watch() for _ in range(fleet.n)]
    while not stop:
        now = time.monotonic()
        for i, w in enumerate(shards):
            if stop:
                break
            code = fleet.poll(i)
            if w.state in ("up", "starting") and code is not None:
                reason = exit_reason(code)
            elif w.state == "starting" and now > w.at:
                fleet.kill(i)
                reason = f"did not answer /healthz within {START_TIMEOUT:g} s of its start"
            else:
                if w.state == "waiting" and now >= w.at:
                    fleet.start(i, wait=False)
                    w.state, w.at = "starting", now + START_TIMEOUT
                elif w.state == "starting" and fleet.answers(i, timeout=0.5):
                    w.state = "up"
                    say(
                        f"paramshard up: shard {i} is back at {fleet.urls[i]} (pid {fleet.pids[i]})"
                    )
                continue
            ran = now - fleet.started_at[i]
            w.failures = w.failures + 1 if ran < QUICK_FAILURE else 1
            where = f"shard {i} ({fleet.urls[i]})"
            if w.failures > restart_limit:
                streak = (
                    f"failed {w.failures} times in a row, each within {QUICK_FAILURE:g} s of "
                    "its start"
                    if w.failures > 1
                    else reason
                )
                say(
                    f"paramshard up: error: {where} {streak}: giving up on it (--restart-limit "
                    f"{restart_limit}) and stopping the fleet; see its log above",
                    error=True,
                )
                return i
            delay = min(MAX_DELAY, FIRST_DELAY * 2 ** (w.failures - 1))
            keeps = "port and data dir" if fleet.data_dirs is not None else "port"
            say(
                f"paramshard up: {where} {reason} after {ran:.1f} s; restarting it on the "
                f"same {keeps} in {delay:g} s",
                error=True,
            )
            w.state, w.at = "waiting", now + delay
        time.sleep(_TICK)
    return None
