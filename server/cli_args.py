"""The ``paramshard`` command line's flags: :func:`build_parser` builds every subcommand's
argparse parser (``serve``'s and ``up``'s shard settings with their ``PARAMSHARD_*`` variables
in the help), and :class:`UsageError` is what a bad argument raises. What each command does with
its flags is :mod:`server.cli`'s; nothing here imports the web stack.
"""

from __future__ import annotations

import argparse

from client_sdk import wire

from .config import LOG_LEVELS, ShardConfig, env_name
from .supervisor import DEFAULT_RESTART_LIMIT

__all__ = ["PROG", "UsageError", "build_parser", "int_in"]

PROG = "paramshard"


class UsageError(Exception):
    """A bad argument to a subcommand: printed as one line, exit status 2."""


def int_in(text: str, flag: str, lo: int = 1, hi: int = 65535) -> int:
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
        "--half-cache-bytes",
        dest="half_cache_bytes",
        metavar="BYTES",
        help="bytes of big float32 values kept narrowed for the next float16/bfloat16 puller "
        f"of the same version; 0: none [{env_name('half_cache_bytes')}, default 256MiB]",
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
            help=f"every shard's URL in shard-index order, as this shard reaches them, the "
            f"replicas of an index joined by | (a0|b0,a1|b1): a GET /v1/variables/NAME for a "
            f"name another shard owns is answered with that shard's answer, and the "
            f"dashboard's fleet view and GET /v1/fleet probe them [{env_name('fleet_urls')}]",
        )
    if fleet:
        p.add_argument(
            "--replica-group",
            dest="replica_group",
            metavar="URL|URL|...",
            help=f"every replica of this shard index, primary first: the first URL is the "
            f"primary at epoch 1, the others its backups (it forwards every write to them and "
            f"acknowledges once they have it); needs --advertise-url; {{index}} in it stands "
            f"for the shard index [{env_name('replica_group')}, default: none, the shard is its "
            f"index's only copy]",
        )
        p.add_argument(
            "--advertise-url",
            dest="advertise_url",
            metavar="URL",
            help=f"this replica's URL as the group lists it ({{index}}: the shard index) "
            f"[{env_name('advertise_url')}]",
        )
        p.add_argument(
            "--replication-log-bytes",
            dest="replication_log_bytes",
            metavar="SIZE",
            help=f"bytes of the replication log kept in memory for backups that lag; a backup "
            f"further behind catches up from a snapshot [{env_name('replication_log_bytes')}, "
            f"default 256MiB]",
        )
        p.add_argument(
            "--replica-timeout",
            dest="replica_timeout",
            metavar="SECONDS",
            help=f"a primary whose backup has not applied a write within this time drops it "
            f"from the backups it waits for, and answers without it; the backup rejoins once "
            f"it has caught up [{env_name('replica_timeout')}, default 5]",
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
    if fleet:
        p.add_argument(
            "--etcd",
            dest="etcd",
            metavar="URL,...",
            help=f"etcd's client URLs: the replicas of this shard index (--replica-group) "
            f"elect their primary there, and a backup takes over when the primary's lease "
            f"ends [{env_name('etcd')}, default: none, the group's first URL is primary]",
        )
        p.add_argument(
            "--etcd-prefix",
            dest="etcd_prefix",
            metavar="PREFIX",
            help=f"where this fleet's keys live in etcd (one prefix per fleet) "
            f"[{env_name('etcd_prefix')}, default /paramshard]",
        )
        p.add_argument(
            "--lease-ttl",
            dest="lease_ttl",
            metavar="SECONDS",
            help=f"seconds of the primary's lease in etcd: a failover takes about this long; "
            f"etcd raises it to its minimum (2 with its default election timeout) "
            f"[{env_name('lease_ttl')}, default 2]",
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
        "pushes/s, pulls/s, last snapshot's age, auth mode, health; a shard index listed as a "
        "replica group (a0|b0) gets a row per replica with its role, epoch, lsn, and its lag "
        "and in-sync state as the group's primary says them. Exit 0 when all are up, in fleet "
        "order and every group has its primary, else 1 (with --watch: in the last table).",
    )
    p.add_argument(
        "--shards",
        metavar="URL,URL,...",
        help=f"the fleet's shard URLs in order, the replicas of one index joined by | "
        f"(a0|b0,a1|b1) [{wire.ENV_SHARDS}]",
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
        "counter's value among them); an index listed as a replica group (a0|b0) is read "
        "through its primary, and each replica's role, epoch and lag are printed after. "
        "Sends PARAMSHARD_TOKEN when set. Exit 0 when found, else say why and exit 1.",
    )
    p.add_argument("name", metavar="NAME", help="the variable's name")
    p.add_argument(
        "--shards",
        metavar="URL,URL,...",
        help=f"the fleet's shard URLs in order, the replicas of one index joined by | "
        f"(a0|b0,a1|b1) [{wire.ENV_SHARDS}]",
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
