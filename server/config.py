"""A shard's configuration: command-line flags over ``PARAMSHARD_*`` environment variables.

Every setting has a flag and an environment variable (``--num-shards`` / ``PARAMSHARD_NUM_SHARDS``);
a flag given on the command line wins. Values are cast explicitly, and a bad one raises
:class:`ConfigError` naming the flag and the variable it came from and saying what a valid value
is, so ``paramshard serve`` can exit with status 2 and one line instead of a traceback.

    config = ShardConfig.from_sources({"shard_index": "1"}, os.environ)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ENV_PREFIX", "LOG_LEVELS", "ConfigError", "ShardConfig", "parse_size"]

ENV_PREFIX = "PARAMSHARD_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_REQUEST_BYTES = 1 << 30  # 1 GiB

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting with a bad value; ``key`` is where it came from (a flag and/or an env var)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def parse_size(text: str) -> int:
    """``"4096"``, ``"64k"``, ``"16MiB"``, ``"1G"`` -> bytes (binary units). Raises ``ValueError``."""
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
            raise ValueError(f"must be in {lo}..{hi}, got {value}" if hi is not None
                             else f"must be >= {lo}, got {value}")
        return value
    return cast


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise ValueError(f"expected a byte count such as 1048576, 64k, 16MiB or 1G, got {text!r}") \
            from None
    if value < 1024:
        raise ValueError(f"must be at least 1024 bytes, got {value}")
    return value


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
    port: int = 7100
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_level: str = "info"
    access_log: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(
                f"{flag_name('shard_index')} / {env_name('shard_index')}",
                f"shard index must be in 0..{self.num_shards - 1} for a fleet of "
                f"{self.num_shards} shard(s) ({flag_name('num_shards')}), got {self.shard_index}",
            )

    @property
    def fleet(self) -> str:
        """``"<index>/<num_shards>"``, as in the ``x-paramshard-shard`` header."""
        return f"{self.shard_index}/{self.num_shards}"

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> "ShardConfig":
        """Build a config from parsed flags (field name -> value or ``None`` when not given) and
        an environment mapping (``PARAMSHARD_*`` keys). Flags win; fields set nowhere keep their
        defaults. Raises :class:`ConfigError` naming the offending key.
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
                raise ConfigError(key, str(exc)) from None
        index = values.get("shard_index", 0)
        num = values.get("num_shards", 1)
        if index >= num:
            raise ConfigError(
                keys.get("shard_index", flag_name("shard_index")),
                f"shard index must be in 0..{num - 1} for a fleet of {num} shard(s) "
                f"(set by {keys.get('num_shards', 'the default')}), got {index}",
            )
        return cls(**values)


_CASTS: dict[str, Callable[[str], Any]] = {
    "shard_index": _int(0),
    "num_shards": _int(1, 65536),
    "host": _host,
    "port": _int(1, 65535),
    "max_request_bytes": _size,
    "log_level": _log_level,
    "access_log": _bool,
}
