"""A shard's configuration: command-line flags over ``PARAMSHARD_*`` environment variables.

Every setting has a flag and an environment variable (``--num-shards`` / ``PARAMSHARD_NUM_SHARDS``);
a flag given on the command line wins. Values are cast explicitly, and a bad one raises
:class:`InvalidSetting` naming the flag and the variable it came from and saying what a valid
value is, so ``paramshard serve`` can exit with status 2 and one line instead of a traceback.

    config = ShardConfig.from_sources({"shard_index": "1"}, os.environ)

The shard index may be ``auto``: the trailing number of this host's name, so that every pod of a
Kubernetes StatefulSet (``paramshard-a-0``, ``paramshard-a-1``, ...) runs the same command and
env; ``{index}`` in the replica group and the advertised URL stands for the index, for the same
reason.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from client_sdk.wire import ENV_PREFIX, MAX_REQUEST_NAMES

from .tokens import read_token_file, split_tokens

__all__ = [
    "ENV_PREFIX",
    "LOG_LEVELS",
    "InvalidSetting",
    "ShardConfig",
    "index_from_hostname",
    "parse_size",
]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOG_FORMATS = ("text", "json")
#: The values of ``http`` (as :data:`server.upstream.MODES`, which needs uvicorn to import).
HTTP_MODES = ("auto", "stock")
DEFAULT_MAX_REQUEST_BYTES = 1 << 30  # 1 GiB
DEFAULT_MAX_QUEUED_BYTES = 2 << 30  # 2 GiB
_CHECKPOINT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRAILING_NUMBER = re.compile(r"(\d+)$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class InvalidSetting(ValueError):
    """A shard setting with a bad value; ``key`` is where it came from (a flag and/or an env
    var). (A worker's bad settings are the SDK's ``client_sdk.ConfigError``.)"""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def parse_size(text: str) -> int:
    """``"4096"``, ``"64k"``, ``"16MiB"``, ``"1G"`` -> bytes (binary units).

    Raises ``ValueError``."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(text)
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def cast(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError(
                f"must be in {lo}..{hi}, got {value}"
                if hi is not None
                else f"must be >= {lo}, got {value}"
            )
        return value

    return cast


def index_from_hostname(hostname: str) -> int:
    """The trailing number of a host name's first label: ``paramshard-2`` -> 2, ``ps0`` -> 0.

    That is a StatefulSet pod's ordinal. Raises ``ValueError`` saying what to do when there is
    none.
    """
    label = hostname.strip().split(".", 1)[0]
    m = _TRAILING_NUMBER.search(label)
    if m is None:
        raise ValueError(
            f"'auto' takes the index from the number at the end of this host's name (a "
            f"StatefulSet pod's ordinal, as in paramshard-2), but the host name is {hostname!r}: "
            "give the index as a number instead"
        )
    return int(m.group(1))


def _shard_index(text: str) -> int:
    if text.strip().lower() == "auto":
        return index_from_hostname(socket.gethostname())
    return _int(0)(text)


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise ValueError(
            f"expected a byte count such as 1048576, 64k, 16MiB or 1G, got {text!r}"
        ) from None
    if value < 1024:
        raise ValueError(f"must be at least 1024 bytes, got {value}")
    return value


def _size_or_off(text: str) -> int:
    """A byte count (at least 1024), or 0 for off."""
    if text.strip() == "0":
        return 0
    return _size(text)


def _host(text: str) -> str:
    text = text.strip()
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"expected a host name or IP address such as 127.0.0.1, got {text!r}")
    return text


def _log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return value


def _log_format(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"expected one of {', '.join(LOG_FORMATS)}, got {text!r}")
    return value


def _http_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in HTTP_MODES:
        raise ValueError(f"expected one of {', '.join(HTTP_MODES)}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be a finite number of seconds >= 0 (0 turns it off), got {text!r}")
    return value


