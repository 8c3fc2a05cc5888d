"""``paramshard``: run and look at shards.

    paramshard serve --shard-index 0 --num-shards 2 --port 7100   # one shard, in the foreground
    paramshard up --shards 2 --base-port 7100                      # a local fleet of 2 shards
    paramshard status --shards http://127.0.0.1:7100,http://127.0.0.1:7101
    paramshard demo [...]                                          # train a model on a local fleet
    paramshard reshard --from d0 d1 --to fleet3 --shards 3         # rewrite a checkpoint, offline
    paramshard health [--ready]                                    # probe this host's shard

``serve`` settings come from flags or ``PARAMSHARD_*`` environment variables (flags win); a bad
value exits with status 2 and one line naming the flag or variable. ``serve`` and ``up`` stop
cleanly on SIGTERM or SIGINT (Ctrl-C): requests in flight finish, a shard with ``--data-dir``
writes a final snapshot, and they exit 0 (1 if that snapshot could not be written).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from client_sdk import wire

from .config import LOG_LEVELS, InvalidSetting, ShardConfig, env_name, flag_name
from .reshard import ReshardError, reshard, shard_dir

__all__ = ["build_parser", "main", "serve"]

PROG = "paramshard"
_STARTUP_TIMEOUT = 60.0


class UsageError(Exception):
    """A bad argument to a subcommand: printed as one line, exit status 2."""


# -- parser ---------------------------------------------------------------------------------


def _add_shard_options(p: argparse.ArgumentParser, *, fleet: bool) -> None:
    """Flags shared by ``serve`` and ``up`` (``up`` passes them on to every shard)."""
    if fleet:
        p.add_argument(
            "--shard-index",
            dest="shard_index",
            metavar="I",
            help=f"this shard's index, 0..N-1, or 'auto' for the number at the end "
            f"of the host name (a StatefulSet pod's ordinal) "
            f"[{env_name('shard_index')}, default 0]",
        )
        p.add_argument(
            "--num-shards",
            dest="num_shards",
            metavar="N",
            help=f"shards in the fleet [{env_name('num_shards')}, default 1]",
        )
        p.add_argument("--host", help=f"address to bind [{env_name('host')}, default 127.0.0.1]")
        p.add_argument("--port", help=f"port to bind [{env_name('port')}, default 7100]")
    p.add_argument(
        "--max-request-bytes",
        dest="max_request_bytes",
        metavar="SIZE",
        help=f"largest request body, e.g. 64MiB [{env_name('max_request_bytes')}, default 1GiB]",
    )
    p.add_argument(
        "--log-level",
        dest="log_level",
        metavar="LEVEL",
        help=f"{'|'.join(LOG_LEVELS)} [{env_name('log_level')}, default info]",
    )
    p.add_argument(
        "--access-log",
        dest="access_log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"log every request [{env_name('access_log')}, default off]",
    )
    if fleet:
        p.add_argument(
            "--data-dir",
            dest="data_dir",
            metavar="DIR",
            help=f"write snapshots here and restore the newest valid one at start "
            f"[{env_name('data_dir')}, default: none, state is lost on exit]",
        )
    else:
        p.add_argument(
            "--data-dir",
            dest="data_dir",
            metavar="DIR",
            help="snapshots of shard i go to DIR/shard-i (default: none)",
        )
    p.add_argument(
        "--snapshot-interval",
        dest="snapshot_interval",
        metavar="SECONDS",
        help=f"snapshot this often when something changed, 0 for never (still on "
        f"shutdown and on request) [{env_name('snapshot_interval')}, default 30]",
    )
    p.add_argument(
        "--keep-snapshots",
        dest="keep_snapshots",
        metavar="K",
        help=f"periodic, shutdown and requested snapshots kept (the newest K; "
        f"fleet checkpoints are not counted) [{env_name('keep_snapshots')}, "
        "default 3]",
    )
    p.add_argument(
        "--keep-checkpoints",
        dest="keep_checkpoints",
        metavar="N",
        help=f"fleet checkpoints kept: the newest N, or 0 for every one until it is "
        f"deleted (DELETE /v1/checkpoints/ID) [{env_name('keep_checkpoints')}, "
        "default 0]",
    )
    p.add_argument(
        "--restore",
        dest="restore",
        metavar="CHECKPOINT",
        help=f"restore this fleet checkpoint's snapshot instead of the newest "
        f"[{env_name('restore')}]",
    )
    p.add_argument(
        "--max-queued-bytes",
        dest="max_queued_bytes",
        metavar="SIZE",
        help=f"request bodies admitted at once; more wait, then get 429 "
        f"[{env_name('max_queued_bytes')}, default max(2GiB, "
        "--max-request-bytes)]",
    )
    p.add_argument(
        "--max-queued-requests",
        dest="max_queued_requests",
        metavar="N",
        help=f"pushes/pulls admitted at once [{env_name('max_queued_requests')}, default 64]",
    )
    p.add_argument(
        "--max-request-names",
        dest="max_request_names",
        metavar="N",
        help=f"entries (names, variables, gradients, table rows) one request may "
        f"hold; more are refused with 413 [{env_name('max_request_names')}, "
        f"default {ShardConfig.max_request_names}]",
    )
    p.add_argument(
        "--dedup-max-workers",
        dest="dedup_max_workers",
        metavar="N",
        help=f"workers whose applied seqs are remembered, the least recently seen "
        f"forgotten first [{env_name('dedup_max_workers')}, default 10000]",
    )
    p.add_argument(
        "--dedup-idle-seconds",
        dest="dedup_idle_seconds",
        metavar="S",
        help=f"forget a worker's applied seqs after S seconds without a write from "
        f"it, 0 for never [{env_name('dedup_idle_seconds')}, default 3600]",
    )
    p.add_argument(
        "--max-head-bytes",
        dest="max_head_bytes",
        metavar="SIZE",
        help=f"largest request head (request line and headers); a bigger one is "
        f"answered 400 and its connection closed [{env_name('max_head_bytes')}, "
        "default 64KiB]",
    )
    p.add_argument(
        "--head-timeout",
        dest="head_timeout",
        metavar="SECONDS",
        help=f"a connection whose request head is not complete this long after "
        f"its first byte (or the connection's opening) is closed "
        f"[{env_name('head_timeout')}, default 10]",
    )
    p.add_argument(
        "--body-timeout",
        dest="body_timeout",
        metavar="SECONDS",
        help=f"while a request body is read, every SECONDS must bring SECONDS x "
        f"--min-body-rate bytes of it (at least 1), else the connection is "
        f"closed [{env_name('body_timeout')}, default 30]",
    )
    p.add_argument(
        "--min-body-rate",
        dest="min_body_rate",
        metavar="SIZE",
        help=f"bytes per second a request body must average over each "
        f"--body-timeout [{env_name('min_body_rate')}, default 16KiB]",
    )
    p.add_argument(
        "--http",
        dest="http",
        metavar="MODE",
        help=f"auto: serve through the fast HTTP path when the installed uvicorn "
        f"and FastAPI offer what it needs, else (with a warning) the stock "
        f"way; stock: always uvicorn's h11 protocol and the FastAPI routes "
        f"(slower, the same answers) [{env_name('http')}, default auto]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="paramshard parameter-server shards")
    sub = parser.add_subparsers(dest="command", metavar="{serve,up,status,health,reshard,demo}")

    p = sub.add_parser(
        "serve",
        help="run one shard in the foreground",
        description="Run one shard. Flags override PARAMSHARD_* variables.",
    )
    _add_shard_options(p, fleet=True)

    p = sub.add_parser(
        "up",
        help="run a local fleet of N shards in the foreground",
        description="Start N shards on consecutive ports, print their URLs, and "
        "stop them all on Ctrl-C or SIGTERM.",
    )
    p.add_argument("--shards", required=True, metavar="N", help="number of shards")
    p.add_argument(
        "--base-port",
        dest="base_port",
        default="7100",
        metavar="P",
        help="shard i listens on P+i (default 7100)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    _add_shard_options(p, fleet=False)

    p = sub.add_parser(
        "status",
        help="print a table of a fleet's shards",
        description="Ask every shard for /v1/cluster and /healthz. Exit 0 when all "
        "are up and in fleet order, else 1.",
    )
    p.add_argument(
        "--shards",
        metavar="URL,URL,...",
        help=f"the fleet's shard URLs in order [{wire.ENV_SHARDS}]",
    )
    p.add_argument("--timeout", default="3", help="seconds to wait per shard (default 3)")

    p = sub.add_parser(
        "reshard",
        help="rewrite a fleet checkpoint for another number of shards",
        description="Offline: read the snapshots of a fleet checkpoint from every "
        "shard's data dir and write them for M shards under --to "
        "(shard j's data dir is TO/shard-j). Values, versions and "
        "optimizer state are kept.",
    )
    p.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        required=True,
        metavar="DIR",
        help="the data dir of every shard of the old fleet (any order)",
    )
    p.add_argument(
        "--to",
        dest="dest",
        required=True,
        metavar="DIR",
        help="a new (or empty) directory for the new fleet's data dirs",
    )
    p.add_argument("--shards", required=True, metavar="M", help="shards of the new fleet")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--checkpoint",
        metavar="ID",
        help="the fleet checkpoint to read (default: the newest every dir holds)",
    )
    which.add_argument(
        "--latest",
        action="store_true",
        help="use each dir's newest snapshot (after stopping the fleet cleanly)",
    )
    p = sub.add_parser(
        "health",
        help="exit 0 if this host's shard is healthy (container checks)",
        description="Probe the shard that `paramshard serve` runs on this host "
        "with the same PARAMSHARD_HOST / PARAMSHARD_PORT: exit 0 if "
        "GET /healthz (or /readyz) answers 200, else say why and exit "
        "1. The container image's HEALTHCHECK runs it.",
    )
    p.add_argument(
        "--ready",
        action="store_true",
        help="probe /readyz (restored and not draining) instead of /healthz (alive)",
    )
    p.add_argument("--port", help=f"the shard's port [{env_name('port')}, default 7100]")
    p.add_argument("--timeout", default="2", help="seconds to wait (default 2)")

    sub.add_parser(
        "demo",
        help="train a small model on a local fleet (see `paramshard demo -h`)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paramshard`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return _demo(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "serve":
            return serve(_config_from(args))
        if args.command == "up":
            return _up(args)
        if args.command == "status":
            return _status(args)
        if args.command == "reshard":
            return _reshard(args)
        if args.command == "health":
            return _health(args)
    except (InvalidSetting, UsageError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


def _config_from(args: argparse.Namespace) -> ShardConfig:
    flags = {
        k: getattr(args, k, None)
        for k in ("shard_index", "num_shards", "host", "port", *_PASSED_ON, "data_dir")
    }
    return ShardConfig.from_sources(flags, os.environ)


#: Flags ``up`` passes on to every shard unchanged (``--data-dir`` becomes DIR/shard-i).
_PASSED_ON = (
    "max_request_bytes",
    "log_level",
    "access_log",
    "snapshot_interval",
    "keep_snapshots",
    "keep_checkpoints",
    "restore",
    "max_queued_bytes",
    "max_queued_requests",
    "max_request_names",
    "dedup_max_workers",
    "dedup_idle_seconds",
    "max_head_bytes",
    "head_timeout",
    "body_timeout",
    "min_body_rate",
    "http",
)


# -- serve ----------------------------------------------------------------------------------


def serve(config: ShardConfig) -> int:
    """Run one shard with uvicorn until SIGTERM/SIGINT; blocks; returns 0 after a clean stop.

    Uses uvloop when installed, and the HTTP path :func:`server.upstream.serving` chooses
    (``config.http``). Returns 1 if the shard cannot start (e.g. its port is taken).
    """
    import uvicorn

    from .app import create_app
    from .readguard import EdgeLimits
    from .store.heap import keep_big_buffers
    from .upstream import serving

    keep_big_buffers()
    limits = EdgeLimits(
        max_head_bytes=config.max_head_bytes,
        head_timeout=config.head_timeout,
        body_timeout=config.body_timeout,
        min_body_rate=config.min_body_rate,
    )

    logging.basicConfig(
        level=logging.DEBUG
        if config.log_level == "trace"
        else getattr(logging, config.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(config)
    served = serving(app, limits, config.http)
    uv_config = uvicorn.Config(
        served.app,
        host=config.host,
        port=config.port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http=served.protocol,
        h11_max_incomplete_event_size=limits.max_head_bytes,  # the head bound, on h11
        log_level=config.log_level,
        access_log=config.access_log,
        server_header=False,
        proxy_headers=False,  # X-Forwarded-* would only rename the client in logs; per-request work
        timeout_graceful_shutdown=10,
    )
    server = _draining_server(uv_config, app.state.gate)
    app.state.durability.on_fatal = lambda reason: setattr(server, "should_exit", True)

    def stop(signum: int, frame: Any) -> None:
        # Before uvicorn installs its handlers (startup) and after it restores these ones: uvicorn
        # re-raises the signal that stopped it, which must not turn a clean stop into a kill.
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits with 3 when it cannot start (e.g. port taken)
        if exc.code in (None, 0):
            return 0
        print(
            f"{PROG} serve: error: shard {config.fleet} could not start on "
            f"{config.host}:{config.port} (see the log above)",
            file=sys.stderr,
        )
        return 1
    failure = app.state.durability.failed or app.state.shutdown_error
    if failure:
        print(f"{PROG} serve: error: shard {config.fleet}: {failure}", file=sys.stderr)
        return 1
    return 0


def _draining_server(config: Any, gate: Any) -> Any:
    """A uvicorn server for ``config`` that also drains ``gate`` on SIGTERM/SIGINT."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, which also turns the shard's gate to ``draining`` on SIGTERM or
        SIGINT, so ``/readyz`` says 503 and new data-plane requests are refused while the
        requests in flight finish."""

        def __init__(self, config: Any, gate: Any) -> None:
            super().__init__(config)
            self.gate = gate

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            if self.gate.phase in ("ready", "restoring"):
                self.gate.set_phase("draining", "shutting down")

    return DrainingServer(config, gate)


# -- up -------------------------------------------------------------------------------------


def _positive_int(text: str, flag: str, lo: int = 1, hi: int = 65535) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag} must be an integer in {lo}..{hi}, got {text!r}") from None
    if not lo <= value <= hi:
        raise UsageError(f"{flag} must be in {lo}..{hi}, got {value}")
    return value


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def client_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def healthy(url: str, timeout: float = 1.0) -> bool:
    """True if ``url``/healthz answers 200 (never through a proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + "/healthz", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


class _Stop:
    """Set by SIGINT/SIGTERM while ``up`` runs."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signal = signum


def _up(args: argparse.Namespace) -> int:
    n = _positive_int(args.shards, "--shards", 1, 1024)
    base = _positive_int(args.base_port, "--base-port", 1, 65535 - n + 1)
    host = args.host
    # validate pass-through flags here, so a bad one is one message rather than N dead children
    passed = {k: getattr(args, k) for k in _PASSED_ON}
    ShardConfig.from_sources(
        {"host": host, "port": base, "num_shards": n, **passed, "data_dir": args.data_dir}, {}
    )
    extra: list[str] = []
    for key, value in passed.items():
        if value is None:
            continue
        if isinstance(value, bool):
            extra.append(flag_name(key) if value else "--no-" + flag_name(key)[2:])
        else:
            extra += [flag_name(key), str(value)]

    ports = [base + i for i in range(n)]
    taken = [(i, p) for i, p in enumerate(ports) if not _port_free(host, p)]
    if taken:
        which = ", ".join(f"{p} (shard {i})" for i, p in taken)
        print(
            f"{PROG} up: error: port(s) {which} on {host} already in use: stop what uses them "
            f"or pick another --base-port",
            file=sys.stderr,
        )
        return 1

    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    urls = [f"http://{client_host(host)}:{p}" for p in ports]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    for key in [k for k in env if k.startswith(wire.ENV_PREFIX) and k != wire.ENV_SHARDS]:
        del env[key]  # the flags below say everything; stray settings must not override them
    procs: list[subprocess.Popen] = []
    try:
        for i, port in enumerate(ports):
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
                *extra,
            ]
            if args.data_dir is not None:
                cmd += ["--data-dir", str(shard_dir(Path(args.data_dir), i))]
            procs.append(subprocess.Popen(cmd, env=env))
        failed = _wait_until_up(procs, urls, stop)
        if failed is None and stop.signal is None:
            print(f"{PROG}: {n} shard(s) up", flush=True)
            for i, (url, proc) in enumerate(zip(urls, procs)):
                print(f"  shard {i}/{n}  {url}  (pid {proc.pid})", flush=True)
            print(f"export {wire.ENV_SHARDS}={','.join(urls)}", flush=True)
            print("Press Ctrl-C to stop.", flush=True)
            failed = _watch(procs, stop)
        if failed is not None:
            i, code = failed
            print(
                f"{PROG} up: error: shard {i} ({urls[i]}) exited with status {code}; "
                "stopping the other shards",
                file=sys.stderr,
                flush=True,
            )
        _stop_all(procs)
        if failed is not None:
            return 1
        print(f"{PROG}: all shards stopped", flush=True)
        return 0
    finally:
        _stop_all(procs, kill=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_until_up(
    procs: list[subprocess.Popen], urls: list[str], stop: _Stop
) -> tuple[int, int] | None:
    deadline = time.monotonic() + _STARTUP_TIMEOUT
    pending = set(range(len(procs)))
    while pending and stop.signal is None:
        for i in sorted(pending):
            code = procs[i].poll()
            if code is not None:
                return i, code
            if healthy(urls[i], timeout=0.5):
                pending.discard(i)
        if time.monotonic() > deadline:
            i = min(pending)
            print(
                f"{PROG} up: error: shard {i} ({urls[i]}) not healthy after {_STARTUP_TIMEOUT:g}s",
                file=sys.stderr,
            )
            return i, -1
        if pending:
            time.sleep(0.1)
    return None


def _watch(procs: list[subprocess.Popen], stop: _Stop) -> tuple[int, int] | None:
    while stop.signal is None:
        for i, proc in enumerate(procs):
            code = proc.poll()
            if code is not None:
                return i, code
        time.sleep(0.2)
    return None


def _stop_all(procs: list[subprocess.Popen], kill: bool = False, timeout: float = 15.0) -> None:
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# -- status ---------------------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _probe(url: str, timeout: float) -> dict[str, Any]:
    import httpx2

    try:
        with httpx2.Client(timeout=timeout) as client:
            info = client.get(url + "/v1/cluster").raise_for_status().json()
            healthy = client.get(url + "/healthz").status_code == 200
        return {"info": info, "healthy": healthy}
    except (httpx2.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _status(args: argparse.Namespace) -> int:
    raw = args.shards if args.shards is not None else os.environ.get(wire.ENV_SHARDS)
    if not raw:
        raise UsageError(f"give the fleet with --shards URL,URL,... or set {wire.ENV_SHARDS}")
    urls = [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]
    if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
        raise UsageError(f"--shards must be comma-separated http(s):// URLs, got {raw!r}")
    try:
        timeout = float(args.timeout)
    except ValueError:
        raise UsageError(f"--timeout must be a number of seconds, got {args.timeout!r}") from None
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        results = list(pool.map(lambda u: _probe(u, timeout), urls))
    rows = [("URL", "SHARD", "INCARNATION", "VARIABLES", "BYTES", "HEALTHY")]
    ok = True
    for i, (url, res) in enumerate(zip(urls, results)):
        info = res.get("info")
        if info is None:
            ok = False
            rows.append((url, "?", "-", "-", "-", "down"))
            continue
        slot = f"{info.get('shard_index')}/{info.get('num_shards')}"
        health = "yes" if res["healthy"] else "no"
        if (info.get("shard_index"), info.get("num_shards")) != (i, len(urls)):
            health = f"mismatch (listed as {i}/{len(urls)})"
        ok = ok and health == "yes"
        rows.append(
            (
                url,
                slot,
                str(info.get("incarnation", "?")),
                str(info.get("variables", "?")),
                _human_bytes(int(info.get("bytes", 0))),
                health,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for url, res in zip(urls, results):
        if "error" in res:
            print(f"{url}: {res['error']}", file=sys.stderr)
    return 0 if ok else 1


# -- reshard --------------------------------------------------------------------------------


def _reshard(args: argparse.Namespace) -> int:
    m = _positive_int(args.shards, "--shards", 1, 65536)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG} reshard: %(levelname)s: %(message)s")
    try:
        result = reshard(
            [Path(d) for d in args.sources],
            Path(args.dest),
            m,
            checkpoint=args.checkpoint,
            latest=args.latest,
        )
    except ReshardError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        print(f"{PROG} reshard: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{PROG}: checkpoint {result.checkpoint}: {result.variables} variable(s) from "
        f"{result.source_shards} shard(s) rewritten for {m} in {result.seconds:.1f}s"
    )
    for i, snap in enumerate(result.snapshots):
        print(
            f"  shard {i}/{m}  --data-dir {snap.manifest_path.parent}  "
            f"({len(snap.manifest['variables'])} variables, "
            f"{_human_bytes(snap.manifest['values_bytes'])})"
        )
    return 0


# -- health ---------------------------------------------------------------------------------


def _health(args: argparse.Namespace) -> int:
    keys = (env_name("host"), env_name("port"))
    config = ShardConfig.from_sources(
        {"port": args.port}, {k: v for k, v in os.environ.items() if k in keys}
    )
    try:
        timeout = float(args.timeout)
    except ValueError:
        raise UsageError(f"--timeout must be a number of seconds, got {args.timeout!r}") from None
    path = "/readyz" if args.ready else "/healthz"
    url = f"http://{client_host(config.host)}:{config.port}{path}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as exc:
        print(f"{PROG} health: {url} answered {exc.code}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{PROG} health: {url} did not answer: {exc}", file=sys.stderr)
        return 1
    print(f"{url} ok")
    return 0


# -- demo -----------------------------------------------------------------------------------


def _demo(argv: list[str]) -> int:
    try:
        from .demo import run_demo
    except ModuleNotFoundError as exc:
        if exc.name not in ("server.demo", __package__ + ".demo"):
            raise
        print(
            f"{PROG} demo: the demo is not available in this installation (server/demo.py is "
            "missing); run a fleet with `paramshard up` and the examples/ scripts instead",
            file=sys.stderr,
        )
        return 1
    return run_demo(argv)


if __name__ == "__main__":
    sys.exit(main())
