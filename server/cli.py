"""``paramshard``: run and look at shards.

    paramshard serve --shard-index 0 --num-shards 2 --port 7100   # one shard, in the foreground
    paramshard up --shards 2 --base-port 7100                      # a local fleet of 2 shards
    paramshard status --shards http://127.0.0.1:7100,http://127.0.0.1:7101
    paramshard demo [...]                                          # train a model on a local fleet
    paramshard reshard --from d0 d1 --to fleet3 --shards 3         # rewrite a checkpoint, offline
    paramshard health [--ready]                                    # probe this host's shard

This module owns the command line: the flags (argparse), their checks, and what each command
prints. The work is elsewhere: ``serve`` in :mod:`server.serve`, ``up`` in
:mod:`server.supervisor` (over :mod:`server.launcher`), ``status`` in :mod:`server.status`,
``health`` through :mod:`server.probes`, ``reshard`` in :mod:`server.reshard`, ``demo`` in
:mod:`server.demo`.
Nothing here imports the web stack; ``serve`` imports it when it runs.

``serve`` settings come from flags or ``PARAMSHARD_*`` environment variables (flags win); a bad
value exits with status 2 and one line naming the flag or variable. ``serve`` stops cleanly on
SIGTERM or SIGINT (Ctrl-C): requests in flight finish, a shard with ``--data-dir`` writes a
final snapshot, and it exits 0 (1 if that snapshot could not be written). ``up`` restarts a
shard that exits on its own and stops the fleet on SIGTERM or SIGINT, exiting 1 if a shard did
not stop cleanly (its final snapshot failed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from client_sdk import wire

from . import status
from .config import LOG_LEVELS, InvalidSetting, ShardConfig, env_name, flag_name
from .launcher import client_host
from .probes import check
from .progress import Progress
from .reshard import ReshardError, reshard
from .supervisor import DEFAULT_RESTART_LIMIT

__all__ = ["build_parser", "main"]

PROG = "paramshard"


class UsageError(Exception):
    """A bad argument to a subcommand: printed as one line, exit status 2."""


def _int_in(text: str, flag: str, lo: int = 1, hi: int = 65535) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{flag} must be an integer in {lo}..{hi}, got {text!r}") from None
    if not lo <= value <= hi:
        raise UsageError(f"{flag} must be in {lo}..{hi}, got {value}")
    return value


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
        p.add_argument(
            "--port",
            help=f"port to bind, 0 for one the system picks [{env_name('port')}, default 7100]",
        )
        p.add_argument(
            "--port-file",
            dest="port_file",
            metavar="FILE",
            help=f"once the port is bound, write its number to FILE (how a launcher learns the "
            f"port of a shard started with --port 0) [{env_name('port_file')}]",
        )
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
        "--log-format",
        dest="log_format",
        metavar="FORMAT",
        help=f"text, or json: one object a line with shard, event, worker, seq, variable and "
        f"outcome fields [{env_name('log_format')}, default text]",
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
        "--max-table-ids",
        dest="max_table_ids",
        metavar="N",
        help=f"ids one pull_rows/push_rows request may carry; more are refused with 413 "
        f"[{env_name('max_table_ids')}, default {ShardConfig.max_table_ids}]",
    )
    p.add_argument(
        "--max-table-rows",
        dest="max_table_rows",
        metavar="N",
        help=f"rows one embedding table may hold on this shard; a push past it is refused "
        f"with 413 [{env_name('max_table_rows')}, default {ShardConfig.max_table_rows}]",
    )
    p.add_argument(
        "--partition-bytes",
        dest="partition_bytes",
        metavar="BYTES",
        help="split a variable bigger than this (inited without partitions=) into parts of at "
        f"most this size, placed on their own shards; 0: never [{env_name('partition_bytes')}, "
        "default 0]",
    )
    p.add_argument(
        "--max-pending-ids",
        dest="max_pending_ids",
        metavar="N",
        help=f"ids one embedding table counts on this shard while they wait for admission "
        f"(its min_count); the least recently pushed are forgotten past it "
        f"[{env_name('max_pending_ids')}, default {ShardConfig.max_pending_ids}]",
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
        "--metrics-workers",
        dest="metrics_workers",
        metavar="N",
        help=f"workers with series of their own in /metrics, the most active; the "
        f'others are summed as worker="_other" [{env_name("metrics_workers")}, '
        f"default {ShardConfig.metrics_workers}]",
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
        "--token",
        dest="token",
        metavar="TOKEN[,TOKEN]",
        help=f"require 'Authorization: Bearer TOKEN' on every request but /healthz, /readyz "
        f"and /docs; several (comma-separated) are accepted at once, to rotate one "
        f"(prefer the env var or --token-file: a flag shows in ps) [{env_name('token')}, "
        "default: no auth]",
    )
    p.add_argument(
        "--token-file",
        dest="token_file",
        metavar="FILE",
        help=f"tokens as --token, one a line, read again when the file changes (a mounted "
        f"secret) [{env_name('token_file')}]",
    )
    p.add_argument(
        "--read-token",
        dest="read_token",
        metavar="TOKEN[,TOKEN]",
        help=f"tokens that may only pull, wait, poll and inspect (403 on a write); needs "
        f"--token or --token-file [{env_name('read_token')}]",
    )
    p.add_argument(
        "--tls-cert",
        dest="tls_cert",
        metavar="FILE",
        help=f"serve https with this certificate chain (PEM); needs --tls-key "
        f"[{env_name('tls_cert')}]",
    )
    p.add_argument(
        "--tls-key",
        dest="tls_key",
        metavar="FILE",
        help=f"the certificate's private key (PEM) [{env_name('tls_key')}]",
    )
    if fleet:
        p.add_argument(
            "--fleet-urls",
            dest="fleet_urls",
            metavar="URL,...",
            help=f"every shard's URL in shard-index order, as this shard reaches them: a "
            f"GET /v1/variables/NAME for a name another shard owns is answered with that "
            f"shard's answer, and the dashboard's fleet view and GET /v1/fleet probe them "
            f"[{env_name('fleet_urls')}]",
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
        description="Start N shards on consecutive ports and print their URLs. A shard "
        "that exits on its own is started again on the same port with the same "
        "data dir; Ctrl-C or SIGTERM stops them all.",
    )
    p.add_argument("--shards", required=True, metavar="N", help="number of shards")
    p.add_argument(
        "--base-port",
        dest="base_port",
        default="7100",
        metavar="P",
        help="shard i listens on P+i; 0 for ports the shards pick (default 7100)",
    )
    p.add_argument(
        "--restart-limit",
        dest="restart_limit",
        default=str(DEFAULT_RESTART_LIMIT),
        metavar="K",
        help="give up (stop the fleet, exit 1) when a shard failed more than K times in a "
        "row, each within 30 s of its start; 0: never restart a shard (default "
        f"{DEFAULT_RESTART_LIMIT})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    _add_shard_options(p, fleet=False)

    p = sub.add_parser(
        "status",
        help="print a table of a fleet's shards",
        description="Ask every shard for /v1/cluster and /healthz (twice, --interval apart, "
        "for the rates), print a row per shard: place, incarnation, variables, bytes, "
        "pushes/s, pulls/s, last snapshot's age, auth mode, health. Exit 0 when all are up "
        "and in fleet order, else 1 (with --watch: in the last table).",
    )
    p.add_argument(
        "--shards",
        metavar="URL,URL,...",
        help=f"the fleet's shard URLs in order [{wire.ENV_SHARDS}]",
    )
    p.add_argument("--timeout", default="3", help="seconds to wait per shard (default 3)")
    p.add_argument(
        "--watch",
        action="store_true",
        help="refresh the table every --interval seconds until Ctrl-C (in place on a terminal)",
    )
    p.add_argument(
        "--interval",
        default="1",
        metavar="S",
        help="seconds between readings; pushes/s and pulls/s are over this window (default 1)",
    )
    p.add_argument(
        "--count", metavar="N", help="with --watch: stop after N tables (default: never)"
    )
    p.add_argument(
        "--proxy",
        metavar="URL",
        help="probe the shards through this HTTP proxy (default: straight to them; HTTP_PROXY "
        "and the like are not used)",
    )

    p = sub.add_parser(
        "get",
        help="print one variable (or counter) of a fleet",
        description="Ask the shard that owns NAME for it and print its fields (a "
        "counter's value among them). Sends PARAMSHARD_TOKEN when set. Exit 0 when "
        "found, else say why and exit 1.",
    )
    p.add_argument("name", metavar="NAME", help="the variable's name")
    p.add_argument(
        "--shards",
        metavar="URL,URL,...",
        help=f"the fleet's shard URLs in order [{wire.ENV_SHARDS}]",
    )
    p.add_argument("--values", action="store_true", help="print its values too (small ones)")
    p.add_argument("--json", action="store_true", help="print the shard's JSON as it is")
    p.add_argument("--timeout", default="10", help="seconds to wait (default 10)")

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
            from .serve import serve  # the web stack, for this command only

            return serve(_config_from(args))
        if args.command == "up":
            return _up(args)
        if args.command == "status":
            return _status(args)
        if args.command == "reshard":
            return _reshard(args)
        if args.command == "health":
            return _health(args)
        if args.command == "get":
            return _get(args)
    except (InvalidSetting, UsageError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


def _config_from(args: argparse.Namespace) -> ShardConfig:
    flags = {
        k: getattr(args, k, None)
        for k in (
            "shard_index",
            "num_shards",
            "host",
            "port",
            "port_file",
            "fleet_urls",
            *_PASSED_ON,
            *_AUTH,
            "data_dir",
        )
    }
    return ShardConfig.from_sources(flags, os.environ)


#: Flags ``up`` passes on to every shard unchanged (``--data-dir`` becomes DIR/shard-i).
_PASSED_ON = (
    "max_request_bytes",
    "log_level",
    "log_format",
    "access_log",
    "snapshot_interval",
    "keep_snapshots",
    "keep_checkpoints",
    "restore",
    "max_queued_bytes",
    "max_queued_requests",
    "max_request_names",
    "partition_bytes",
    "dedup_max_workers",
    "dedup_idle_seconds",
    "metrics_workers",
    "max_head_bytes",
    "head_timeout",
    "body_timeout",
    "min_body_rate",
    "http",
    "tls_cert",
    "tls_key",
    "max_table_ids",
    "max_table_rows",
    "max_pending_ids",
)


#: Auth settings: ``up`` hands them to its shards in their environment, where ``ps`` does not
#: show them.
_AUTH = ("token", "token_file", "read_token")


# -- up -------------------------------------------------------------------------------------


def _auth_env(flags: dict[str, str | None]) -> dict[str, str]:
    """The auth settings for ``up``'s shards: each flag given, else its env var as set."""
    env = {}
    for key in _AUTH:
        value = flags.get(key)
        if value is None:
            value = os.environ.get(env_name(key))
        if value is not None:
            env[env_name(key)] = str(value)
    return env