def _timeout(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise ValueError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _rate(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise ValueError(
            f"expected bytes per second such as 16384, 16k or 1MiB (0: only a "
            f"body that stops entirely is cut), got {text!r}"
        ) from None


def _path(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a directory path, got an empty string")
    return text


def _file(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a file path, got an empty string")
    return text


def _checkpoint(text: str) -> str:
    text = text.strip()
    if not _CHECKPOINT_RE.fullmatch(text):
        raise ValueError(
            f"expected a checkpoint id (1-64 characters from A-Z a-z 0-9 _ -, as "
            f"ps.checkpoint() returns), got {text!r}"
        )
    return text


def _etcd_urls(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    for u in urls:
        if not u.startswith(("http://", "https://")) or any(c.isspace() for c in u):
            raise ValueError(
                f"expected etcd's client URLs, comma-separated (http://etcd:2379,...), "
                f"got {u[:80]!r}"
            )
    if not urls:
        raise ValueError("expected etcd's client URLs, comma-separated, got nothing")
    return urls


def _etcd_prefix(text: str) -> str:
    prefix = text.strip().rstrip("/")
    if not prefix.startswith("/") or not prefix[1:] or any(c.isspace() for c in prefix):
        raise ValueError(f"expected a key prefix such as /paramshard/my-job, got {text[:80]!r}")
    return prefix


def _tokens(key: str) -> Callable[[str], tuple[str, ...]]:
    def cast(text: str) -> tuple[str, ...]:
        return split_tokens(text, f"{flag_name(key)} / {env_name(key)}")

    return cast


def _urls(text: str) -> tuple[str, ...]:
    """The shards' URLs, comma-separated, in shard-index order; the replicas of one index
    joined by ``|`` (kept so: one item per index)."""
    urls = tuple(
        "|".join(r.strip().rstrip("/") for r in u.split("|")) for u in text.split(",") if u.strip()
    )
    for u in (r for item in urls for r in item.split("|")):
        if not u.startswith(("http://", "https://")) or any(c.isspace() for c in u):
            raise ValueError(
                f"expected the shards' URLs, comma-separated, in shard-index order, the "
                f"replicas of an index joined by '|' (http://a0:7100|http://b0:7100,...), got "
                f"{u[:80]!r}"
            )
    if not urls:
        raise ValueError("expected the shards' URLs, comma-separated, got nothing")
    return urls


def _url(text: str) -> str:
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
        raise ValueError(f"expected a URL such as http://host:7100, got {text[:80]!r}")
    return url


#: Settings in which ``{index}`` stands for the shard index, so that every pod of a Kubernetes
#: StatefulSet names its own replica group with one spec (docker/k8s/shards.yaml).
INDEXED = ("replica_group", "advertise_url")
INDEX_PLACEHOLDER = "{index}"


def _expand_index(value: str | tuple[str, ...], index: int) -> str | tuple[str, ...]:
    if isinstance(value, tuple):
        return tuple(v.replace(INDEX_PLACEHOLDER, str(index)) for v in value)
    return value.replace(INDEX_PLACEHOLDER, str(index))


def _replica_urls(text: str) -> tuple[str, ...]:
    """``URL|URL|...``: the replicas of one shard index, primary first."""
    urls = tuple(u.strip().rstrip("/") for u in text.split("|") if u.strip())
    for u in urls:
        if not u.startswith(("http://", "https://")) or any(c.isspace() for c in u):
            raise ValueError(
                f"expected the replicas' URLs separated by '|', primary first "
                f"(http://a:7100|http://b:7100), got {u[:80]!r}"
            )
    if len(urls) < 2:
        raise ValueError(
            f"a replica group is a primary and at least one backup (URL|URL), got {text[:160]!r}"
        )
    return urls


def tls_problem(cert: str, key: str) -> str | None:
    """Why a shard cannot serve TLS with ``cert`` and ``key`` (PEM files), or ``None``."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        return f"no such file: {exc.filename}"
    except (OSError, ssl.SSLError) as exc:
        return (
            f"cannot load the certificate {cert} with the key {key} ({exc}): give a PEM "
            "certificate chain and its unencrypted private key"
        )
    return None


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of 1/0, true/false, yes/no, on/off, got {text!r}")


@dataclass(frozen=True)
class ShardConfig:
    """Everything one shard process needs to know. Immutable; safe to share between threads."""

    shard_index: int = 0
    num_shards: int = 1
    host: str = "127.0.0.1"
    #: 0: a port the system picks (written to ``port_file``, and logged).
    port: int = 7100
    #: Where the shard writes the port it bound, once bound (how a launcher learns it).
    port_file: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_level: str = "info"
    #: ``text`` or ``json`` (one object a line: :mod:`server.logs`).
    log_format: str = "text"
    access_log: bool = False
    #: Where snapshots go; ``None``: no snapshots (state lives only in memory).
    data_dir: str | None = None
    snapshot_interval: float = 30.0
    keep_snapshots: int = 3
    #: Fleet checkpoints' snapshots kept (the newest N); 0: every one, until deleted.
    keep_checkpoints: int = 0
    #: Restore this fleet checkpoint's snapshot instead of the newest one.
    restore: str | None = None
    #: Body bytes admitted at once; 0: the larger of 2 GiB and ``max_request_bytes``.
    max_queued_bytes: int = 0
    max_queued_requests: int = 64
    #: Entries (names, variables, gradients, table rows) one request may hold in a list or map.
    max_request_names: int = MAX_REQUEST_NAMES
    #: A variable inited without ``partitions`` and bigger than this is split into parts of at
    #: most this many bytes (client_sdk.partitions); 0: never. Every client reads it from
    #: ``/v1/cluster``, so all agree on a variable's layout.
    partition_bytes: int = 0
    #: Workers whose applied seqs are remembered at most (the least recently seen forgotten).
    dedup_max_workers: int = 10_000
    #: A worker not seen for this many seconds is forgotten; 0: never.
    dedup_idle_seconds: float = 3600.0
    #: Workers with series of their own in ``/metrics`` (the most active; the rest summed).
    metrics_workers: int = 20
    #: Bounds of a connection's unfinished request (server/readguard.py).
    max_head_bytes: int = 64 * 1024
    head_timeout: float = 10.0
    body_timeout: float = 30.0
    min_body_rate: int = 16 * 1024
    #: Ids one ``pull_rows`` or ``push_rows`` request may carry (more: 413).
    max_table_ids: int = 1 << 18
    #: Rows one embedding table may hold on this shard (a push past it: 413).
    max_table_rows: int = 1 << 27
    #: Ids one embedding table counts on this shard while they wait for admission (its
    #: ``Admission.min_count``); past it, the least recently pushed are forgotten.
    max_pending_ids: int = 1 << 20
    #: Bytes of big float32 values kept narrowed for the next half-precision puller of the same
    #: version (server/narrowed.py); 0: none kept.
    half_cache_bytes: int = 256 << 20
    #: How the shard serves HTTP (:data:`server.upstream.MODES`): ``auto`` (the fast path
    #: when the installed web stack offers what it needs) or ``stock``.
    http: str = "auto"
    #: etcd's client URLs (server/replication/leadership.py): with them, the replicas of this
    #: shard index elect their primary there; empty: the static role of ``--replica-group``.
    etcd: tuple[str, ...] = ()
    #: The keys of this fleet in etcd start with it (``<prefix>/shard/<i>/primary``, ...).
    etcd_prefix: str = "/paramshard"
    #: Seconds of the primary's lease in etcd: about how long a failover takes.
    lease_ttl: int = 2
    #: Bearer tokens that allow every request, and read-only ones (:mod:`server.auth`); none:
    #: no auth. Never in the repr (a config may be logged).
    token: tuple[str, ...] = field(default=(), repr=False)
    #: A file of tokens, one a line, read again when it changes (a mounted secret).
    token_file: str | None = None
    read_token: tuple[str, ...] = field(default=(), repr=False)
    #: Every shard's URL, in shard-index order, as this shard reaches them (empty: unknown); an
    #: index served by a replica group is its replicas' URLs joined by ``|``. A
    #: ``GET /v1/variables/{name}`` for a name another shard owns is answered by asking it;
    #: ``GET /v1/fleet`` and the dashboard probe them.
    fleet_urls: tuple[str, ...] = ()
    #: TLS: the certificate chain (PEM) and its private key; both or neither.
    tls_cert: str | None = None
    tls_key: str | None = field(default=None, repr=False)
    #: The URLs of every replica of this shard index, primary first (server/replication):
    #: empty, the shard is its index's only copy. Needs ``advertise_url``.
    replica_group: tuple[str, ...] = ()
    #: This replica's own URL as the other replicas reach it (one of ``replica_group``).
    advertise_url: str | None = None
    #: Bytes of replication log kept in memory for backups that lag (older entries are let
    #: go; a backup that needs them catches up from a snapshot).
    replication_log_bytes: int = 256 << 20
    #: Seconds a primary waits for a backup to apply a write before it drops the backup from
    #: its in-sync set and answers without it.
    replica_timeout: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.shard_index < self.num_shards:
            raise InvalidSetting(
                f"{flag_name('shard_index')} / {env_name('shard_index')}",
                f"shard index must be in 0..{self.num_shards - 1} for a fleet of "
                f"{self.num_shards} shard(s) ({flag_name('num_shards')}), got {self.shard_index}",
            )
        if self.max_queued_bytes == 0:
            object.__setattr__(
                self, "max_queued_bytes", max(DEFAULT_MAX_QUEUED_BYTES, self.max_request_bytes)
            )
        if self.max_queued_bytes < self.max_request_bytes:
            raise InvalidSetting(
                f"{flag_name('max_queued_bytes')} / {env_name('max_queued_bytes')}",
                f"must be at least {flag_name('max_request_bytes')} ({self.max_request_bytes}), "
                f"or a request of the largest allowed size could never be admitted; got "
                f"{self.max_queued_bytes}",
            )
        if self.restore is not None and self.data_dir is None:
            raise InvalidSetting(
                f"{flag_name('restore')} / {env_name('restore')}",
                f"restoring a checkpoint needs {flag_name('data_dir')} (the "
                "directory holding its snapshot)",
            )

        if self.token_file is not None:
            try:
                read_token_file(self.token_file)
            except ValueError as exc:
                raise InvalidSetting(
                    f"{flag_name('token_file')} / {env_name('token_file')}", str(exc)
                ) from None
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            )
            raise InvalidSetting(
                f"{flag_name(missing)} / {env_name(missing)}",
                f"{flag_name(given)} needs {flag_name(missing)} too (the certificate and its "
                "private key, PEM files)",
            )
        if self.tls_cert is not None and self.tls_key is not None:
            problem = tls_problem(self.tls_cert, self.tls_key)
            if problem is not None:
                raise InvalidSetting(f"{flag_name('tls_cert')} / {flag_name('tls_key')}", problem)
        if self.fleet_urls and len(self.fleet_urls) != self.num_shards:
            raise InvalidSetting(
                f"{flag_name('fleet_urls')} / {env_name('fleet_urls')}",
                f"lists {len(self.fleet_urls)} URL(s) for a fleet of {self.num_shards} shard(s) "
                f"({flag_name('num_shards')}): list every shard's URL, in shard-index order",
            )
        if self.replica_group:
            if self.advertise_url is None:
                raise InvalidSetting(
                    f"{flag_name('advertise_url')} / {env_name('advertise_url')}",
                    f"{flag_name('replica_group')} needs {flag_name('advertise_url')}: this "
                    "replica's own URL, one of the group's, as the other replicas reach it",
                )
            if self.advertise_url not in self.replica_group:
                raise InvalidSetting(
                    f"{flag_name('advertise_url')} / {env_name('advertise_url')}",
                    f"{self.advertise_url} is not one of {flag_name('replica_group')}'s URLs "
                    f"({'|'.join(self.replica_group)}): give this replica's URL exactly as "
                    "the group lists it",
                )
            if len(set(self.replica_group)) != len(self.replica_group):
                raise InvalidSetting(
                    f"{flag_name('replica_group')} / {env_name('replica_group')}",
                    f"lists a URL twice ({'|'.join(self.replica_group)}): list each replica once",
                )
        if self.etcd and not self.replica_group:
            raise InvalidSetting(
                f"{flag_name('etcd')} / {env_name('etcd')}",
                f"elects a primary among the replicas of {flag_name('replica_group')}, "
                "which is not set: give every replica of this shard index (URL|URL|...) and "
                f"this one's {flag_name('advertise_url')}",
            )
        if self.read_token and not (self.token or self.token_file):
            raise InvalidSetting(
                f"{flag_name('read_token')} / {env_name('read_token')}",
                f"a read-only token needs a full one too ({flag_name('token')} or "
                f"{flag_name('token_file')}): without it every request would be allowed",
            )

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``."""
        return "https" if self.tls_cert is not None else "http"

    @property
    def fleet(self) -> str:
        """``"<index>/<num_shards>"``, as in the ``x-paramshard-shard`` header."""
        return f"{self.shard_index}/{self.num_shards}"

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> ShardConfig:
        """Build a config from parsed flags (field name -> value or ``None`` when not given) and
        an environment mapping (``PARAMSHARD_*`` keys). Flags win; fields set nowhere keep their
        defaults. Raises :class:`InvalidSetting` naming the offending key.
        """
        flags = flags or {}
        environ = environ or {}
        values: dict[str, Any] = {}
        keys: dict[str, str] = {}
        for f in fields(cls):
            cast = _CASTS[f.name]
            raw = flags.get(f.name)
            if raw is not None:
                key = flag_name(f.name)
            elif env_name(f.name) in environ:
                raw, key = environ[env_name(f.name)], env_name(f.name)
            else:
                continue
            keys[f.name] = key
            if isinstance(raw, bool):  # e.g. an argparse store_true flag
                values[f.name] = raw
                continue
            try:
                values[f.name] = cast(str(raw))
            except ValueError as exc:
                raise InvalidSetting(key, str(exc)) from None
        index = values.get("shard_index", 0)
        num = values.get("num_shards", 1)
        for name in INDEXED:  # "{index}": this shard's index (one spec for every pod of a set)
            if name in values:
                values[name] = _expand_index(values[name], index)
        if index >= num:
            key = keys.get("shard_index", flag_name("shard_index"))
            source = flags.get("shard_index") or environ.get(env_name("shard_index"), "")
            came_from = (
                f" (from the host name {socket.gethostname()!r})"
                if str(source).strip().lower() == "auto"
                else ""
            )
            raise InvalidSetting(
                key,
                f"shard index must be in 0..{num - 1} for a fleet of {num} shard(s) "
                f"(set by {keys.get('num_shards', 'the default')}), got {index}{came_from}",
            )
        return cls(**values)


_CASTS: dict[str, Callable[[str], Any]] = {
    "shard_index": _shard_index,
    "num_shards": _int(1, 65536),
    "host": _host,
    "port": _int(0, 65535),
    "port_file": _file,
    "max_request_bytes": _size,
    "log_level": _log_level,
    "log_format": _log_format,
    "access_log": _bool,
    "data_dir": _path,
    "snapshot_interval": _seconds,
    "keep_snapshots": _int(1, 1000),
    "keep_checkpoints": _int(0, 100000),
    "restore": _checkpoint,
    "max_queued_bytes": _size,
    "max_queued_requests": _int(1, 65536),
    "max_request_names": _int(1, 1_000_000),
    "partition_bytes": _size_or_off,
    "dedup_max_workers": _int(1, 10_000_000),
    "dedup_idle_seconds": _seconds,
    "metrics_workers": _int(0, 1000),
    "max_head_bytes": _size,
    "head_timeout": _timeout,
    "body_timeout": _timeout,
    "min_body_rate": _rate,
    "http": _http_mode,
    "etcd": _etcd_urls,
    "etcd_prefix": _etcd_prefix,
    "lease_ttl": _int(1, 3600),
    "token": _tokens("token"),
    "token_file": _file,
    "read_token": _tokens("read_token"),
    "fleet_urls": _urls,
    "tls_cert": _file,
    "tls_key": _file,
    "max_table_ids": _int(1, 1 << 24),
    "max_table_rows": _int(1, 1 << 40),
    "max_pending_ids": _int(16, 1 << 32),
    "half_cache_bytes": _size_or_off,
    "replica_group": _replica_urls,
    "advertise_url": _url,
    "replication_log_bytes": _size,
    "replica_timeout": _timeout,
}
