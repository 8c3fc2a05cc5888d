"""The sans-I/O core of the worker SDK: everything except sending bytes and waiting.

:class:`PSClient` and :class:`AsyncPSClient` (``client.py``) are thin shells around one
:class:`Core`. The core resolves configuration, splits a batch by shard, encodes each shard's
request body, checks the fleet on first contact, decodes and merges replies, maps error
replies to the :class:`~client_sdk.PSError` tree, keeps the version cache and numbers pushes.

Each verb is a *flow*: a generator that yields a list of :class:`ShardRequest` (one per shard,
to be sent concurrently) and is sent back, in the same order, a list holding for each request
either a :class:`Reply` or the :class:`PSError` that prevented one. The generator's return value
is the verb's result. The sync shell drives a flow with threads, the async shell with
``asyncio.gather``; neither knows anything about the protocol. The retry policy
(:meth:`Core.retry_delay`) is decided here too, so both shells retry alike.

Every write (push, assign, increment) carries this worker's id and a ``seq`` from one counter per
worker; the shard applies each seq once and answers a repeat ``"duplicate"``. So writes, like
reads, are retried after *any* transport failure (the body, seq included, is sent again as it
was), and after 429/503, with exponential backoff and jitter, until the call's deadline.

When a shard's incarnation changes (it restarted), the core logs one warning naming the shard and
the state version it came back at, drops the values it cached from that shard, and carries on.

The core is thread-safe: its shared state (fleet checks, incarnations, version cache, push
sequence numbers) is guarded by one lock that is never held across I/O.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union
from urllib.parse import urlsplit

import numpy as np

from . import wire
from ._exceptions import (
    BadRequestError,
    BadTensorError,
    ConfigError,
    FleetMismatchError,
    NotReadyError,
    OverloadedError,
    ProtocolError,
    PSError,
    ShardUnavailableError,
    error_for_status,
)
from .optimizers import Optimizer
from .placement import shard_for, validate_name

__all__ = [
    "Core",
    "Flow",
    "PushJob",
    "Reply",
    "Settings",
    "ShardRequest",
    "as_array",
    "load_settings",
]

#: What every data-plane request accepts back: framed bodies for big tensors, msgpack otherwise.
ACCEPT = f"{wire.FRAME}, {wire.MSGPACK}"
#: Most names whose validation and placement a core remembers (then it starts over).
PLACEMENT_CACHE = 1 << 20
#: The shard's own long-poll limit is 30 s; poll in shorter rounds so progress is visible.
WAIT_POLL_SECONDS = 10.0
#: Extra read time for a long-poll beyond the time the shard was asked to hold it.
WAIT_READ_SLACK = 10.0
#: The longest a fleet checkpoint may take (a shard's pause lease is at most 600 s).
MAX_CHECKPOINT_SECONDS = 570.0
#: Default of ``max_reply_bytes``: the most a reply may take where the SDK cannot know its
#: size (values of variables it never initialised or pulled, the variables listing). A shard's
#: default request limit is the same, so a variable created through it fits.
DEFAULT_MAX_REPLY_BYTES = 1 << 30
#: A reply's room beyond its values: the message (names, versions, dtypes, shapes, offsets,
#: an error's details), a fixed part and a part per variable named in the request.
REPLY_HEADROOM = 64 * 1024
REPLY_PER_NAME = 2048
#: Verbs whose replies carry no tensors: bounded by the headroom alone.
_SMALL_REPLIES = frozenset({"init", "push", "assign", "increment", "wait"})

logger = logging.getLogger("client_sdk")

T = TypeVar("T")
Result = Union["Reply", PSError]
#: A whole reply body: bytes, or a view of the buffer it was read into.
Body = bytes | bytearray | memoryview
#: A verb: yields batches of requests, receives their results, returns the verb's result.
Flow = Generator[list["ShardRequest"], list[Result], T]


# -- configuration ---------------------------------------------------------------------------


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


def load_settings(
    shards: Sequence[str] | str | None = None,
    worker_id: str | None = None,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    retry_deadline: float = 30.0,
    max_inflight: int = 2,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
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
    urls = tuple(_check_url(u, i, source) for i, u in enumerate(shard_list))
    seen: dict[str, int] = {}
    for i, u in enumerate(urls):
        if u in seen:
            raise ConfigError(
                f"{source} lists {u} twice (positions {seen[u]} and {i}): list each shard once, "
                "in --shard-index order"
            )
        seen[u] = i

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
    return Settings(
        urls, worker_id, token, float(timeout), float(retry_deadline), max_inflight, max_reply_bytes
    )


def _check_url(url: Any, position: int, source: str) -> str:
    hint = f"({source}, position {position}): use http://host:port or https://host:port"
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


# -- requests and replies --------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRequest:
    """One HTTP request to shard ``shard``, as the shells send it.

    ``mutating`` requests change state; unless ``retry_safe`` (the shard applies a repeat at
    most once: writes with a seq, init) they are retried only when they certainly did not
    reach the shard. ``deadline`` (``time.monotonic()`` seconds) bounds the call: no retry
    starts or runs past it. ``timeout`` replaces the client's ``timeout`` for each attempt
    (long polls, checkpoints: they plan their own time, and their attempts may end past
    ``deadline``). ``max_reply`` bounds the reply's body (bytes; the core sets it: see
    :meth:`Core._pull_bound`, :meth:`Core._post`).
    """

    shard: int
    method: str
    path: str
    headers: Mapping[str, str]
    body: wire.Encoded | None
    mutating: bool
    deadline: float
    verb: str
    names: tuple[str, ...] = ()
    timeout: float | None = None
    retry_safe: bool = False
    max_reply: int | None = None


@dataclass
class Reply:
    """A shard's answer: status, headers with lower-case names, and the whole body."""

    status: int
    headers: Mapping[str, str]
    content: Body


@dataclass
class _Message:
    """A decoded reply: the message and the body its framed tensors point into."""

    msg: Any
    body: Body
    incarnation: str | None


#: A pulled value as the cache keeps it: ``(shard incarnation, version, value)``. A plain tuple:
#: a pull of many variables makes one per variable, and a tuple is the cheapest record to make.
_Cached = tuple[str | None, int, np.ndarray]
#: What a pull holds of one shard's names: cache entries parallel to them (or None), and the
#: cache's write count when they were read (see Core._cached).
Held = tuple[list[_Cached | None] | None, int | None]
_NOT_HELD: Held = (None, None)
#: Lists of names whose pull plans are kept (all dropped when full).
_MAX_PLANS = 64


