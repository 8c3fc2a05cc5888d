"""``paramshard``: run and look at shards.

    paramshard serve --shard-index 0 --num-shards 2 --port 7100   # one shard, in the foreground
    paramshard up --shards 2 --base-port 7100                      # a local fleet of 2 shards
    paramshard status --shards http://127.0.0.1:7100,http://127.0.0.1:7101
    paramshard demo [...]                                          # train a model on a local fleet
    paramshard reshard --from d0 d1 --to fleet3 --shards 3         # rewrite a checkpoint, offline
    paramshard health [--ready]                                    # probe this host's shard

This module owns what each command does with its flags and what it prints; the flags
themselves (argparse) are :mod:`server.cli_args`'s.
The work is elsewhere: ``serve`` in :mod:`server.serve`, ``up`` in
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
from .cli_args import PROG, UsageError, build_parser, int_in
from .config import InvalidSetting, ShardConfig, env_name, flag_name
from .launcher import client_host
from .probes import check
from .progress import Progress
from .reshard import ReshardError, reshard

__all__ = ["build_parser", "main"]


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
            "replica_group",
            "advertise_url",
            "replication_log_bytes",
            "replica_timeout",
            "etcd",
            "etcd_prefix",
            "lease_ttl",
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
    "half_cache_bytes",
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

    n = int_in(args.shards, "--shards", 1, 1024)
    base = int_in(args.base_port, "--base-port", 0, 65535 - n + 1)
    restart_limit = int_in(args.restart_limit, "--restart-limit", 0, 1000)
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


def _fleet_groups(args: argparse.Namespace) -> list[list[str]]:
    """The fleet's shard URLs per index, each index's replicas joined by ``|`` (as
    ``PARAMSHARD_SHARDS`` lists them)."""
    raw = args.shards if args.shards is not None else os.environ.get(wire.ENV_SHARDS)
    if not raw:
        raise UsageError(f"give the fleet with --shards URL,URL,... or set {wire.ENV_SHARDS}")
    groups = [
        [u.strip().rstrip("/") for u in part.split("|")] for part in raw.split(",") if part.strip()
    ]
    every = [u for group in groups for u in group]
    if not groups or any(not u.startswith(("http://", "https://")) for u in every):
        raise UsageError(
            "--shards must be comma-separated http(s):// URLs in shard-index order, the "
            f"replicas of one index joined by '|' (http://a0:7100|http://b0:7100,...), got {raw!r}"
        )
    if len(set(every)) != len(every):
        raise UsageError(f"--shards lists a URL twice ({raw!r}): list each replica once")
    return groups


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

    groups, timeout = _fleet_groups(args), _timeout(args)
    try:
        status, body, owner, replicas = fetch(groups, args.name, args.values, timeout)
    except httpx2.HTTPError as exc:
        print(f"{PROG} get: the shard owning {args.name!r} did not answer: {exc}", file=sys.stderr)
        return 1
    if status != 200 or not isinstance(body, dict):
        error = body.get("error", {}) if isinstance(body, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
        print(f"{PROG} get: {owner} answered {status}: {message or body}", file=sys.stderr)
        if replicas:
            print("\n".join(["replicas:", *(f"  {line}" for line in replicas)]), file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2) if args.json else render(body, args.values, replicas))
    return 0


def _status(args: argparse.Namespace) -> int:
    groups, timeout = _fleet_groups(args), _timeout(args)
    interval = _seconds_in(args.interval, "--interval", 0.1, 3600.0)
    count = None if args.count is None else int_in(args.count, "--count", 1, 10**9)
    proxy = args.proxy
    if proxy is not None and not proxy.startswith(("http://", "https://")):
        raise UsageError(f"--proxy must be an http(s):// URL, got {proxy!r}")
    return status.run(
        groups,
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
    m = int_in(args.shards, "--shards", 1, 65536)
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
