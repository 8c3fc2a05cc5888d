"""``PSClient`` (threads) and ``AsyncPSClient`` (asyncio): the worker's view of a fleet.

Both are thin shells over one sans-I/O :class:`~client_sdk._core.Core` and differ only by
``await``: each verb is a flow over the core (``_verbs/``) that builds each shard's request and
interprets the replies; a shell sends a batch (one request per shard, all shards concurrently)
and hands the results back. The two shells stay in one file, past the ~600 lines a module
otherwise keeps to: they are one API twice, method for method, and a change to one is read next
to its twin.

    with PSClient(["http://127.0.0.1:7100", "http://127.0.0.1:7101"], worker_id="w0") as ps:
        ps.init({"w": w0}, optimizer=Adagrad(lr=0.1))
        ps.wait_ready(["w"], timeout=60)
        w = ps.pull(["w"])["w"]
        ps.push({"w": grad})

Every method raises only :class:`~client_sdk.PSError` subclasses. Pulled arrays are read-only
(they are also kept in the client's version cache): ``.copy()`` one before changing it in place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx2
import numpy as np

from . import _args, _transport, _verbs
from ._core import Core
from ._direct import PullRoute, direct_pull
from ._exceptions import PSError
from ._flow import Flow, Result, ShardRequest
from ._pusher import AsyncPusher, Pusher, closed_error
from ._settings import DEFAULT_MAX_REPLY_BYTES, load_settings
from ._table_methods import AsyncTableMethods, TableMethods
from ._verbs import PushJob
from .groups import AsyncStepGroup, StepGroup
from .modes import Sync
from .optimizers import Optimizer

__all__ = ["AsyncPSClient", "PSClient"]

logger = logging.getLogger("client_sdk")

Shards = Sequence[str] | str | None
OptimizerArg = Optimizer | Mapping[str, Optimizer] | None
T = TypeVar("T")


class PSClient(TableMethods):
    """A worker's connection to a paramshard fleet (blocking calls).

    ``shards`` lists every shard's URL in ``--shard-index`` order (a list, or one
    comma-separated string); without it ``PARAMSHARD_SHARDS`` is read. An index served by a
    replica group is given as its replicas, ``"URL|URL"`` (or a list of URLs): requests go
    to its primary, and the client follows a failover to the new one (same ``seq``: each
    write applied once). ``worker_id``
    (``PARAMSHARD_WORKER_ID``, default ``"<hostname>-<pid>"``) names this worker in the shards'
    records and numbers its pushes; give every concurrent worker its own. ``token``
    (``PARAMSHARD_TOKEN``) is sent as ``Authorization: Bearer``; of a comma-separated list (the
    shards' ``OLD,NEW`` while a token is rotated) the last. A shard that refuses it raises
    :class:`AuthError` naming the shard. ``https://`` shards are verified with the system's
    trusted CAs, or ``verify="/path/to/ca.pem"`` (``False``: not at all), over the same fast
    connection pools as ``http://``.

    ``timeout`` bounds each whole HTTP exchange with a shard, in seconds: connecting, sending
    the request and receiving the whole reply, however slowly the bytes come (raise it for
    tensors that take longer to move on your network). ``retry_deadline`` bounds each whole
    call, its retries included: a shard that is unreachable, restarting, times out or answers
    429/503 is retried with exponential backoff and jitter (and ``Retry-After``) until then,
    and no retry runs past it (the first attempt has its whole ``timeout``: a call ends within
    the longer of the two). Every call is safe to retry: writes carry this worker's id and
    a sequence number, and a shard applies each one once. ``max_inflight`` bounds
    :meth:`push_async`. ``max_reply_bytes`` (default 1 GiB) bounds a reply whose size the
    client cannot know: a pull's values of variables it neither initialised nor pulled before
    (those it knows bound their replies exactly), the variables listing; a bigger reply is a
    :class:`ProtocolError`, refused before it is read. ``transport`` replaces httpx2's network
    transport (e.g. ``httpx2.MockTransport`` in tests).

    ``wire_dtype`` (``"float16"`` or ``"bfloat16"``; default ``None``: as they are) makes the
    values of float32 variables and the rows of embedding tables travel in half the bytes:
    pulls (and ``pull_rows``) get them narrowed by the shard and widened back to float32 here,
    pushes (and ``push_rows``, after summing repeated ids) send float32 gradients narrowed here
    and widened by the shard, which keeps values, rows and optimizer slots in float32.
    Rounding is to nearest (ties to even); a value or gradient beyond float16's range (65504)
    raises :class:`BadTensorError` instead of travelling as an infinity. bfloat16 keeps float32's
    range with 8 significant bits and needs ``pip install 'paramshard[bfloat16]'``
    (``ml_dtypes``). Other dtypes travel as they are.

    A shard that restarts comes back with a new incarnation: the client logs one warning (the
    shard and the state version it came back at), forgets the values it cached from it, and
    carries on.

    Constructing a client does no I/O, so it may be created before the fleet is up; the first
    call checks ``GET /v1/cluster`` of every shard against the list (and again after a shard
    restarts) and raises :class:`FleetMismatchError` if the order or size disagrees.

    Thread safety: one client may be shared by all threads of a worker; calls from several
    threads run concurrently. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        shards: Shards = None,
        worker_id: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retry_deadline: float = 30.0,
        max_inflight: int = 2,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        wire_dtype: Literal["float16", "bfloat16"] | None = None,
        transport: httpx2.BaseTransport | None = None,
        verify: bool | str = True,
    ) -> None:
        settings = load_settings(
            shards,
            worker_id,
            token=token,
            timeout=timeout,
            retry_deadline=retry_deadline,
            max_inflight=max_inflight,
            max_reply_bytes=max_reply_bytes,
            verify=verify,
            wire_dtype=wire_dtype,
        )
        self._core = Core(settings)
        n = len(settings.shards)
        self._sender = _transport.sync_sender(settings, transport, self._core.replicas.current)
        # Threads for the other shards of a batch: over httpx2, all requests but the caller's
        # own; over the native pools, only new connections and retries (the caller's thread
        # drives the rest). Enough for a call from the caller, every background push and a
        # long poll.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, (n - 1) * (max_inflight + 2)), thread_name_prefix="paramshard-shard"
        )
        self._pusher = Pusher(max_inflight, self._push_job, _verbs.merge_push)
        self._close_lock = threading.Lock()
        self._closed = False
        #: The direct path of pulls by list of names (``_direct.py``; None: not taken).
        self._pull_routes: dict[tuple[str, ...], PullRoute | None] = {}

    @property
    def shards(self) -> tuple[str, ...]:
        """The shard URLs, in shard-index order: of a replicated index, the replica its
        requests go to now (its primary, as far as this client knows)."""
        return tuple(self._core.shards)

    @property
    def worker_id(self) -> str:
        return self._core.settings.worker_id

    # -- driving the core -------------------------------------------------------------------

    def _drive(self, flow: Flow[T], first: list[Result] | None = None) -> T:
        """Run ``flow``; ``first``: the results of its first batch, sent already (by the
        direct path, ``_direct.py``)."""
        if self._closed:
            raise closed_error()
        try:
            batch = next(flow)
            if first is not None:
                batch = flow.send(first)
            while True:
                batch = flow.send(self._send_all(batch))
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _send_all(self, batch: list[ShardRequest]) -> list[Result]:
        return _transport.send_all(self._sender, self._core, batch, self._pool.submit)

    # -- verbs ------------------------------------------------------------------------------

    def init(
        self,
        values: Mapping[str, Any],
        optimizer: OptimizerArg = None,
        *,
        sync: Sync | None = None,
        max_staleness: int | None = None,
        staleness_policy: Literal["drop", "scale"] | None = None,
        partitions: int | Mapping[str, int] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Create each variable unless it exists: the first value wins; no chief is needed.

        ``values`` maps names to array-likes; ``optimizer`` is one spec from
        :mod:`client_sdk.optimizers` for all of them, or a dict name -> spec (default: the
        shard's ``SGD(lr=0.01)``). Their training mode (:mod:`client_sdk.modes`; default
        async): ``sync=Sync(replicas=k, timeout=s)`` for sync rounds of ``k`` gradients, or
        ``max_staleness=s`` (with ``staleness_policy`` ``"drop"``, the default, or
        ``"scale"``) to bound how stale an applied gradient may be. Returns name ->
        ``{"version", "created"}``; a variable that existed with the same shape and dtype
        keeps its value, optimizer and mode (``created`` is False). Blocks until every owning
        shard answered. Raises :class:`BadRequestError` for mode settings out of range or
        contradictory (before sending), :class:`ConflictError` if a variable exists with
        another shape or dtype, or another mode than one stated here (that shard then created
        nothing), :class:`BadTensorError` for values the protocol cannot carry or non-finite
        floats.

        ``partitions=k`` (an int for all, or a dict name -> int) splits a variable along axis 0
        into ``k`` parts ``name/part-0`` .. ``name/part-{k-1}``, each placed on the shard that
        owns its name; without it, a variable bigger than the fleet's ``--partition-bytes`` is
        split into parts of at most that size (``1``: never split this one). A partitioned
        variable is still one variable to every verb of every client (pull, push, assign,
        ``newer_than``, ``versions``, checkpoints); its layout is fixed at init: another
        ``partitions``, or a plain variable of the same name, raises :class:`ConflictError`
        (``details["field"]`` is ``"partitions"``). It trains asynchronously only:
        ``partitions`` with ``sync`` or ``max_staleness`` raises :class:`BadRequestError`,
        as do an optimizer with ``clip_norm`` (each part would be clipped by its own norm),
        and ``k`` below 1, above the rows of axis 0, or for a scalar.
        """
        mode = _args.mode(sync, max_staleness, staleness_policy)
        return self._drive(_verbs.partitioned.init(self._core, values, optimizer, mode, partitions))

    def wait_ready(self, names: Sequence[str], timeout: float | None = 60.0) -> None:
        """Block until every named variable exists (some worker called :meth:`init`).

        Tolerates shards that are not up yet: they are retried until ``timeout`` seconds
        (``None``: forever). Raises :class:`NotReadyError`, whose ``missing`` lists the names
        that never appeared (and whose message names unreachable shards), and
        :class:`FleetMismatchError` if a shard disagrees with the shard list.
        """
        return self._drive(_verbs.wait(self._core, names, timeout))

    def pull(
        self,
        names: Sequence[str],
        *,
        newer_than: Literal["cached"] | Mapping[str, int] | None = None,
        min_version: int | None = None,
        timeout: float | None = 60.0,
        out: Mapping[str, Any] | None = None,
        allow_backup: bool = False,
    ) -> dict[str, np.ndarray]:
        """Fetch the current values of ``names``: a dict name -> ndarray. Blocks.

        The client keeps the last value and version it pulled of each variable and tells the
        shards, so variables that did not change since are not sent again; their cached array
        is returned. Returned arrays are therefore **read-only**: ``.copy()`` one before
        changing it in place. Each value is consistent (never half-updated). Raises
        :class:`UnknownVariableError` if a name does not exist.

        Two ways to wait for new values instead (``POST /v1/poll``: the shards hold the
        request and answer when a write makes one; a waiting pull costs them no CPU):

        * ``newer_than="cached"`` (the versions this client last pulled) or a dict name ->
          version: returns as soon as any of ``names`` has another version, with **only the
          variables that changed** (a name this client holds no value of counts as changed);
          ``{}`` if none changed within ``timeout`` seconds. Across several shards it returns
          with what the first shard to see a change sends. For processes that act with a
          learner's newest weights: ``w.update(ps.pull(names, newer_than="cached"))``.
        * ``min_version=v``: returns every one of ``names`` (as a plain pull) once each has
          version ``v`` or more; raises :class:`NotReadyError` (``missing``: those below) if
          they have not within ``timeout`` seconds. ``v`` more than 1,000,000 above a
          variable's version raises :class:`BadRequestError`. For sync training: the
          parameters of the next round.

        ``timeout`` is in seconds (``None``: no limit; a shard holds one request at most 30 s,
        the client asks again as needed); a plain pull does not wait and ignores it.

        ``out`` (name -> a buffer of the variable's shape and dtype, for some or all of
        ``names``) writes those values into the caller's own memory, and the result holds an
        ndarray view of each buffer under its name: a training loop then allocates and copies
        nothing parameter-sized per pull. A value of 16 KiB or more is received from the
        socket straight into its C-contiguous buffer (a partitioned variable's parts into its
        rows; a ``wire_dtype`` value widened into it); smaller ones, other buffers, and
        replies through an injected ``transport`` are copied in from the reply. The client
        keeps no copy of a value it received into a buffer (the buffer is the caller's to
        change), so such values are sent whole on every pull; their versions are kept (for
        :meth:`push` and ``newer_than="cached"``). A buffer is anything numpy can view
        writable without a copy: an ndarray, a torch CPU tensor (``p.detach()``), any object
        with the buffer protocol or ``__array_interface__``. Buffers are checked against what
        this client knows of the variables before anything is sent (:class:`BadTensorError`
        for a shape or dtype, :class:`BadRequestError` for a read-only buffer or a name not
        pulled: nothing written), and each shard's values against their buffers before any is
        written: a value that no longer fits (made again since with another shape) raises
        :class:`BadTensorError` and leaves its shard's buffers as they were. A pull that fails
        may have written the buffers of other shards' values (or, when a shard's reply breaks
        off, part of them): pull again. Every successful pull writes every buffer. With
        ``newer_than``, only the variables that changed are written.

        ``allow_backup=True`` (any of the forms above) lets a backup of each shard answer
        instead of its primary, where the shard list names replica groups (``a|b``): for
        readers that must not load the primaries (broadcast actors, evaluators). The values
        are the backup's: never newer than the primary's, older by the writes still on their
        way to it (its lag, usually none once a write is acknowledged: every acknowledged
        write is on every in-sync backup). Each client reads from one backup of each group,
        taken at random (so many readers spread over the backups); when it does not answer,
        refuses (it is not in-sync, or not a backup now) or is busy, the read goes to the
        primary, and that backup is passed over for 10 s. A value read from a backup is
        cached as that backup's: the next pull from another replica sends it whole, and it
        may be older than one this client pulled from the primary before (its version, which
        :meth:`push` sends, says so).
        """
        core = self._core.backup_reads() if allow_backup else self._core
        if newer_than is None and min_version is None:
            if out is None and not allow_backup:
                got = direct_pull(self, names)
                if got is not None:
                    return got
            return self._drive(_verbs.partitioned.pull(core, names, out))
        return self._drive(
            _verbs.partitioned.poll(core, names, newer_than, min_version, timeout, out)
        )

    def group(self, names: Sequence[str]) -> StepGroup:
        """Register ``names`` as a step group (blocks: one request per shard they live on) and
        return it: ``g.pull()`` and ``g.push(grads)`` then move all of them as one flat buffer
        per shard, with no per-variable work on either side but the arithmetic. For the
        variables a training step pulls and pushes every time (a model's many small tensors);
        the rules and what happens when a variable is deleted are in :mod:`client_sdk.groups`.
        Raises :class:`UnknownVariableError` for a name that does not exist,
        :class:`BadRequestError` for a repeated name, mixed dtypes or too many variables."""
        return StepGroup(self, names)

    def versions(self, names: Sequence[str]) -> dict[str, int]:
        """The version of each of ``names`` whose value this client holds from its last
        :meth:`pull` (what :meth:`push` sends as ``versions`` by default); names it holds no
        value of are left out. No I/O; thread-safe."""
        return _verbs.partitioned.versions(self._core, names)

    def push(
        self, grads: Mapping[str, Any], versions: Mapping[str, int] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Send gradients; returns once every owning shard applied them (blocks).

        Each shard validates its whole part before applying any of it, then runs the
        variable's optimizer. ``versions`` (name -> version the gradient was computed on)
        defaults to the versions this client last pulled, so the shard measures staleness.
        Returns name -> ``{"status", "version", "staleness"}``; ``status`` is ``"applied"``,
        ``"duplicate"`` when a retry found the push already applied (its reply had been lost),
        and for variables with a training mode (:mod:`client_sdk.modes`) ``"accepted"`` (it
        joined a sync round, applied when the round closes) or ``"dropped"`` (too stale: the
        entry's ``reason`` and ``message`` say why; nothing was changed); a gradient applied
        with a scaled step has its factor as ``"scale"``. Dropped gradients are not an error.
        Raises :class:`BadTensorError` for a wrong shape/dtype or non-finite values,
        :class:`UnknownVariableError` for a missing variable; if shards disagree, the error
        says on which shards the push was applied. Retried (same seq) after any connection
        failure, timeout, 429 or 503 until ``retry_deadline``: applied at most once.
        """
        return self._drive(_verbs.partitioned.push(self._core, grads, versions))

    def push_async(
        self,
        grads: Mapping[str, Any],
        versions: Mapping[str, int] | None = None,
        *,
        coalesce: bool = False,
        copy: bool = True,
    ) -> concurrent.futures.Future[dict[str, dict[str, Any]]]:
        """Start a push in the background and return its ``concurrent.futures.Future``.

        The gradients are copied first, so the caller may reuse its buffers at once; with
        ``copy=False`` they are lent instead (sent from the caller's own memory, no copy): the
        caller must not change them until the future is done (torch: hand them over, e.g.
        ``p.grad = None`` so the next backward makes new ones; JAX arrays never change). Returns
        immediately unless ``max_inflight`` pushes are already running; then it blocks until
        one finishes, or, with ``coalesce=True``, returns at once and the push waits for a free
        slot, and later ``coalesce=True`` pushes are *added* into that waiting push (one push,
        one future, the oldest ``versions``): a worker faster than its shards keeps its memory
        flat and loses no gradient. The future's result is what :meth:`push` returns. A failure
        is raised by the future, by the next :meth:`flush` (as :class:`PushError`) and by
        :meth:`close`: never dropped. Argument errors are raised here, before anything is sent:
        among them :class:`BadTensorError` for a gradient whose shape is not its variable's, or
        whose dtype (or variable's) is not a float one, as far as this client knows the variable
        (from its :meth:`init` or its last :meth:`pull`).
        """
        if self._closed:
            raise closed_error()
        job = self._drive(_verbs.partitioned.push_job(self._core, grads, versions, copy=copy))
        _verbs.check_push(self._core, job)
        return self._pusher.submit(job, coalesce=coalesce)

    def _push_job(self, job: PushJob) -> dict[str, dict[str, Any]]:
        return self._drive(_verbs.partitioned.send_push(self._core, job))

    def flush(self) -> None:
        """Block until every :meth:`push_async` so far has finished; raise
        :class:`PushError` (``errors``: each failure) if any failed since the last flush."""
        self._pusher.flush()

    def increment(
        self, name: str, delta: int | float = 1, kind: Literal["int", "float"] | None = None
    ) -> int | float:
        """Atomically add ``delta`` to counter ``name`` and return the new value. Blocks.

        The counter is created at 0 on first use: an int64 with ``kind="int"``, a float64 with
        ``kind="float"``; without ``kind``, after ``delta``'s type (int or float). A ``kind``
        the existing counter does not have raises :class:`ConflictError`; ``delta`` is taken
        as that kind (``kind="int"`` with a float delta that is not a whole number raises
        :class:`BadRequestError`). Concurrent callers, in any process, each get a distinct
        value: use it for ``global_step``. Retried like a push: a retry of an increment already
        applied gets the value the first attempt got.
        """
        return self._drive(_verbs.increment(self._core, name, delta, kind))

    def assign(self, values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Overwrite existing variables (same shape; cast to the variable's dtype). Blocks.

        Optimizer state is kept. Returns name -> ``{"version"}``. Raises
        :class:`UnknownVariableError` for a variable that does not exist.
        """
        return self._drive(_verbs.partitioned.assign(self._core, values))

    def set_optimizer(
        self,
        names_or_prefix: Sequence[str] | str,
        spec: Optimizer | None = None,
        *,
        frozen: bool | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Change how pushes update variables: their optimizer, or whether they are frozen.
        Blocks.

        ``names_or_prefix`` is a list of names, or a string: every variable whose name starts
        with it, on every shard (counters excepted; ``""`` is refused: it would be all of
        them). ``spec`` replaces the optimizer from the next push on: of the variable's type,
        its slots (Adam's moments, Adagrad's accumulator) and step count are kept; of another
        type, they start over. ``frozen=True`` makes every push naming the variable raise
        :class:`FrozenError` (nothing of it applied) until ``frozen=False``; :meth:`assign`
        still writes it. The value is not touched. Returns name -> ``{"status", "version",
        "optimizer", "optimizer_version", "frozen", "slots"}`` (``slots``: ``"kept"`` or
        ``"reset"``). Raises :class:`UnknownVariableError` for a name that does not exist,
        :class:`ConflictError` for a counter, :class:`BadRequestError` for a spec a variable
        cannot take; nothing changes on that shard then. Retried like a push: applied once.
        """
        return self._drive(
            _verbs.partitioned.set_optimizer(self._core, names_or_prefix, spec, frozen)
        )

    def delete(self, names_or_prefix: Sequence[str] | str) -> list[str]:
        """Remove variables (to start a run over) and return the names removed, sorted.
        Blocks.

        ``names_or_prefix`` is a list of names, or a string: every variable whose name starts
        with it, on every shard, counters included (``""`` is refused). A name that does not
        exist is not an error: it is not in the result. A variable made again under a removed
        name starts afresh (version 0, the new init's value and optimizer); this client forgets
        what it cached of them. Raises :class:`ConflictError` while a sync round is open on
        one (nothing removed on that shard: retry once it closed). Retried like a push: applied
        once (a retry that finds its first attempt applied returns nothing for that shard).
        """
        return self._drive(_verbs.delete(self._core, names_or_prefix))

    def variables(self) -> list[dict[str, Any]]:
        """Summaries of every variable on every shard (``GET /v1/variables``), sorted by name,
        each with the index of its ``shard``. Blocks."""
        return self._drive(_verbs.variables(self._core))

    def checkpoint(self, timeout: float = 300.0) -> str:
        """Snapshot the whole fleet at one instant and return the checkpoint's id. Blocks.

        Pauses writes on every shard (pushes wait, or get 503 and are retried), has each
        write a snapshot to its ``--data-dir`` labelled with the id, then resumes them. Start
        the shards with ``--restore <id>`` to bring the fleet back to exactly this state, or
        ``paramshard reshard`` it onto another number of shards. ``timeout`` bounds the whole
        checkpoint (seconds). Raises :class:`ConflictError` if a shard has no ``--data-dir``;
        after any failure the shards are resumed.
        """
        return self._drive(_verbs.checkpoint(self._core, timeout))

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush background pushes, then release connections and threads.

        Blocks until in-flight pushes finish; raises :class:`PushError` if any failed and was
        not yet raised by :meth:`flush` (the client is closed either way). Idempotent.
        """
        with self._close_lock:
            if self._closed:
                return
            try:
                self._pusher.close()
            finally:
                self._closed = True
                self._core.stalls.close()
                self._pool.shutdown(wait=True)
                self._sender.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except PSError as err:
            # The exception already propagating is the one to raise; still, say what failed.
            logger.warning("while closing after %s: %s", type(exc).__name__, err)

    def __repr__(self) -> str:
        return f"PSClient({list(self.shards)!r}, worker_id={self.worker_id!r})"


class AsyncPSClient(AsyncTableMethods):
    """The asyncio twin of :class:`PSClient`: the same verbs and arguments, ``await``-ed.

    ``push_async`` returns an ``asyncio.Task`` (waiting first while ``max_inflight`` pushes run);
    use ``async with AsyncPSClient(...) as ps`` or ``await ps.close()``. Requests to the shards
    of one call run concurrently (``asyncio.gather``). Use a client from one event loop; it is
    not for sharing across threads. ``transport`` takes an ``httpx2.AsyncBaseTransport``.
    """

    def __init__(
        self,
        shards: Shards = None,
        worker_id: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retry_deadline: float = 30.0,
        max_inflight: int = 2,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        wire_dtype: Literal["float16", "bfloat16"] | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
        verify: bool | str = True,
    ) -> None:
        settings = load_settings(
            shards,
            worker_id,
            token=token,
            timeout=timeout,
            retry_deadline=retry_deadline,
            max_inflight=max_inflight,
            max_reply_bytes=max_reply_bytes,
            verify=verify,
            wire_dtype=wire_dtype,
        )
        self._core = Core(settings)
        self._sender = _transport.async_sender(settings, transport, self._core.replicas.current)
        self._pusher = AsyncPusher(max_inflight, self._push_job, _verbs.merge_push)
        self._closed = False

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(self._core.shards)

    @property
    def worker_id(self) -> str:
        return self._core.settings.worker_id

    async def _drive(self, flow: Flow[T]) -> T:
        if self._closed:
            raise closed_error()
        try:
            batch = next(flow)
            while True:
                batch = flow.send(await self._send_all(batch))
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def _send_all(self, batch: list[ShardRequest]) -> list[Result]:
        if len(batch) == 1:
            return [await _transport.asend(self._sender, self._core, batch[0])]
        if batch[0].abort is not None:  # a race (_verbs/poll.py): the first settled one wins
            return await _transport.arace(self._sender, self._core, batch)  # type: ignore[return-value]
        return list(
            await asyncio.gather(*(_transport.asend(self._sender, self._core, r) for r in batch))
        )

    async def init(
        self,
        values: Mapping[str, Any],
        optimizer: OptimizerArg = None,
        *,
        sync: Sync | None = None,
        max_staleness: int | None = None,
        staleness_policy: Literal["drop", "scale"] | None = None,
        partitions: int | Mapping[str, int] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """See :meth:`PSClient.init`."""
        mode = _args.mode(sync, max_staleness, staleness_policy)
        return await self._drive(
            _verbs.partitioned.init(self._core, values, optimizer, mode, partitions)
        )

    async def group(self, names: Sequence[str]) -> AsyncStepGroup:
        """:meth:`PSClient.group`: ``g = await ps.group(names)``, then ``await g.pull()``,
        ``await g.push(grads)``."""
        return await AsyncStepGroup.make(self, names)

    def versions(self, names: Sequence[str]) -> dict[str, int]:
        """See :meth:`PSClient.versions` (no I/O: not a coroutine)."""
        return _verbs.partitioned.versions(self._core, names)

    async def wait_ready(self, names: Sequence[str], timeout: float | None = 60.0) -> None:
        """See :meth:`PSClient.wait_ready`."""
        return await self._drive(_verbs.wait(self._core, names, timeout))

    async def pull(
        self,
        names: Sequence[str],
        *,
        newer_than: Literal["cached"] | Mapping[str, int] | None = None,
        min_version: int | None = None,
        timeout: float | None = 60.0,
        out: Mapping[str, Any] | None = None,
        allow_backup: bool = False,
    ) -> dict[str, np.ndarray]:
        """See :meth:`PSClient.pull` (returned arrays are read-only, but for ``out``'s
        buffers); with ``newer_than`` or ``min_version`` it waits without blocking the event
        loop."""
        core = self._core.backup_reads() if allow_backup else self._core
        if newer_than is None and min_version is None:
            return await self._drive(_verbs.partitioned.pull(core, names, out))
        return await self._drive(
            _verbs.partitioned.poll(core, names, newer_than, min_version, timeout, out)
        )

    async def push(
        self, grads: Mapping[str, Any], versions: Mapping[str, int] | None = None
    ) -> dict[str, dict[str, Any]]:
        """See :meth:`PSClient.push`."""
        return await self._drive(_verbs.partitioned.push(self._core, grads, versions))

    async def push_async(
        self,
        grads: Mapping[str, Any],
        versions: Mapping[str, int] | None = None,
        *,
        coalesce: bool = False,
        copy: bool = True,
    ) -> asyncio.Task[dict[str, dict[str, Any]]]:
        """Start a push as an ``asyncio.Task`` and return it; waits only while
        ``max_inflight`` pushes are running, and not even then with ``coalesce=True``.
        Failures surface on the task, on the next :meth:`flush` and on :meth:`close`;
        ``copy=False`` lends the buffers until the task is done (see
        :meth:`PSClient.push_async`)."""
        if self._closed:
            raise closed_error()
        job = await self._drive(_verbs.partitioned.push_job(self._core, grads, versions, copy=copy))
        _verbs.check_push(self._core, job)
        return await self._pusher.submit(job, coalesce=coalesce)

    async def _push_job(self, job: PushJob) -> dict[str, dict[str, Any]]:
        return await self._drive(_verbs.partitioned.send_push(self._core, job))

    async def flush(self) -> None:
        """See :meth:`PSClient.flush`."""
        await self._pusher.flush()

    async def increment(
        self, name: str, delta: int | float = 1, kind: Literal["int", "float"] | None = None
    ) -> int | float:
        """See :meth:`PSClient.increment`."""
        return await self._drive(_verbs.increment(self._core, name, delta, kind))

    async def assign(self, values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """See :meth:`PSClient.assign`."""
        return await self._drive(_verbs.partitioned.assign(self._core, values))

    async def set_optimizer(
        self,
        names_or_prefix: Sequence[str] | str,
        spec: Optimizer | None = None,
        *,
        frozen: bool | None = None,
    ) -> dict[str, dict[str, Any]]:
        """See :meth:`PSClient.set_optimizer`."""
        return await self._drive(
            _verbs.partitioned.set_optimizer(self._core, names_or_prefix, spec, frozen)
        )

    async def delete(self, names_or_prefix: Sequence[str] | str) -> list[str]:
        """See :meth:`PSClient.delete`."""
        return await self._drive(_verbs.delete(self._core, names_or_prefix))

    async def variables(self) -> list[dict[str, Any]]:
        """See :meth:`PSClient.variables`."""
        return await self._drive(_verbs.variables(self._core))

    async def checkpoint(self, timeout: float = 300.0) -> str:
        """See :meth:`PSClient.checkpoint`."""
        return await self._drive(_verbs.checkpoint(self._core, timeout))

    async def close(self) -> None:
        """Wait for background pushes, then close connections; raises :class:`PushError` for
        failures not yet raised by :meth:`flush`. Idempotent."""
        if self._closed:
            return
        try:
            await self._pusher.close()
        finally:
            self._closed = True
            await self._core.stalls.aclose()
            await self._sender.close()

    async def __aenter__(self) -> AsyncPSClient:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            await self.close()
            return
        try:
            await self.close()
        except PSError as err:
            logger.warning("while closing after %s: %s", type(exc).__name__, err)

    def __repr__(self) -> str:
        return f"AsyncPSClient({list(self.shards)!r}, worker_id={self.worker_id!r})"
