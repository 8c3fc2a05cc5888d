"""A client's options and their checks: :class:`Settings`, resolved by :func:`load_settings`.

Every option of :class:`~client_sdk.PSClient` and :class:`~client_sdk.AsyncPSClient` that is
not a transport: the shard URLs (a replicated index's replicas joined by ``|``,
``_replicas.py``), the worker's id and token (each falling back to its
``PARAMSHARD_*`` environment variable, named in :mod:`client_sdk.wire`), the timeouts, the
bound on background pushes and on replies. A bad value is a :class:`ConfigError` naming the
argument or the variable to fix, raised before any I/O.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from . import wire
from ._exceptions import ConfigError
from .wire import halves

__all__ = ["DEFAULT_MAX_REPLY_BYTES", "Settings", "load_settings"]

#: Default of ``max_reply_bytes``: the most a reply may take where the SDK cannot know its
#: size (values of variables it never initialised or pulled, the variables listing). A shard's
#: default request limit is the same, so a variable created through it fits.
DEFAULT_MAX_REPLY_BYTES = 1 << 30


@dataclass(frozen=True)
class Settings:
    """A client's resolved configuration (see :func:`load_settings`)."""

    shards: tuple[str, ...]
    worker_id: str
    token: str | None = None
    timeout: float = 30.0
    retry_deadline: float = 30.0
    max_inflight: int = 2
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    #: How ``https://`` shards are verified: the system's CAs (True), a CA bundle's path, or
    #: not at all (False).
    verify: bool | str = True
    #: ``None`` (float32 travels as float32) or the half precision it travels in.
    wire_dtype: str | None = None
    #: The replicas of each shard index (``shards[i]`` first); one URL for an index without
    #: backups (``_replicas.py``).
    groups: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            object.__setattr__(self, "groups", tuple((u,) for u in self.shards))


def load_settings(
    shards: Sequence[str] | str | None = None,
    worker_id: str | None = None,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    retry_deadline: float = 30.0,
    max_inflight: int = 2,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    verify: bool | str = True,
    wire_dtype: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve arguments, falling back to ``PARAMSHARD_*`` environment variables.

    Raises :class:`ConfigError` naming the argument or variable to fix.
    """
    env = os.environ if environ is None else environ
    source = "the shards argument"
    if shards is None:
        shards = env.get(wire.ENV_SHARDS, "")
        source = wire.ENV_SHARDS
    if isinstance(shards, str):
        shards = [s for s in (part.strip() for part in shards.split(",")) if s]
    try:
        shard_list = list(shards)
    except TypeError:
        raise ConfigError(f"shards must be a list of URLs, got {type(shards).__name__}") from None
    if not shard_list:
        raise ConfigError(
            'no shards configured: pass PSClient(["http://host:7100", ...]) or set '
            f"{wire.ENV_SHARDS}=http://host:7100,http://host:7101 (every shard, in "
            "--shard-index order)"
        )
    groups = tuple(_check_group(g, i, source) for i, g in enumerate(shard_list))
    seen: dict[str, int] = {}
    for i, group in enumerate(groups):
        for u in group:
            if u in seen:
                raise ConfigError(
                    f"{source} lists {u} twice (positions {seen[u]} and {i}): list each shard "
                    "once, in --shard-index order"
                )
            seen[u] = i
    urls = tuple(g[0] for g in groups)

    if worker_id is None:
        worker_id = env.get(wire.ENV_WORKER_ID) or f"{socket.gethostname()}-{os.getpid()}"
    if (
        not isinstance(worker_id, str)
        or not 0 < len(worker_id) <= 256
        or not worker_id.isprintable()
    ):
        raise ConfigError(
            f"worker_id must be 1-256 printable characters, got {worker_id!r}: pass "
            f"worker_id=... or set {wire.ENV_WORKER_ID}"
        )

    if token is None:
        token = env.get(wire.ENV_TOKEN) or None
    if isinstance(token, str) and "," in token:
        # The shards' list while a token is rotated ("OLD,NEW"): the worker sends the newest.
        listed = [t.strip() for t in token.split(",") if t.strip()]
        token = listed[-1] if listed else None
    if token is not None and (
        not isinstance(token, str) or not token.isascii() or not token.isprintable() or " " in token
    ):
        raise ConfigError(
            f"the token must be printable ASCII without spaces: check token=... or {wire.ENV_TOKEN}"
        )

    for name, value in (("timeout", timeout), ("retry_deadline", retry_deadline)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not value > 0
            or math.isnan(value)
        ):
            raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise ConfigError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    if (
        isinstance(max_reply_bytes, bool)
        or not isinstance(max_reply_bytes, int)
        or max_reply_bytes < 1
    ):
        raise ConfigError(f"max_reply_bytes must be an int >= 1 (bytes), got {max_reply_bytes!r}")
    if not isinstance(verify, (bool, str)) or verify == "":
        raise ConfigError(
            f"verify must be True (the system's CAs), False (no verification) or the path of "
            f"a CA bundle (PEM), got {verify!r}"
        )
    try:
        wire_dtype = halves.check_wire_dtype(wire_dtype)
    except wire.WireError as exc:
        raise ConfigError(exc.message) from None
    return Settings(
        urls,
        worker_id,
        token,
        float(timeout),
        float(retry_deadline),
        max_inflight,
        max_reply_bytes,
        verify,
        wire_dtype,
        groups,
    )


def _check_group(entry: Any, position: int, source: str) -> tuple[str, ...]:
    """One shard index's replicas: a URL, ``URL|URL|...``, or a list or tuple of URLs."""
    if isinstance(entry, str):
        parts: list[Any] = [p for p in (part.strip() for part in entry.split("|")) if p]
    elif isinstance(entry, (list, tuple)):
        parts = list(entry)
    else:
        parts = [entry]
    if not parts:
        raise ConfigError(
            f"position {position} of {source} names no URL: give each shard index's replicas "
            "as URL or URL|URL|..."
        )
    return tuple(_check_url(u, position, source) for u in parts)


def _check_url(url: Any, position: int, source: str) -> str:
    hint = (
        f"({source}, position {position}): use http://host:port or https://host:port "
        "(the replicas of one shard index separated by |)"
    )
    if not isinstance(url, str):
        raise ConfigError(f"shard URL {url!r} is not a string {hint}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"invalid shard URL {url!r} {hint}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"invalid port in shard URL {url!r} {hint}") from None
    if parts.query or parts.fragment:
        raise ConfigError(f"shard URL {url!r} must not have a query or fragment {hint}")
    return url.strip().rstrip("/")