def _up(args: argparse.Namespace) -> int:
    from .supervisor import run_fleet

    n = _int_in(args.shards, "--shards", 1, 1024)
    base = _int_in(args.base_port, "--base-port", 0, 65535 - n + 1)
    restart_limit = _int_in(args.restart_limit, "--restart-limit", 0, 1000)
    host = args.host
    # validate pass-through flags here, so a bad one is one message rather than N dead children
    passed = {k: getattr(args, k) for k in _PASSED_ON}
    auth = {k: getattr(args, k) for k in _AUTH}
    ShardConfig.from_sources(
        {"host": host, "port": base, "num_shards": n, **passed, "data_dir": args.data_dir},
        _auth_env(auth),
    )
    extra: list[str] = []
    for key, value in passed.items():
        if value is None:
            continue
        if isinstance(value, bool):
            extra.append(flag_name(key) if value else "--no-" + flag_name(key)[2:])
        else:
            extra += [flag_name(key), str(value)]
    if base:  # every shard's URL is known: a variable's inspection follows it to its owner
        reach, scheme = client_host(host), "https" if args.tls_cert else "http"
        extra += ["--fleet-urls", ",".join(f"{scheme}://{reach}:{base + i}" for i in range(n))]
    # the flags say everything; stray settings must not override them
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(wire.ENV_PREFIX) or k == wire.ENV_SHARDS
    }
    env.update(_auth_env(auth))
    return run_fleet(
        n,
        host=host,
        base_port=base,
        data_dir=Path(args.data_dir) if args.data_dir is not None else None,
        extra_args=extra,
        env=env,
        restart_limit=restart_limit,
    )