# -- sequence numbers ------------------------------------------------------------------------

_SEQ_LOCK = threading.Lock()
_SEQS: dict[str, Iterator[int]] = {}


def _seq_counter(worker_id: str) -> Iterator[int]:
    """One counter per worker id and process, starting at the current time in microseconds,
    so a worker restarted under the same id never reuses a sequence number."""
    with _SEQ_LOCK:
        counter = _SEQS.get(worker_id)
        if counter is None:
            counter = _SEQS[worker_id] = itertools.count(time.time_ns() // 1000)
        return counter


# -- the core ----------------------------------------------------------------------------------


@dataclass
class PushJob:
    """A push prepared in the caller's thread: converted gradients, versions and ``seq``."""

    grads: dict[str, np.ndarray]
    versions: dict[str, int]
    seq: int


class Core:
    """Protocol logic shared by :class:`PSClient` and :class:`AsyncPSClient`. Thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.shards = settings.shards
        self.n = len(settings.shards)
        self._lock = threading.Lock()
        self._checked = [False] * self.n
        #: Per shard: whether its verbs take tensor tables (its /v1/cluster lists the feature),
        #: and uniform ones with packed rows.
        self._tables = [False] * self.n
        #: Entries one request to each shard may hold (its ``max_request_names``).
        self._max_names = [wire.MAX_REQUEST_NAMES] * self.n
        self._packed = [False] * self.n
        self._incarnation: list[str | None] = [None] * self.n
        #: Per shard: the last state version seen, and (old incarnation, that version) while
        #: a restart is noticed but not yet reported.
        self._state_version: list[int | None] = [None] * self.n
        self._restarted: dict[int, tuple[str, int | None]] = {}
        self._cache: dict[str, _Cached] = {}
        #: +1 on every change of ``_cache`` (under the lock): a pull whose reply finds it
        #: where it was when the versions asked for were read may cache without comparing.
        self._writes = 0
        #: tuple of names -> a pull's (checked names, names per shard); see _pull_plan.
        self._plans: dict[tuple[str, ...], tuple[list[str], dict[int, list[str]]]] = {}
        self._seq = _seq_counter(settings.worker_id)
        #: name -> (shape, dtype) of variables this client initialised (what it knows of those
        #: it never pulled); dropped with the cache of their shard when it restarts.
        self._known: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        #: tuple of a pull's names for one shard -> the most bytes its reply can take, for
        #: lists whose sizes are all known (see _pull_bound).
        self._bounds: dict[tuple[str, ...], int] = {}
        #: name -> owning shard, for names already validated and placed (see _place)
        self._placed: dict[str, int] = {}
        base = {"accept": ACCEPT, "accept-encoding": "identity"}
        if settings.token:
            base["authorization"] = f"Bearer {settings.token}"
        self._base_headers = base
        self._data_headers = [{**base, wire.HEADER_FLEET: f"{i}/{self.n}"} for i in range(self.n)]

    # -- retry policy ------------------------------------------------------------------

    def retry_delay(
        self,
        request: ShardRequest,
        attempt: int,
        *,
        unsent: bool = False,
        status: int | None = None,
        retry_after: str | None = None,
    ) -> float | None:
        """Seconds to wait before retrying ``request``, or ``None`` to give up.

        A reply with status 429/503 is always retryable (the shard changed nothing). A transport
        failure (connection refused or lost, timeout) is retryable for read-only and retry-safe
        requests, and for other mutating ones only when ``unsent`` (the request certainly never
        reached the shard). Backoff is exponential with jitter and ``Retry-After`` is honoured;
        a retry that could not start before the request's deadline is not made (an attempt may
        not run past it: :func:`client_sdk._transport.attempt_deadline`).
        """
        if status is not None:
            if status not in (429, 503):
                return None
        elif request.mutating and not request.retry_safe and not unsent:
            return None
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            return None
        backoff = min(1.0, 0.05 * (2 ** min(attempt, 10)))
        delay = backoff / 2 + random.uniform(0, backoff / 2)
        hinted = _parse_retry_after(retry_after)
        if hinted is not None:
            delay = max(delay, hinted)
        return delay if delay < remaining else None

    # -- helpers -----------------------------------------------------------------------

    def url(self, shard: int) -> str:
        return self.shards[shard]

    def deadline(self, seconds: float | None = None) -> float:
        seconds = self.settings.retry_deadline if seconds is None else seconds
        return time.monotonic() + seconds

    #: Verbs whose requests carry tensors (the others are packed without looking for any).
    _TENSOR_VERBS = frozenset({"init", "push", "assign"})

    def _post(
        self,
        shard: int,
        verb: str,
        msg: Any,
        deadline: float,
        *,
        mutating: bool,
        names: Iterable[str] = (),
        timeout: float | None = None,
        retry_safe: bool = False,
        table: dict[str, Any] | None = None,
        arrays: list[np.ndarray] | None = None,
        max_reply: int | None = None,
    ) -> ShardRequest:
        """A POST of ``msg``; with ``table`` (a map inside ``msg``) and ``arrays``, encoded as
        a framed body whose tensor table ``table`` holds ``arrays`` (where the shard takes it,
        arrays of one dtype and shape as a packed uniform table: docs/PROTOCOL.md §2). Its
        reply is bounded by ``max_reply``, by default: the headroom and the room for its names
        for a verb that returns no tensors, the headroom and ``max_reply_bytes`` otherwise."""
        try:
            if table is not None:
                assert arrays is not None, "a table comes with its arrays"
                packed = self._packed[shard]
                body = wire.encode_table(msg, table, arrays, uniform=packed, packed=packed)
            else:
                body = wire.encode(msg, tensors=verb in self._TENSOR_VERBS)
        except wire.WireError as exc:
            raise BadTensorError(
                f"cannot encode the {verb} request: {exc.message}",
                code=exc.code,
                details=exc.details,
            ) from exc
        names = tuple(names)
        if max_reply is None:
            max_reply = REPLY_HEADROOM + (
                REPLY_PER_NAME * len(names)
                if verb in _SMALL_REPLIES
                else self.settings.max_reply_bytes
            )
        return ShardRequest(
            shard,
            "POST",
            f"/v1/{verb}",
            self._data_headers[shard],
            body,
            mutating,
            deadline,
            verb,
            names,
            timeout,
            retry_safe,
            max_reply,
        )

    def next_seq(self) -> int:
        """A new sequence number for one write of this worker."""
        with _SEQ_LOCK:
            return next(self._seq)

    def _get(self, shard: int, path: str, deadline: float, verb: str) -> ShardRequest:
        return ShardRequest(
            shard,
            "GET",
            path,
            self._base_headers,
            None,
            False,
            deadline,
            verb,
            max_reply=REPLY_HEADROOM + self.settings.max_reply_bytes,
        )

    def split(self, names: Iterable[str]) -> dict[int, list[str]]:
        """Group names by owning shard, in shard order."""
        if self.n == 1:
            every = list(names)
            return {0: every} if every else {}
        placed = self._placed
        out: dict[int, list[str]] = {}
        for name in names:
            shard = placed.get(name)
            if shard is None:
                shard = self._place(name)
            group = out.get(shard)
            if group is None:
                out[shard] = [name]
            else:
                group.append(name)
        return dict(sorted(out.items()))

    def chunks(self, groups: Mapping[int, list[str]]) -> list[tuple[int, list[str]]]:
        """``(shard, names)`` per request: each shard's names in runs of at most the
        entries one request to it may hold (``max_request_names``, docs/PROTOCOL.md Limits)."""
        out = []
        for shard, names in groups.items():
            size = self._max_names[shard]
            if len(names) <= size:
                out.append((shard, names))
            else:
                out += [(shard, names[i : i + size]) for i in range(0, len(names), size)]
        return out

    def _place(self, name: str) -> int:
        """Validate ``name`` and remember its shard (a worker uses the same names each step,
        so hashing and validating them once is enough)."""
        shard = shard_for(_name(name), self.n)
        if len(self._placed) >= PLACEMENT_CACHE:
            self._placed.clear()
        self._placed[name] = shard
        return shard

    # -- replies ------------------------------------------------------------------------

    def _accept(self, request: ShardRequest, result: Result) -> _Message:
        """Check one result and decode it; raise the mapped PSError for a failure."""
        if isinstance(result, PSError):
            raise result
        url = self.url(request.shard)
        headers = result.headers
        self._check_identity(request.shard, headers)
        incarnation = headers.get(wire.HEADER_INCARNATION.lower())
        self._note_incarnation(
            request.shard, incarnation, headers.get(wire.HEADER_STATE_VERSION.lower())
        )
        ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
        msg: Any = None
        try:
            if ctype in (wire.MSGPACK, wire.FRAME):
                msg = wire.unpack(result.content, ctype)
            elif ctype == wire.JSON or ctype.endswith("+json"):
                msg = json.loads(bytes(result.content))
            elif result.status < 400:
                raise ProtocolError(
                    f"shard {url} answered {request.verb} with content type {ctype or 'none'!r}: "
                    "is this URL a paramshard shard?",
                    shard=url,
                    status=result.status,
                )
        except (wire.WireError, ValueError) as exc:
            if result.status < 400:
                raise ProtocolError(
                    f"shard {url} sent a {request.verb} reply the SDK cannot decode: {exc}",
                    shard=url,
                    status=result.status,
                ) from exc
            msg = None
        if result.status >= 400:
            raise self._error(request, result.status, msg, headers)
        if not isinstance(msg, Mapping):
            raise ProtocolError(
                f"shard {url} sent a {request.verb} reply that is not a map",
                shard=url,
                status=result.status,
            )
        return _Message(msg, result.content, incarnation)

    def _check_identity(self, shard: int, headers: Mapping[str, str]) -> None:
        url = self.url(shard)
        protocol = headers.get(wire.HEADER_PROTOCOL.lower())
        if protocol is not None and protocol.strip() != str(wire.PROTOCOL_VERSION):
            raise ProtocolError(
                f"shard {url} speaks protocol version {protocol}, this SDK speaks "
                f"{wire.PROTOCOL_VERSION}: run the same paramshard version on workers and shards",
                shard=url,
            )
        ident = headers.get(wire.HEADER_SHARD.lower())
        if ident is not None and ident.strip() != f"{shard}/{self.n}":
            index, _, total = ident.strip().partition("/")
            raise FleetMismatchError(
                _mismatch_message(url, shard, self.n, index, total),
                shard=url,
                code="fleet_mismatch",
            )

    def _note_incarnation(
        self, shard: int, incarnation: str | None, state_version: str | None = None
    ) -> None:
        """Track the shard's incarnation and state version; on a restart drop what was cached
        from it, check the fleet again before the next call, and log one warning once the
        restarted shard has said which state version it came back at."""
        if incarnation is None:
            return
        version = int(state_version) if state_version and state_version.isdigit() else None
        report = None
        with self._lock:
            known = self._incarnation[shard]
            if known != incarnation:
                self._incarnation[shard] = incarnation
                if known is not None:
                    self._checked[shard] = False
                    self._restarted[shard] = (known, self._state_version[shard])
                    self._drop_cached(shard)
                self._state_version[shard] = None
            if version is not None:
                self._state_version[shard] = version
                if shard in self._restarted:
                    report = self._restarted.pop(shard)
        if report is not None and version is not None:  # a report waits for the version
            old, last_seen = report
            seen = "" if last_seen is None else f"; this client last saw it at {last_seen}"
            lost = (
                ""
                if last_seen is None or last_seen <= version
                else f", so up to {last_seen - version} update(s) since its last snapshot were lost"
            )
            logger.warning(
                "shard %d (%s) restarted (incarnation %s -> %s) and came back at state version "
                "%d%s%s; dropped the values cached from it and carrying on",
                shard,
                self.url(shard),
                old,
                incarnation,
                version,
                seen,
                lost,
            )

    def _drop_cached(self, shard: int) -> None:
        """Forget cached values, and the shapes initialised, of variables placed on ``shard``
        (hold the lock)."""
        for name in [k for k in self._cache if shard_for(k, self.n) == shard]:
            del self._cache[name]
        for name in [k for k in self._known if shard_for(k, self.n) == shard]:
            del self._known[name]
        self._bounds.clear()
        self._writes += 1

    def _error(
        self, request: ShardRequest, status: int, msg: Any, headers: Mapping[str, str]
    ) -> PSError:
        url = self.url(request.shard)
        err = msg.get("error") if isinstance(msg, Mapping) else None
        if isinstance(err, Mapping):
            code = err.get("code") if isinstance(err.get("code"), str) else None
            message = str(err.get("message") or "")
            details = dict(err["details"]) if isinstance(err.get("details"), Mapping) else {}
        else:
            code, message, details = None, "", {}
        cls = error_for_status(status)
        if not message:
            message = (
                f"HTTP {status} without a paramshard error body: is {url} a paramshard "
                "shard, and the URL right?"
            )
            if wire.HEADER_PROTOCOL.lower() not in headers and status not in (429, 502, 503, 504):
                # Not a shard at all (another service on that port, a wrong path prefix...).
                return ProtocolError(f"{request.verb}: {message}", shard=url, status=status)
        if status == 421:
            owners = details.get("owners")
            hint = (
                "the PARAMSHARD_SHARDS order (or the shards argument) must match each "
                "shard's --shard-index, and list every shard"
            )
            where = f"shard {url} (listed at position {request.shard} of {self.n})"
            message = f"{where} refused {request.verb}: {message}"
            if isinstance(owners, Mapping) and owners:
                message += f" (owners by shard index: {dict(owners)})"
            message += f"; {hint}"
            with self._lock:
                self._checked[request.shard] = False
        elif status in (429, 503):
            cls = OverloadedError if status == 429 else ShardUnavailableError
            message = (
                f"shard {url} kept answering {status} ({message}) until the retry "
                f"deadline, so the {request.verb} was not applied: slow down, add "
                "shards, or raise retry_deadline"
            )
        else:
            message = f"{request.verb} refused by shard {url} (HTTP {status}): {message}"
        return cls(message, shard=url, status=status, code=code, details=details)

    def _collect(self, batch: list[ShardRequest], results: list[Result]) -> list[_Message]:
        """Accept every result; if any failed, raise the first failure (by shard order),
        saying on which shards a mutating call was nevertheless applied."""
        out: list[_Message | None] = []
        failure: PSError | None = None
        for request, result in zip(batch, results):
            try:
                out.append(self._accept(request, result))
            except PSError as exc:
                out.append(None)
                if failure is None:
                    failure = exc
        if failure is not None:
            done = [self.url(r.shard) for r, m in zip(batch, out) if m is not None]
            if batch[0].mutating and done:
                note = f" (the {batch[0].verb} was nevertheless applied on {', '.join(done)})"
                failure.message += note
                failure.args = (failure.message,)
                failure.details.setdefault("applied_on", done)
            raise failure
        return [m for m in out if m is not None]

    # -- fleet check -----------------------------------------------------------------------

    def _check_fleet(
        self, deadline: float
    ) -> Generator[list[ShardRequest], list[Result], dict[int, PSError]]:
        """Check ``GET /v1/cluster`` of every shard not checked yet.

        Returns the shards that could not be reached (with why); raises
        :class:`FleetMismatchError` or :class:`ProtocolError` for a shard that answers but
        disagrees with this client's list.
        """
        with self._lock:
            todo = [i for i in range(self.n) if not self._checked[i]]
        if not todo:
            return {}
        batch = [self._get(i, "/v1/cluster", deadline, "cluster") for i in todo]
        results = yield batch
        unreachable: dict[int, PSError] = {}
        mismatch: PSError | None = None
        for request, result in zip(batch, results):
            if isinstance(result, ShardUnavailableError):
                unreachable[request.shard] = result
                continue
            try:
                info = self._accept(request, result).msg
                self._check_cluster(request.shard, info)
            except ShardUnavailableError as exc:  # 503 until the deadline
                unreachable[request.shard] = exc
                continue
            except (FleetMismatchError, ProtocolError) as exc:
                mismatch = mismatch or exc
                continue
            with self._lock:
                self._checked[request.shard] = True
        if mismatch is not None:
            raise mismatch
        return unreachable

    def _check_cluster(self, shard: int, info: Mapping[str, Any]) -> None:
        url = self.url(shard)
        index, total = info.get("shard_index"), info.get("num_shards")
        if not isinstance(index, int) or not isinstance(total, int):
            raise ProtocolError(
                f"GET {url}/v1/cluster has no shard_index/num_shards: is this URL "
                "a paramshard shard?",
                shard=url,
            )
        protocol = info.get("protocol_version")
        if protocol is not None and protocol != wire.PROTOCOL_VERSION:
            raise ProtocolError(
                f"shard {url} speaks protocol version {protocol}, this SDK speaks "
                f"{wire.PROTOCOL_VERSION}: run the same paramshard version on workers and shards",
                shard=url,
            )
        if index != shard or total != self.n:
            raise FleetMismatchError(
                _mismatch_message(url, shard, self.n, index, total),
                shard=url,
                code="fleet_mismatch",
                details={"shard_index": index, "num_shards": total},
            )
        features = info.get("features")
        if not isinstance(features, list):
            features = []
        self._tables[shard] = wire.FEATURE_TABLES in features
        self._packed[shard] = self._tables[shard] and wire.FEATURE_PACKED in features
        limit = info.get("max_request_names")
        if type(limit) is int and limit > 0:
            self._max_names[shard] = limit
        incarnation = info.get("incarnation")
        if isinstance(incarnation, str):
            self._note_incarnation(shard, incarnation)

    def _ready(self, deadline: float) -> Generator[list[ShardRequest], list[Result], None]:
        """The fleet check every data call starts with; raises for an unreachable shard."""
        unreachable = yield from self._check_fleet(deadline)
        if unreachable:
            raise unreachable[min(unreachable)]

    # -- argument checks ---------------------------------------------------------------------

    def names(self, names: Any, verb: str) -> list[str]:
        """Validate a list of names (duplicates dropped, order kept)."""
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise BadRequestError(
                f"{verb} takes a list of variable names, e.g. "
                f"{verb}(['w', 'b']); got {type(names).__name__} {names!r:.80}"
            )
        try:
            out = list(dict.fromkeys(names))
        except TypeError:  # an unhashable item, e.g. a list: say which
            for name in names:
                _name(name)
            raise
        placed = self._placed
        for name in out:
            if name not in placed:
                self._place(name)
        return out

    def arrays(self, values: Any, verb: str, *, copy: bool = False) -> dict[str, np.ndarray]:
        """Validate ``{name: array-like}`` and convert each value to a sendable ndarray."""
        if not isinstance(values, Mapping):
            raise BadRequestError(
                f"{verb} takes a dict of name -> array, e.g. "
                f"{verb}({{'w': w}}); got {type(values).__name__}"
            )
        placed = self._placed
        out = {}
        for k, v in values.items():
            if k not in placed:
                self._place(k)
            out[k] = as_array(k, v, copy=copy)
        return out

    # -- verbs -------------------------------------------------------------------------------

    def init(self, values: Any, optimizer: Any = None) -> Flow[dict[str, dict[str, Any]]]:
        arrays = self.arrays(values, "init")
        specs = _optimizers(optimizer, arrays)
        if not arrays:
            return {}
        deadline = self.deadline()
        yield from self._ready(deadline)
        batch = []
        for shard, names in self.chunks(self.split(arrays)):
            variables = {}
            for name in names:
                entry: dict[str, Any] = {"value": arrays[name]}
                if specs.get(name) is not None:
                    entry["optimizer"] = specs[name]
                variables[name] = entry
            batch.append(
                self._post(
                    shard,
                    "init",
                    {"variables": variables},
                    deadline,
                    mutating=True,
                    names=names,
                    retry_safe=True,
                )
            )
        replies = self._collect(batch, (yield batch))
        out = self._per_variable(batch, replies, "variables")
        with self._lock:  # the shards hold these shapes and dtypes now (else: 409)
            known = self._known
            if len(known) + len(arrays) > PLACEMENT_CACHE:
                known.clear()
            known.update((name, (a.shape, a.dtype)) for name, a in arrays.items())
        return out

    def pull(self, names: Any) -> Flow[dict[str, np.ndarray]]:
        names, groups = self._pull_plan(names)
        if not names:
            return {}
        deadline = self.deadline()
        yield from self._ready(deadline)
        out: dict[str, np.ndarray] = {}
        for use_cache in (True, False):
            batch, held = [], []
            for shard, group in self.chunks(groups):
                msg: dict[str, Any] = {
                    "names": group,
                    "layout": "table",
                    "uniform": True,
                    "packed": True,
                }
                if use_cache:
                    entries, writes = self._cached(shard, group)
                    held.append((entries, writes))
                    if entries is not None:
                        if self._tables[shard]:  # a list parallel to "names" (tables' form)
                            msg["versions"] = [c[1] if c is not None else None for c in entries]
                        else:
                            msg["versions"] = {
                                k: c[1] for k, c in zip(group, entries) if c is not None
                            }
                batch.append(
                    self._post(
                        shard,
                        "pull",
                        msg,
                        deadline,
                        mutating=False,
                        names=group,
                        max_reply=self._pull_bound(group),
                    )
                )
            replies = self._collect(batch, (yield batch))
            todo: list[str] = []
            for i, (request, reply) in enumerate(zip(batch, replies)):
                todo += self._take_pulled(request, reply, held[i] if held else _NOT_HELD, out)
            if not todo:
                break
            groups = self.split(todo)
        if todo:  # pragma: no cover - a shard that omits values it was not asked to keep
            raise ProtocolError(f"shards did not send the values of {todo}")
        if list(out) == names:
            return out  # already in the caller's order (one shard, one round)
        return {name: out[name] for name in names}

    def _pull_plan(self, names: Any) -> tuple[list[str], dict[int, list[str]]]:
        """A pull's checked names (:meth:`names`) and those names per shard (:meth:`split`),
        kept per list of names: a training loop pulls the same list step after step."""
        key = None
        if type(names) is list or type(names) is tuple:
            try:
                key = tuple(names)
                plan = self._plans.get(key)
            except TypeError:  # an unhashable item: names() says what is wrong with it
                key = plan = None
            if plan is not None:
                return plan
        checked = self.names(names, "pull")
        plan = (checked, self.split(checked))
        if key is not None:
            plans = self._plans
            if len(plans) >= _MAX_PLANS:
                plans.clear()
            plans[key] = plan
        return plan

    def _pull_bound(self, names: list[str]) -> int:
        """The most bytes a pull reply for ``names`` (one shard's) can take: the headroom, the
        size of each value this client knows (from its cache, or its init) and the room per
        name; plus ``max_reply_bytes`` once for all those of unknown size."""
        key = tuple(names)
        bound = self._bounds.get(key)
        if bound is not None:
            return bound
        bound = REPLY_HEADROOM + REPLY_PER_NAME * len(names)
        unknown = False
        with self._lock:
            cache, known = self._cache, self._known
            for name in names:
                cached = cache.get(name)
                if cached is not None:
                    bound += cached[2].nbytes
                elif (shape_dtype := known.get(name)) is not None:
                    shape, dtype = shape_dtype
                    bound += math.prod(shape) * dtype.itemsize
                else:
                    unknown = True
            if not unknown:
                if len(self._bounds) >= _MAX_PLANS:
                    self._bounds.clear()
                self._bounds[key] = bound
        return bound + self.settings.max_reply_bytes if unknown else bound

    def _cached(self, shard: int, names: list[str]) -> Held:
        """What the cache holds of ``names`` from the shard's current incarnation: a list
        parallel to ``names`` (``None`` where nothing; ``None`` for the whole list when it
        holds none of them), and :attr:`_writes` when it was read."""
        with self._lock:
            incarnation = self._incarnation[shard]
            get = self._cache.get
            entries = [
                c if (c := get(k)) is not None and c[0] == incarnation else None for k in names
            ]
            writes = self._writes
        return (None if entries.count(None) == len(entries) else entries), writes

    def _take_pulled(
        self, request: ShardRequest, reply: _Message, held: Held, out: dict[str, np.ndarray]
    ) -> list[str]:
        """Decode one shard's pull reply into ``out``; return names to pull again without
        versions (their cached value came from another incarnation of the shard)."""
        url = self.url(request.shard)
        # Arrays decoded from a read-only view of the body are read-only themselves.
        body = reply.body
        if isinstance(body, (bytearray, memoryview)):
            body = memoryview(body).toreadonly()
        table = reply.msg.get("table")
        if table is not None:
            return self._take_table(request, reply, table, body, held, out)
        variables = reply.msg.get("variables")
        if not isinstance(variables, Mapping):
            raise ProtocolError(f"shard {url} sent a pull reply without 'variables'", shard=url)
        again = []
        fresh = []
        entries = held[0]
        held_of = dict(zip(request.names, entries)) if entries is not None else {}
        for name in request.names:
            entry: Any = variables.get(name)  # a dict wherever version is an int
            version = entry.get("version") if isinstance(entry, dict) else None
            if type(version) is not int:
                raise ProtocolError(
                    f"shard {url} sent no version for {name!r} in a pull reply", shard=url
                )
            value = entry.get("value")
            if value is None:
                cached = held_of.get(name)
                if cached is None or cached[1] != version or cached[0] != reply.incarnation:
                    again.append(name)
                else:
                    out[name] = cached[2]
                continue
            array = wire.framed_view(value, body) if type(value) is dict else None
            if array is None or not array.dtype.isnative:
                array = self._tensor(url, name, value, body)
            out[name] = array
            fresh.append((name, (reply.incarnation, version, array)))
        self._remember([n for n, _ in fresh], [e for _, e in fresh])
        return again

    def _take_table(
        self,
        request: ShardRequest,
        reply: _Message,
        table: Any,
        body: Body,
        held: Held,
        out: dict[str, np.ndarray],
    ) -> list[str]:
        """:meth:`_take_pulled` for a reply in the table layout (docs/PROTOCOL.md, pull)."""
        url = self.url(request.shard)
        asked = list(request.names)
        try:
            names, values = wire.table_rows(table, body, native=True, names=asked)
        except wire.WireError as exc:
            raise ProtocolError(
                f"shard {url} sent a bad pull table: {exc.message}", shard=url
            ) from exc
        versions = table.get("versions")
        if (
            type(versions) is not list
            or len(versions) != len(names)
            or (names is not asked and names != asked)
        ):
            raise ProtocolError(
                f"shard {url} sent a pull table whose names or versions do not match the request",
                shard=url,
            )
        again: list[str] = []
        incarnation = reply.incarnation
        if ("uniform" in table or table["dtype"].count(None) == 0) and set(map(type, versions)) == {
            int
        }:
            # Every row holds a value (a row has one exactly when its dtype is not nil): the
            # same as below, without a statement per row.
            out.update(zip(names, values))
            with self._lock:
                cache = self._cache
                if held[1] == self._writes:
                    # Nothing changed the cache since the versions asked for were read: each
                    # value replaces an older one of its shard's incarnation, or one of
                    # another (or none), so all of them go in without comparing.
                    cache.update(zip(names, zip(itertools.repeat(incarnation), versions, values)))
                else:
                    get = cache.get
                    cache.update(
                        {
                            name: (incarnation, version, value)
                            for name, version, value in zip(names, versions, values)
                            if (c := get(name)) is None or c[1] <= version or c[0] != incarnation
                        }
                    )
                self._writes += 1
            return again
        entries = held[0]
        held_of = dict(zip(request.names, entries)) if entries is not None else {}
        with self._lock:  # cache each fresh value, never over a newer one of this incarnation
            self._writes += 1
            cache = self._cache
            get = cache.get
            for name, version, value in zip(names, versions, values):
                if type(version) is not int:
                    raise ProtocolError(
                        f"shard {url} sent no version for {name!r} in a pull reply", shard=url
                    )
                if value is None:
                    cached = held_of.get(name)
                    if cached is None or cached[1] != version or cached[0] != incarnation:
                        again.append(name)
                    else:
                        out[name] = cached[2]
                    continue
                # Views of a read-only body (see _take_pulled) are read-only already.
                out[name] = value
                current = get(name)
                if current is None or current[1] <= version or current[0] != incarnation:
                    cache[name] = (incarnation, version, value)
        return again

    def _remember(self, names: list[str], fresh: list[_Cached]) -> None:
        """Cache freshly pulled values (``fresh[i]`` is ``names[i]``'s), never replacing a
        newer one of the same shard incarnation."""
        if not fresh:
            return
        with self._lock:
            self._writes += 1
            cache = self._cache
            get = cache.get
            for name, entry in zip(names, fresh):
                current = get(name)
                if current is None or current[1] <= entry[1] or current[0] != entry[0]:
                    cache[name] = entry

    def _tensor(self, url: str, name: str, obj: Any, body: Body) -> np.ndarray:
        try:
            value = wire.decode_tensor(obj, body)
        except wire.WireError as exc:
            raise ProtocolError(
                f"shard {url} sent a bad tensor for {name!r}: {exc.message}", shard=url
            ) from exc
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        if value.flags.writeable:
            value.flags.writeable = False
        return value

    def prepare_push(
        self, grads: Any, versions: Mapping[str, int] | None = None, *, copy: bool = False
    ) -> PushJob:
        """Convert gradients and choose versions and ``seq`` in the caller's thread.

        ``versions`` defaults to the versions this client last pulled for those names.
        ``copy`` snapshots the gradients (for pushes that run while the caller goes on).
        """
        arrays = self.arrays(grads, "push", copy=copy)
        if versions is None:
            with self._lock:
                chosen = {k: c[1] for k in arrays if (c := self._cache.get(k)) is not None}
        else:
            if not isinstance(versions, Mapping):
                raise BadRequestError("push versions must be a dict of name -> int version")
            chosen = {}
            for k, v in versions.items():
                if k in arrays:
                    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                        raise BadRequestError(
                            f"push: version of {k!r} must be an int >= 0, got {v!r}"
                        )
                    chosen[k] = int(v)
        return PushJob(arrays, chosen, self.next_seq())

    def check_push(self, job: PushJob) -> None:
        """Raise :class:`BadTensorError` for a gradient the shard is sure to refuse, as far as
        this client knows its variable (from its init or its last pull): another shape, or a
        dtype that is not a float one (or a variable that is not). Unknown variables pass."""
        with self._lock:
            cache, known = self._cache, self._known
            for name, grad in job.grads.items():
                cached = cache.get(name)
                if cached is not None:
                    shape, dtype = cached[2].shape, cached[2].dtype
                elif (shape_dtype := known.get(name)) is not None:
                    shape, dtype = shape_dtype
                else:
                    continue
                if grad.shape != shape or grad.dtype.kind != "f" or dtype.kind != "f":
                    raise BadTensorError(
                        f"push: gradient of {name!r} is {grad.dtype.str} {list(grad.shape)}, "
                        f"but the variable is {dtype.str} {list(shape)}: a gradient must have "
                        "its variable's shape and a float dtype (of a float variable)",
                        code="bad_tensor",
                        details={
                            "variable": name,
                            "shape": list(grad.shape),
                            "expected_shape": list(shape),
                        },
                    )

    def merge_push(self, into: PushJob, new: PushJob) -> None:
        """Add ``new``'s gradients into ``into`` (a push not yet sent), for coalescing. A
        variable's version becomes the older of the two, so staleness is never understated."""
        for name, grad in new.grads.items():
            have = into.grads.get(name)
            if have is None:
                into.grads[name] = grad
            elif have.shape != grad.shape:
                raise BadTensorError(
                    f"push_async(coalesce=True): gradient of {name!r} has shape "
                    f"{list(grad.shape)}, but the push it would be added to has "
                    f"{list(have.shape)}",
                    code="bad_tensor",
                    details={"variable": name},
                )
            elif have.dtype == grad.dtype:
                np.add(have, grad, out=have)
            else:
                into.grads[name] = np.add(have, grad)
            if name in new.versions:
                old = into.versions.get(name)
                into.versions[name] = (
                    new.versions[name] if old is None else min(old, new.versions[name])
                )

    def push(self, job: PushJob) -> Flow[dict[str, dict[str, Any]]]:
        if not job.grads:
            return {}
        deadline = self.deadline()
        yield from self._ready(deadline)
        batch = []
        grads = job.grads
        first = set()
        for shard, names in self.chunks(self.split(grads)):
            # A shard's further requests (a batch above its max_request_names) are writes of
            # their own, each with a seq of its own.
            seq = job.seq if shard not in first else self.next_seq()
            first.add(shard)
            msg: dict[str, Any] = {"worker_id": self.settings.worker_id, "seq": seq}
            held = job.versions
            versions = {k: held[k] for k in names if k in held} if held else None
            if versions:
                msg["versions"] = versions
            if self._tables[shard]:  # one tensor table: a fraction of the header to pack
                table = msg["grads"] = {"names": names}
                msg["layout"] = "table"
                batch.append(
                    self._post(
                        shard,
                        "push",
                        msg,
                        deadline,
                        mutating=True,
                        names=names,
                        retry_safe=True,
                        table=table,
                        arrays=[grads[k] for k in names],
                    )
                )
                continue
            msg["grads"] = {k: grads[k] for k in names}
            batch.append(
                self._post(
                    shard, "push", msg, deadline, mutating=True, names=names, retry_safe=True
                )
            )
        replies = self._collect(batch, (yield batch))
        return self._per_variable(batch, replies, "variables")

    def assign(self, values: Any) -> Flow[dict[str, dict[str, Any]]]:
        arrays = self.arrays(values, "assign")
        if not arrays:
            return {}
        deadline = self.deadline()
        yield from self._ready(deadline)
        batch = [
            self._post(
                shard,
                "assign",
                {
                    "values": {k: arrays[k] for k in names},
                    "worker_id": self.settings.worker_id,
                    "seq": self.next_seq(),
                },
                deadline,
                mutating=True,
                names=names,
                retry_safe=True,
            )
            for shard, names in self.chunks(self.split(arrays))
        ]
        replies = self._collect(batch, (yield batch))
        return self._per_variable(batch, replies, "variables")

    def increment(self, name: Any, delta: Any = 1, kind: Any = None) -> Flow[int | float]:
        _name(name)
        if isinstance(delta, np.generic):
            delta = delta.item()
        if isinstance(delta, bool) or not isinstance(delta, (int, float)):
            raise BadRequestError(f"increment delta must be an int or float, got {delta!r}")
        if isinstance(delta, float) and not math.isfinite(delta):
            raise BadRequestError(f"increment delta must be finite, got {delta!r}")
        if kind not in (None, "int", "float"):
            raise BadRequestError(f"increment kind must be 'int', 'float' or None, got {kind!r}")
        if kind == "float":
            delta = float(delta)
        elif kind == "int" and isinstance(delta, float):
            if not delta.is_integer():
                raise BadRequestError(
                    f"increment delta {delta!r} is not a whole number, but kind is 'int'"
                )
            delta = int(delta)
        if isinstance(delta, int) and not -(2**63) <= delta < 2**63:
            raise BadRequestError(f"increment delta must fit in 64 bits, got {delta!r}")
        deadline = self.deadline()
        yield from self._ready(deadline)
        msg = {
            "name": name,
            "delta": delta,
            "worker_id": self.settings.worker_id,
            "seq": self.next_seq(),
        }
        if kind is not None:
            msg["kind"] = kind
        batch = [
            self._post(
                shard_for(name, self.n),
                "increment",
                msg,
                deadline,
                mutating=True,
                names=[name],
                retry_safe=True,
            )
        ]
        (reply,) = self._collect(batch, (yield batch))
        value = reply.msg.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            url = self.url(batch[0].shard)
            raise ProtocolError(f"shard {url} sent an increment reply without a value", shard=url)
        return value

    def wait(self, names: Any, timeout: float | None) -> Flow[None]:
        names = self.names(names, "wait_ready")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or math.isnan(timeout)
            or timeout < 0
        ):
            raise BadRequestError(
                f"wait_ready timeout must be seconds >= 0 or None, got {timeout!r}"
            )
        started = time.monotonic()
        deadline = math.inf if timeout is None else started + timeout
        missing = self.split(names)
        # Unreachable shards are retried until the deadline (by the shells), so a shard
        # reported unreachable means the time is up.
        unreachable = yield from self._check_fleet(deadline)
        first = True
        while True:
            missing = {shard: group for shard, group in missing.items() if group}
            if not missing:
                return None
            remaining = deadline - time.monotonic()
            if unreachable or (remaining <= 0 and not first):
                raise self._not_ready(missing, unreachable, time.monotonic() - started)
            first = False
            poll = max(0.0, min(remaining, WAIT_POLL_SECONDS))
            batch = [
                self._post(
                    shard,
                    "wait",
                    {"names": group, "timeout": poll},
                    deadline,
                    mutating=False,
                    names=group,
                    timeout=poll + WAIT_READ_SLACK,
                )
                for shard, group in self.chunks(missing)
            ]
            results = yield batch
            missing = {}
            for request, result in zip(batch, results):
                if isinstance(result, ShardUnavailableError):
                    unreachable[request.shard] = result
                    missing.setdefault(request.shard, []).extend(request.names)
                    continue
                msg = self._accept(request, result).msg
                still = msg.get("missing")
                if not isinstance(still, list):
                    url = self.url(request.shard)
                    raise ProtocolError(
                        f"shard {url} sent a wait reply without 'missing'", shard=url
                    )
                missing.setdefault(request.shard, []).extend(n for n in still if isinstance(n, str))

    def _not_ready(
        self, missing: dict[int, list[str]], unreachable: Mapping[int, PSError], waited: float
    ) -> NotReadyError:
        names = sorted(n for group in missing.values() for n in group)
        parts = []
        for shard, group in missing.items():
            url = self.url(shard)
            if shard in unreachable:
                parts.append(f"shard {url} was not reachable ({unreachable[shard].message})")
            elif group:
                parts.append(f"{sorted(group)} missing on shard {url}")
        return NotReadyError(
            f"variables not ready after {waited:.1f}s: {'; '.join(parts)}. Make sure a worker "
            "calls init(...) for them and every shard is running, or wait longer (timeout=...)",
            missing=names,
        )

    def checkpoint(self, timeout: float) -> Flow[str]:
        """Pause writes on every shard, have each capture its state, resume, and wait until
        every snapshot is on disk; return the checkpoint's id.

        If pausing or capturing fails, every shard is told to resume (each would anyway once
        the pause's lease runs out) and the failure is raised; so is a failed write.
        """
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_CHECKPOINT_SECONDS
        ):
            raise BadRequestError(
                f"checkpoint timeout must be seconds in (0, "
                f"{MAX_CHECKPOINT_SECONDS:g}], got {timeout!r}"
            )
        checkpoint_id = time.strftime("ckpt-%Y%m%dT%H%M%SZ-", time.gmtime()) + os.urandom(3).hex()
        deadline = self.deadline(timeout)
        yield from self._ready(deadline)
        lease = min(MAX_CHECKPOINT_SECONDS, timeout + 30.0)
        shards = range(self.n)

        def round_(verb: str, msg: dict[str, Any]) -> list[ShardRequest]:
            return [
                self._post(i, verb, msg, deadline, mutating=True, retry_safe=True, timeout=timeout)
                for i in shards
            ]

        msg = {"checkpoint": checkpoint_id}
        try:
            pause = round_("pause", {**msg, "lease": lease})
            self._collect(pause, (yield pause))
            snapshot = round_("snapshot", msg)
            self._collect(snapshot, (yield snapshot))
        except PSError:
            resume = round_("resume", msg)
            yield resume
            raise
        resume = round_("resume", msg)
        for request, reply in zip(resume, self._collect(resume, (yield resume))):
            if not isinstance(reply.msg.get("snapshot"), Mapping):
                url = self.url(request.shard)
                raise PSError(
                    f"checkpoint {checkpoint_id} is incomplete: shard {url} has no "
                    "snapshot of it (did it restart during the checkpoint?); take "
                    "another",
                    shard=url,
                )
        return checkpoint_id

    def variables(self) -> Flow[list[dict[str, Any]]]:
        deadline = self.deadline()
        yield from self._ready(deadline)
        batch = [self._get(i, "/v1/variables", deadline, "variables") for i in range(self.n)]
        replies = self._collect(batch, (yield batch))
        out = []
        for request, reply in zip(batch, replies):
            summaries = reply.msg.get("variables")
            if not isinstance(summaries, list):
                url = self.url(request.shard)
                raise ProtocolError(f"GET {url}/v1/variables sent no 'variables' list", shard=url)
            out += [{**s, "shard": request.shard} for s in summaries if isinstance(s, Mapping)]
        return sorted(out, key=lambda s: str(s.get("name")))

    def _per_variable(
        self, batch: list[ShardRequest], replies: list[_Message], key: str
    ) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for request, reply in zip(batch, replies):
            url = self.url(request.shard)
            entries = reply.msg.get(key)
            if not isinstance(entries, Mapping):
                raise ProtocolError(
                    f"shard {url} sent a {request.verb} reply without '{key}'", shard=url
                )
            for name in request.names:
                entry = entries.get(name)
                if not isinstance(entry, Mapping):
                    raise ProtocolError(
                        f"shard {url} sent no result for {name!r} in its {request.verb} reply",
                        shard=url,
                    )
                out[name] = dict(entry)
        return out


