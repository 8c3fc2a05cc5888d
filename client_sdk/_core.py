"""The sans-I/O core of a client: what its verbs share, the requests they build, the replies
they accept.

:class:`PSClient` and :class:`AsyncPSClient` (``client.py``) are thin shells around one
:class:`Core`; each verb is a flow over it (``_verbs/``, one module per verb; ``_flow.py`` says
what a flow is). The core holds

* the client's settings (``_settings.py``), what it knows of the fleet (``_fleet.py``: shard
  list, placement, features, incarnations), its version cache (``_cache.py``) and its
  sequence numbers;
* request building: :meth:`Core.post` for a data-plane verb (its body encoded by
  :mod:`client_sdk.wire`, its headers, the bound on its reply), :meth:`Core.get`;
* reply acceptance: :meth:`Core.accept` checks who answered (the fleet) and decodes the reply
  or raises the error it means (``_replies.py``); :meth:`Core.collect` does a batch;
* the fleet check every verb starts with (:meth:`Core.require_fleet`).

Every write (push, assign, increment) carries this worker's id and a ``seq`` from one counter per
worker; the shard applies each seq once and answers a repeat ``"duplicate"``. So writes, like
reads, are retried after *any* transport failure (the body, seq included, is sent again as it
was), and after 429/503, with exponential backoff and jitter, until the call's deadline
(``_transport.py`` retries; both shells alike).

The core is thread-safe: its shared state is in the fleet and the cache, each guarded by its
own lock that is never held across I/O (the fleet's is taken first when both are).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _replies, wire
from ._abort import Abort
from ._cache import VersionCache
from ._exceptions import (
    BadTensorError,
    FleetMismatchError,
    ProtocolError,
    PSError,
    ShardUnavailableError,
)
from ._fleet import Fleet, era
from ._flow import Reply, Result, ShardRequest
from ._parts import Parts
from ._replicas import Replicas
from ._replies import Message
from ._settings import Settings
from ._stalls import Stalls

if TYPE_CHECKING:
    from ._http.http11 import Into

__all__ = ["REPLY_HEADROOM", "REPLY_PER_NAME", "Core"]

#: What every data-plane request accepts back: framed bodies for big tensors, msgpack otherwise.
ACCEPT = f"{wire.FRAME}, {wire.MSGPACK}"
#: A reply's room beyond its values: the message (names, versions, dtypes, shapes, offsets,
#: an error's details), a fixed part and a part per variable named in the request.
REPLY_HEADROOM = 64 * 1024
REPLY_PER_NAME = 2048

#: A list of checks of every shard that could not be reached, by shard.
Unreachable = dict[int, PSError]

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


class Core:
    """What the verbs of one :class:`PSClient` or :class:`AsyncPSClient` share. Thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: Each index's replicas, and the one its requests go to now (``_replicas.py``).
        self.replicas = Replicas(settings.groups)
        #: Where each shard's requests go now: ``replicas.current``, the same list.
        self.shards = self.replicas.current
        #: The exchanges in flight to replica groups, abandoned for a new primary (``_stalls.py``).
        self.stalls = Stalls(self.replicas)
        self.n = len(settings.shards)
        self.cache = VersionCache(self.n)
        self.fleet = Fleet(self.replicas.current, self.cache.drop_shard)
        #: The layouts of partitioned variables (``_parts.py``, ``_verbs/partitioned.py``).
        self.parts = Parts()
        #: Pull plans kept per list of names (``_verbs/pull.py``).
        self.pull_plans: dict[tuple[str, ...], tuple[list[str], dict[int, list[str]]]] = {}
        #: The row width of each embedding table this client created or pulled.
        self.table_dims: dict[str, int] = {}
        #: The bound on a reply whose size the client cannot know.
        self.max_reply = REPLY_HEADROOM + settings.max_reply_bytes
        self._seq = _seq_counter(settings.worker_id)
        base = {"accept": ACCEPT, "accept-encoding": "identity"}
        if settings.token:
            base["authorization"] = f"Bearer {settings.token}"
        self._base_headers = base
        self._data_headers = [{**base, wire.HEADER_FLEET: f"{i}/{self.n}"} for i in range(self.n)]
        #: Whether this core's reads may be answered by a backup (:meth:`backup_reads`).
        self.allow_backup = False
        self._backup_twin: Core | None = None

    def backup_reads(self) -> Core:
        """This core, but for its reads, which a backup of each index may answer
        (``pull(..., allow_backup=True)``): the same state (fleet, cache, replicas, sequence
        numbers), shared; each data-plane read it builds goes to the index's backup
        (:meth:`Replicas.reader <client_sdk._replicas.Replicas.reader>`) with
        ``x-paramshard-allow-backup: 1``."""
        twin = self._backup_twin
        if twin is None:
            twin = copy.copy(self)
            twin.allow_backup = True
            twin._data_headers = [{**h, wire.HEADER_ALLOW_BACKUP: "1"} for h in self._data_headers]
            self._backup_twin = twin
        return twin

    def read_era(self, shard: int) -> str | None:
        """The era to look cached values of ``shard`` up by for a read (the versions it
        offers): the primary's, or, for a core of :meth:`backup_reads`, that of the backup it
        reads from."""
        if self.allow_backup:
            url = self.replicas.reader(shard)
            if url is not None:
                return self.replicas.era(url)
        return self.fleet.era(shard)

    def url(self, shard: int) -> str:
        return self.shards[shard]

    def deadline(self, seconds: float | None = None) -> float:
        """When a call starting now must end (``time.monotonic()`` seconds): ``seconds``
        from now, by default the client's ``retry_deadline``."""
        seconds = self.settings.retry_deadline if seconds is None else seconds
        return time.monotonic() + seconds

    def next_seq(self) -> int:
        """A new sequence number for one write of this worker."""
        with _SEQ_LOCK:
            return next(self._seq)

    # -- requests ------------------------------------------------------------------------

    def post(
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
        tensors: bool = False,
        table: dict[str, Any] | None = None,
        arrays: list[np.ndarray] | None = None,
        dtypes: list[str | None] | None = None,
        max_reply: int | None = None,
        abort: Abort | None = None,
        into: Into | None = None,
    ) -> ShardRequest:
        """A POST of ``msg`` to ``/v1/<verb>``; ``tensors`` if ``msg`` holds ndarrays (else
        it is packed as it is, without looking for any). With ``table`` (a map inside
        ``msg``) and ``arrays``, encoded as a framed body whose tensor table ``table`` holds
        ``arrays`` (where the shard takes it, arrays of one dtype and shape as a packed
        uniform table: docs/PROTOCOL.md §2), their type strings ``dtypes`` when given (a
        bfloat16 row travels as its bits: :mod:`client_sdk.wire.halves`). Its reply is
        bounded by ``max_reply``, by default: the headroom and the room for its names (a reply
        without tensors). ``abort`` makes it one request of a race, ``into`` receives its
        reply's body (:class:`~client_sdk._flow.ShardRequest`)."""
        try:
            if table is not None:
                assert arrays is not None, "a table comes with its arrays"
                packed = self.fleet.packed[shard]
                shapes: list[list[int] | None] | None = None
                if dtypes is not None:
                    shapes = [list(a.shape) for a in arrays]
                body = wire.encode_table(
                    msg, table, arrays, dtypes, shapes, uniform=packed, packed=packed
                )
            else:
                body = wire.encode(msg, tensors=tensors)
        except wire.WireError as exc:
            raise BadTensorError(
                f"cannot encode the {verb} request: {exc.message}",
                code=exc.code,
                details=exc.details,
            ) from exc
        names = tuple(names)
        if max_reply is None:
            max_reply = REPLY_HEADROOM + REPLY_PER_NAME * len(names)
        backup_read = self.allow_backup and not mutating
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
            abort,
            into,
            url=self.replicas.reader(shard) if backup_read else None,
            allow_backup=backup_read,
        )

    def get(self, shard: int, path: str, deadline: float, verb: str) -> ShardRequest:
        """A GET of ``path`` (a JSON or msgpack document of unknown size)."""
        return ShardRequest(
            shard,
            "GET",
            path,
            self._base_headers,
            None,
            False,
            deadline,
            verb,
            max_reply=self.max_reply,
        )

    # -- replies -------------------------------------------------------------------------

    def accept(self, request: ShardRequest, result: Result) -> Message:
        """Check one result and decode it; raise the mapped PSError for a failure."""
        if isinstance(result, PSError):
            raise result
        url, cached_as = self.identify(request, result)
        try:
            return _replies.decode(request, result, url, self.n, cached_as)
        except FleetMismatchError as exc:
            if exc.status == 421:  # the shard says it is not the one: check it again
                self.fleet.recheck(request.shard)
            raise

    def identify(self, request: ShardRequest, reply: Reply) -> tuple[str, str | None]:
        """What :meth:`accept` checks and notes of a reply before decoding its body: the
        answering shard's identity (raising the mapped PSError) and incarnation. Returns the
        URL its errors name and the era its values are cached under."""
        shard = request.shard
        headers = reply.headers
        fleet = self.fleet
        fleet.check_identity(shard, headers)
        incarnation = headers.get(wire.HEADER_INCARNATION)
        cached_as = era(incarnation, headers.get(wire.HEADER_DELETIONS))
        url = self.shards[shard]
        if request.url is not None and headers.get(wire.HEADER_ROLE) == "backup":
            # A read a backup answered: its values are cached under its own era, and its
            # incarnation is not the primary's (no restart of the index to report).
            url = request.url
            self.replicas.note_era(url, cached_as)
        else:
            fleet.note_incarnation(
                shard, incarnation, headers.get(wire.HEADER_STATE_VERSION), cached_as
            )
        return url, cached_as

    def collect(self, batch: list[ShardRequest], results: list[Result]) -> list[Message]:
        """Accept every result; if any failed, raise the first failure (by shard order),
        saying on which shards a mutating call was nevertheless applied."""
        return _replies.collect(batch, results, self.accept, self.shards)

    # -- the fleet check -----------------------------------------------------------------

    def check_fleet(
        self, deadline: float
    ) -> Generator[list[ShardRequest], list[Result], Unreachable]:
        """Check ``GET /v1/cluster`` of every shard not checked yet.

        Returns the shards that could not be reached (with why); raises
        :class:`FleetMismatchError` or :class:`ProtocolError` for a shard that answers but
        disagrees with this client's list.
        """
        todo = self.fleet.unchecked()
        if not todo:
            return {}
        batch = [self.get(i, "/v1/cluster", deadline, "cluster") for i in todo]
        results = yield batch
        unreachable: Unreachable = {}
        mismatch: PSError | None = None
        for request, result in zip(batch, results):
            if isinstance(result, ShardUnavailableError):
                unreachable[request.shard] = result
                continue
            try:
                info = self.accept(request, result).msg
                self.fleet.check_cluster(request.shard, info)
                self.stalls.note_cluster(request.shard, info)
            except ShardUnavailableError as exc:  # 503 until the deadline
                unreachable[request.shard] = exc
                continue
            except (FleetMismatchError, ProtocolError) as exc:
                mismatch = mismatch or exc
                continue
            self.fleet.checked(request.shard)
        if mismatch is not None:
            raise mismatch
        return unreachable

    def require_fleet(self, deadline: float) -> Generator[list[ShardRequest], list[Result], None]:
        """Make sure every shard was checked against the list (see :meth:`check_fleet`),
        as every verb does first; raise the failure of a shard that cannot be reached."""
        unreachable = yield from self.check_fleet(deadline)
        if unreachable:
            raise unreachable[min(unreachable)]