# -- status ---------------------------------------------------------------------------------


def _fleet_urls(args: argparse.Namespace) -> list[str]:
    raw = args.shards if args.shards is not None else os.environ.get(wire.ENV_SHARDS)
    if not raw:
        raise UsageError(f"give the fleet with --shards URL,URL,... or set {wire.ENV_SHARDS}")
    urls = [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]
    if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
        raise UsageError(f"--shards must be comma-separated http(s):// URLs, got {raw!r}")
    return urls


def _timeout(args: argparse.Namespace) -> float:
    return _seconds_in(args.timeout, "--timeout", 0.1, 600.0)


def _seconds_in(text: str, flag: str, lo: float, hi: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} must be a number of seconds, got {text!r}") from None
    if not lo <= value <= hi:  # also refuses nan
        raise UsageError(f"{flag} must be between {lo:g} and {hi:g} seconds, got {text!r}")
    return value


def _get(args: argparse.Namespace) -> int:
    import httpx2

    from .show import fetch, render

    urls, timeout = _fleet_urls(args), _timeout(args)
    try:
        status, body, owner = fetch(urls, args.name, args.values, timeout)
    except httpx2.HTTPError as exc:
        print(f"{PROG} get: the shard owning {args.name!r} did not answer: {exc}", file=sys.stderr)
        return 1
    if status != 200 or not isinstance(body, dict):
        error = body.get("error", {}) if isinstance(body, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
        print(f"{PROG} get: {owner} answered {status}: {message or body}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2) if args.json else render(body, args.values))
    return 0


def _status(args: argparse.Namespace) -> int:
    urls, timeout = _fleet_urls(args), _timeout(args)
    interval = _seconds_in(args.interval, "--interval", 0.1, 3600.0)
    count = None if args.count is None else _int_in(args.count, "--count", 1, 10**9)
    proxy = args.proxy
    if proxy is not None and not proxy.startswith(("http://", "https://")):
        raise UsageError(f"--proxy must be an http(s):// URL, got {proxy!r}")
    return status.run(
        urls,
        timeout,
        proxy=proxy,
        watch=args.watch,
        interval=interval,
        count=count,
        out=sys.stdout,
        err=sys.stderr,
    )


# -- reshard --------------------------------------------------------------------------------


def _reshard(args: argparse.Namespace) -> int:
    m = _int_in(args.shards, "--shards", 1, 65536)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG} reshard: %(levelname)s: %(message)s")
    try:
        result = reshard(
            [Path(d) for d in args.sources],
            Path(args.dest),
            m,
            checkpoint=args.checkpoint,
            latest=args.latest,
            progress=Progress(),  # on standard error, when it is a terminal
        )
    except ReshardError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        print(f"{PROG} reshard: error: {exc}", file=sys.stderr)
        return 1
    tables = (
        f" and {result.rows} row(s) of {result.tables} embedding table(s)" if result.tables else ""
    )
    print(
        f"{PROG}: checkpoint {result.checkpoint}: {result.variables} variable(s){tables} from "
        f"{result.source_shards} shard(s) rewritten for {m} in {result.seconds:.1f}s"
    )
    for i, snap in enumerate(result.snapshots):
        print(
            f"  shard {i}/{m}  --data-dir {snap.manifest_path.parent}  "
            f"({len(snap.manifest['variables'])} variables, "
            f"{status.human_bytes(snap.manifest['values_bytes'])})"
        )
    return 0


# -- health ---------------------------------------------------------------------------------


def _health(args: argparse.Namespace) -> int:
    keys = (env_name("host"), env_name("port"), env_name("tls_cert"), env_name("tls_key"))
    config = ShardConfig.from_sources(
        {"port": args.port}, {k: v for k, v in os.environ.items() if k in keys}
    )
    try:
        timeout = float(args.timeout)
    except ValueError:
        raise UsageError(f"--timeout must be a number of seconds, got {args.timeout!r}") from None
    path = "/readyz" if args.ready else "/healthz"
    url = f"{config.scheme}://{client_host(config.host)}:{config.port}{path}"
    problem = check(url, timeout)
    if problem is not None:
        print(f"{PROG} health: {url} {problem}", file=sys.stderr)
        return 1
    print(f"{url} ok")
    return 0


# -- demo -----------------------------------------------------------------------------------


def _demo(argv: list[str]) -> int:
    from .demo.run import run_demo

    return run_demo(argv)


if __name__ == "__main__":
    sys.exit(main())