# -- module helpers ----------------------------------------------------------------------------


def _mismatch_message(url: str, position: int, n: int, index: Any, total: Any) -> str:
    if total != n and str(total) != str(n):
        return (
            f"shard {url} reports a fleet of {total} shards but {n} are listed: list every "
            "shard, in --shard-index order, in PARAMSHARD_SHARDS (or the shards argument)"
        )
    return (
        f"shard {url} reports index {index} of {total} but is listed at position "
        f"{position}: the PARAMSHARD_SHARDS order (or the shards argument) must match each "
        "shard's --shard-index"
    )


def _parse_retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # the HTTP-date form: fall back to our own backoff
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _name(name: Any) -> str:
    try:
        return validate_name(name)
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None


def as_array(name: str, value: Any, *, copy: bool = False) -> np.ndarray:
    """Convert an array-like to a C-contiguous ndarray of a dtype the protocol carries.

    Raises :class:`BadTensorError` (saying which variable and what to send instead) for object,
    complex, bool, string and other dtypes the protocol has no name for.
    """
    if (
        not copy
        and type(value) is np.ndarray
        and value.dtype in _SENDABLE_DTYPES
        and value.flags.c_contiguous
    ):
        return value  # the common case: nothing to check twice, nothing to convert
    try:
        arr = np.array(value, copy=True) if copy else np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise BadTensorError(
            f"{name}: cannot convert the value to an array ({exc}); pass a "
            "numpy array or a nested list of numbers"
        ) from None
    if arr.dtype.kind not in "fiu" or (arr.dtype.kind + str(arr.dtype.itemsize)) not in wire.DTYPES:
        raise BadTensorError(
            f"{name}: dtype {arr.dtype} cannot be sent; use a float (float16/32/64) or an "
            "integer dtype, e.g. np.asarray(value, dtype=np.float32)",
            code="bad_tensor",
            details={"variable": name, "dtype": str(arr.dtype)},
        )
    if arr.ndim > wire.MAX_NDIM:
        raise BadTensorError(
            f"{name}: at most {wire.MAX_NDIM} dimensions, got {arr.ndim}",
            code="bad_tensor",
            details={"variable": name},
        )
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return arr


#: The dtypes :func:`as_array` passes through (every wire dtype, either byte order).
_SENDABLE_DTYPES = frozenset(np.dtype(o + k) for k in wire.DTYPES for o in "<>")


def _optimizers(
    optimizer: Any, arrays: Mapping[str, np.ndarray]
) -> dict[str, dict[str, Any] | None]:
    """``optimizer`` is one spec for every variable, a dict name -> spec, or None."""
    if optimizer is None or isinstance(optimizer, Optimizer):
        spec = optimizer.to_wire() if optimizer is not None else None
        return {name: spec for name in arrays}
    if isinstance(optimizer, Mapping):
        out: dict[str, dict[str, Any] | None] = {}
        for name in arrays:
            o = optimizer.get(name)
            if o is not None and not isinstance(o, Optimizer):
                raise BadRequestError(
                    f"init: optimizer for {name!r} must be an optimizer spec "
                    f"such as SGD(lr=0.1), got {o!r}"
                )
            out[name] = o.to_wire() if o is not None else None
        unknown = set(optimizer) - set(arrays)
        if unknown:
            raise BadRequestError(
                f"init: optimizers given for names not being initialised: {sorted(unknown)}"
            )
        return out
    raise BadRequestError(
        "init: optimizer must be a spec from client_sdk.optimizers (e.g. "
        f"Adagrad(lr=0.1)) or a dict name -> spec; got {optimizer!r}"
    )
