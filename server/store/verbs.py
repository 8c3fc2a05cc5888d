"""The shard's API to its routes: :class:`ParameterStore`, the variables one shard owns and the
verbs that read and change them. No HTTP in here.

:class:`ParameterStore` implements ``init``, ``pull``, ``push``, ``assign``, ``increment``,
``wait`` and ``poll`` (docs/PROTOCOL.md §3) as plain methods on decoded arguments, plus what the
shard around it needs: ``capture`` and ``restore`` (snapshots), ``readable`` and ``settled``
(the waits a route awaits before a read or a write while a big push is applied off the loop).
Refusals are :class:`~server.errors.ShardError` with the protocol's codes.

Every write runs the same steps (:mod:`server.store.operations` says why in this order): check
the request (names, ownership, fields, tensors), ask the dedup table whether its ``(worker_id,
seq)`` was applied already (a retry is answered ``"duplicate"``), build the operation, apply it
(:mod:`server.store.apply`), then count it: versions, the shard's state version, the dedup
table, and wake the polls waiting on what changed
(:class:`~server.store.waiters.VersionWaiters`). So a refused request leaves no trace, and a
write carrying ``worker_id`` and ``seq`` is applied once: a seq already applied is answered
``"duplicate"`` and changes nothing (a retried increment gets the value it got the first time,
while the shard still holds that result: ``dedup.MAX_RESULTS`` per worker); a seq too old to
tell, or an increment's whose result is no longer held, is refused (409 ``seq_expired``).

Reads hand out read-only views of the live values, no copy (:meth:`Variable.export
<server.store.variable.Variable.export>`): ``pull`` answers a pull as columns of a tensor table
(:class:`PullRows`; all of a slab's values as one buffer when it can), and ``capture`` takes the
whole state at one instant for a snapshot (:class:`Capture`).

The work of every verb is proportional to the request, never to the number of variables the
shard holds (``bytes`` and counts are kept up to date, not recomputed). Thread-safety: none;
call from one thread (the event loop's).
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from client_sdk import wire
from client_sdk.modes import ASYNC
from client_sdk.placement import shard_for, validate_name

from ..errors import ShardError
from . import apply, deletion, modes, operations, optimizer_change, waiters
from .dedup import MAX_RESULTS, DedupTable
from .rounds import Deadlines, RoundStats
from .slab import into_slabs
from .staleness import Window
from .variable import Variable
from .waiters import VersionWaiters

__all__ = ["MAX_WAIT_SECONDS", "Capture", "ParameterStore", "PullRows"]

MAX_WAIT_SECONDS = 30.0
#: Below any staleness (a version is at most 2**63 - 1).
_NO_STALENESS = -(1 << 64)
#: No gradient checked already (:meth:`ParameterStore.push`'s ``finite``).
_NONE: Mapping[str, float] = MappingProxyType({})


class PullRows:
    """A pull as parallel lists, one row per name: the checked ``names``, their current
    ``versions``, and per row the read-only value with its ``dtypes`` type string and
    ``shapes`` list, or ``None`` in all three where the puller holds the current version."""

    __slots__ = ("names", "versions", "values", "dtypes", "shapes", "whole")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        #: When the rows are every member of one slab, in its order, all home and all sent:
        #: their bytes as one buffer, laid out as a packed table's rows (:meth:`Slab.whole
        #: <server.store.slab.Slab.whole>`).
        self.whole: np.ndarray | None = None
        self.versions: list[int] = []
        self.values: list[np.ndarray | None] = []
        self.dtypes: list[str | None] = []
        self.shapes: list[list[int] | None] = []


@dataclass
class Capture:
    """A shard's whole state at one instant (:meth:`ParameterStore.capture`).

    ``variables`` maps name -> (bookkeeping, arrays); the arrays are read-only and no later
    update changes them, so a writer thread may read them while the shard goes on.
    """

    shard_index: int
    num_shards: int
    state_version: int
    mutations: int
    variables: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]]
    dedup: dict[str, Any]
    taken_at: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, arrays in self.variables.values() for a in arrays.values())


class ParameterStore:
    """The variables of shard ``shard_index`` of a fleet of ``num_shards``.

    All methods but the coroutines (:meth:`push_async`, :meth:`wait`, :meth:`readable`,
    :meth:`settled`) are synchronous and must be called from the event-loop thread; the
    coroutines run on that same loop. None of them blocks on I/O.
    """

    def __init__(self, shard_index: int, num_shards: int, dedup: DedupTable | None = None) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in 0..{num_shards - 1}, got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        #: Name -> variable; this one dict for good (:class:`~server.store.apply.OffLoop`
        #: reads it too).
        self._vars: dict[str, Variable] = {}
        self._nbytes = 0
        self._waiters: dict[str, set[asyncio.Event]] = {}
        #: Polls waiting for versions (POST /v1/poll): woken by every change of a version.
        self.waiters = VersionWaiters()
        self.dedup = DedupTable() if dedup is None else dedup
        self._state_version = 0
        self._off_loop = apply.OffLoop(self._vars)
        #: Changes of any kind (init included); a snapshot is due when it moved.
        self.mutations = 0
        #: How many variables are sync or bounded (a push to none of them costs one int
        #: check here), and when each open sync round times out (:meth:`close_due_rounds`).
        self._moded = 0
        self.deadlines = Deadlines()
        #: How many variables are frozen: while none is, a push looks at no variable's flag.
        self._frozen = 0
        #: Deletes so far: a push that waited for another to finish looks its names up again
        #: when this moved meanwhile.
        self._deletions = 0

    # -- names ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._vars)

    def __contains__(self, name: object) -> bool:
        return name in self._vars

    def __iter__(self) -> Iterator[Variable]:
        return iter(list(self._vars.values()))

    @property
    def nbytes(self) -> int:
        """Bytes held in values and optimizer slots, kept current (O(1))."""
        return self._nbytes

    @property
    def state_version(self) -> int:
        """The sum of every variable's version: +1 per applied change anywhere on the shard.
        It survives restarts (a restored shard comes back at its snapshot's state version)."""
        return self._state_version

    def owner(self, name: str) -> int:
        return shard_for(name, self.num_shards)

    def check_names(self, names: Iterable[Any]) -> list[str]:
        """Validate names (400) and ownership (421 with ``details.owners``) of a whole request."""
        names = list(names)
        known = self._vars
        for name in names:
            if type(name) is str and name in known:
                continue  # valid and ours: it was checked when it was created
            try:
                validate_name(name)
            except ValueError as exc:
                raise ShardError(
                    "bad_request", str(exc), {"name": name if isinstance(name, str) else repr(name)}
                ) from None
        owners = {}
        for name in names:
            if name in known:
                continue
            owner = self.owner(name)
            if owner != self.shard_index:
                owners[name] = owner
        if owners:
            first = next(iter(owners))
            raise ShardError(
                "not_owner",
                f"this is shard {self.shard_index} of {self.num_shards}; variable {first!r} "
                f"belongs to shard {owners[first]}"
                + (f" (and {len(owners) - 1} more are not ours)" if len(owners) > 1 else "")
                + ": send each variable to its owner, and check that your shard list is in "
                "fleet order",
                {"owners": owners, "shard_index": self.shard_index, "num_shards": self.num_shards},
            )
        return names

    def _checked(self, names: Iterable[Any]) -> list[Variable]:
        """The variables of ``names``, each checked as :meth:`check_names` and
        :meth:`_existing` check it (400, 421, 404), in one pass when every name is one of
        ours (the common case: a name that exists was checked when it was created)."""
        known = self._vars
        try:
            return [known[name] for name in names]
        except (KeyError, TypeError):
            return self._existing(self.check_names(names))

    def _existing(self, names: Iterable[str]) -> list[Variable]:
        found, missing = [], []
        for name in names:
            var = self._vars.get(name)
            if var is None:
                missing.append(name)
            else:
                found.append(var)
        if missing:
            raise ShardError(
                "not_found",
                f"unknown variable(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} on shard "
                f"{self.shard_index}: init them first, or wait for them (/v1/wait)",
                {"missing": missing},
            )
        return found

    def get(self, name: str) -> Variable:
        """The variable ``name``; 400/421/404 as for any verb."""
        self.check_names([name])
        return self._existing([name])[0]

    # -- writes -----------------------------------------------------------------------------

    def init(self, entries: Mapping[str, tuple[np.ndarray, Any]]) -> dict[str, dict[str, Any]]:
        """Create each variable that does not exist yet (version 0), atomically per request.

        ``entries`` maps name -> (value, optimizer wire spec or ``None``[, training mode fields
        or ``None``]). An existing variable with the same shape and dtype is left alone
        (``created: False``); another shape or dtype, or another mode than the entry states, is
        409 and nothing is created.
        """
        self.check_names(entries)
        op = operations.init(entries, self._vars)
        for var, mode in zip(apply.init(op), op.modes):
            if mode is not ASYNC:
                var.training.mode = mode
                if mode.sync is not None:
                    var.training.rounds = RoundStats()
            self._add(var)
        created = {name for name, _, _ in op.new}
        return {
            name: {"version": self._vars[name].version, "created": name in created}
            for name in op.names
        }

    def push(
        self,
        worker_id: str,
        seq: int,
        grads: Mapping[str, np.ndarray],
        versions: Mapping[str, int] | None = None,
        *,
        finite: Mapping[str, float] = _NONE,
        block: np.ndarray | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Apply one gradient per variable with the variable's optimizer, on this thread, once
        per ``(worker_id, seq)``: a seq already applied is answered ``"duplicate"``.

        Writable gradient arrays (views of a framed request's own buffer, or cast copies) may be
        overwritten as scratch space. ``finite`` maps the gradients the caller has checked for
        NaN and infinities already (:mod:`server.store.checks`) to at least their sum of
        squares; they are not checked again unless they are cast. An update whose result would
        not be finite (an overflow) is refused whole, 422, and changes nothing. ``block``: the
        gradients, when they are the rows of one array in the order of ``grads`` (a table's,
        ``wire.table_rows(..., with_block=True)``). The event loop calls :meth:`push_async`
        instead.
        """
        variables = self._checked(grads)
        apply.not_being_written(variables)
        op = operations.push(variables, worker_id, seq, grads, versions, finite, block)
        return self._push_now(op, bool(self._moded) and modes.check_request(op))

    def _push_now(self, op: operations.Push, moded: bool = False) -> dict[str, dict[str, Any]]:
        """:meth:`push` of a push built already, all of it on this thread; ``moded``: it names
        a sync or bounded variable (:func:`server.store.modes.check_request`)."""
        operations.check_values(op)
        if self._seen("push", op.worker_id, op.seq):
            return self._duplicates(op.variables)
        if self._frozen:
            self._refuse_frozen(op.variables)
        if moded:
            return self._push_moded(op)
        apply.push(op)
        return self._applied(op)

    def _push_moded(self, op: operations.Push) -> dict[str, dict[str, Any]]:
        """Step 3 and 4 of a push to sync or bounded variables (:mod:`server.store.modes`)."""
        moded = modes.plan(op)
        if moded.now is not None:
            apply.push(moded.now)  # 422 with nothing written if an update would overflow
        modes.apply(moded, time.monotonic())
        return self._moded_applied(moded)

    async def push_async(
        self,
        worker_id: str,
        seq: int,
        grads: Mapping[str, np.ndarray],
        versions: Mapping[str, int] | None = None,
        *,
        finite: Mapping[str, float] = _NONE,
        block: np.ndarray | None = None,
    ) -> dict[str, dict[str, Any]]:
        """:meth:`push` for the event loop, with big updates computed off it.

        First waits until no other push computing off the loop writes one of these variables
        (writers of a variable are serialised). Gradients of fewer than
        :data:`~server.store.apply.OFFLOAD_BYTES` in all are then applied at once, as
        :meth:`push` does; bigger ones are checked and applied in a worker thread while the
        loop goes on serving other requests (:meth:`OffLoop.push
        <server.store.apply.OffLoop.push>`). The versions move, all at once, back on the loop
        once every variable of the push is done: a pull sees the value before the push or
        after it, never a torn one.
        """
        variables = self._checked(grads)
        while True:
            deletions = self._deletions
            await self._off_loop.settled(variables)
            if self._deletions == deletions:
                break
            variables = self._checked(grads)  # a delete ran meanwhile: 404 if it was one of ours
        op = operations.push(variables, worker_id, seq, grads, versions, finite, block)
        moded = bool(self._moded) and modes.check_request(op)
        if moded or op.nbytes < apply.OFFLOAD_BYTES:  # a moded push: on the loop, whole
            return self._push_now(op, moded)
        if self._seen("push", worker_id, seq):
            return self._duplicates(variables)
        if self._frozen:
            self._refuse_frozen(variables)
        await self._off_loop.push(op)
        return self._applied(op)

    def assign(
        self, values: Mapping[str, np.ndarray], worker_id: str | None = None, seq: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """Overwrite existing variables (same shape; cast to the variable's dtype); once per
        ``(worker_id, seq)`` when both are given. On the event loop, await :meth:`settled`
        first."""
        variables = self._checked(values)
        apply.not_being_written(variables)
        op = operations.assign(variables, values, worker_id, seq)
        keyed = worker_id is not None and seq is not None
        if keyed and self._seen("assign", worker_id, seq):
            return {var.name: {"status": "duplicate", "version": var.version} for var in variables}
        apply.assign(op)
        for var in variables:
            if var.round is not None:  # its gradients were computed on the value replaced
                modes.discard(var)
                self.deadlines.remove(var.name)
            self._touch(var, worker_id)
        if keyed:
            self.dedup.record(worker_id, seq)
        return {var.name: {"status": "applied", "version": var.version} for var in variables}

    def increment(
        self,
        name: str,
        delta: int | float = 1,
        worker_id: str | None = None,
        seq: int | None = None,
        kind: str | None = None,
    ) -> dict[str, Any]:
        """Atomic fetch-and-add on a scalar; creates an ``i8`` or ``f8`` counter: of ``kind``
        (``"int"`` or ``"float"``) when given, else after the delta's type.

        ``kind`` also states what an existing counter must be (409 ``conflict`` otherwise),
        and the delta is taken as that kind (an int delta as a float; a float delta that is
        a whole number as an int, any other 400): for a client whose numbers have no such
        distinction. With ``worker_id`` and ``seq``, a retry of an increment already applied
        answers the value the first attempt got (``status: "duplicate"``) and adds nothing.
        On the event loop, await :meth:`settled` first.
        """
        self.check_names([name])
        delta = operations.increment_delta(name, delta, kind)
        keyed = worker_id is not None and seq is not None
        if keyed and self.dedup.check(worker_id, seq) != "new":
            return self._increment_retried(worker_id, seq)
        var = self._vars.get(name)
        if var is not None:
            apply.not_being_written([var])
        op = operations.increment(name, var, delta, kind, worker_id, seq)
        counter = apply.increment(op)
        if var is None:
            self._add(counter)
        elif var.round is not None:  # a sync scalar: its round was on the value replaced
            modes.discard(var)
            self.deadlines.remove(var.name)
        self._touch(counter, worker_id)
        if keyed:
            self.dedup.record(worker_id, seq, [op.value.item(), counter.version])
        return {"value": op.value.item(), "version": counter.version, "status": "applied"}

    def _increment_retried(self, worker_id: str, seq: int) -> dict[str, Any]:
        """The answer to an increment whose seq is not new: what the first attempt got, or
        409 ``seq_expired`` when that is not held any more or the seq is too old to tell."""
        earlier = self.dedup.result(worker_id, seq)
        if earlier is not None:
            self.dedup.count(worker_id, "duplicate")
            return {"value": earlier[0], "version": earlier[1], "status": "duplicate"}
        record = self.dedup.get(worker_id)
        self.dedup.count(worker_id, "expired")
        if record is not None and record.status(seq) == "duplicate":
            raise _result_dropped(worker_id, seq, record.high)
        raise _expired("increment", worker_id, seq, record.high if record else -1)

    async def set_optimizer(
        self,
        worker_id: str,
        seq: int,
        *,
        names: list[str] | None = None,
        prefix: str | None = None,
        optimizer: Any = None,
        frozen: bool | None = None,
        max_matched: int = wire.MAX_REQUEST_NAMES,
    ) -> dict[str, dict[str, Any]]:
        """Give the variables of ``names`` (400/421/404 as for a push), or every tensor
        variable whose name starts with ``prefix`` (at most ``max_matched`` of them, else
        413), the optimizer of the wire spec ``optimizer`` and/or the frozen state ``frozen``;
        once per ``(worker_id, seq)`` (docs/PROTOCOL.md §3). Coroutine: first waits until no
        push writes one of them off the loop."""
        variables = await self._settled_targets(names, prefix, max_matched, counters=False)
        op = optimizer_change.build(variables, worker_id, seq, optimizer, frozen)
        if self._seen("set_optimizer", worker_id, seq):
            return {var.name: self._optimizer_entry(var, "duplicate", None) for var in variables}
        before = sum(var.nbytes for var in variables)
        was_frozen = sum(var.frozen for var in variables)
        slots = optimizer_change.apply(op, variables)
        self._nbytes += sum(var.nbytes for var in variables) - before
        self._frozen += sum(var.frozen for var in variables) - was_frozen
        self.mutations += 1
        self.dedup.record(worker_id, seq)
        return {
            var.name: self._optimizer_entry(var, "applied", kept)
            for var, kept in zip(variables, slots)
        }

    @staticmethod
    def _optimizer_entry(var: Variable, status: str, slots: str | None) -> dict[str, Any]:
        return {
            "status": status,
            "version": var.version,
            "optimizer": var.optimizer.to_wire(),
            "optimizer_version": var.optimizer_version,
            "frozen": var.frozen,
            "slots": slots,
        }

    async def delete(
        self,
        worker_id: str,
        seq: int,
        *,
        names: list[str] | None = None,
        prefix: str | None = None,
        max_matched: int = wire.MAX_REQUEST_NAMES,
    ) -> dict[str, Any]:
        """Remove the variables of ``names`` that exist (names still checked: 400, 421), or
        every variable whose name starts with ``prefix`` (at most ``max_matched``, else 413),
        counters included; once per ``(worker_id, seq)``. 409 while a sync round is open on
        one. Coroutine: first waits until no push writes one of them off the loop."""
        variables = await self._settled_targets(
            names, prefix, max_matched, counters=True, missing_ok=True
        )
        if self._seen("delete", worker_id, seq):
            return {"status": "duplicate", "deleted": []}
        op = deletion.build(variables, worker_id, seq)
        known = self._vars
        for var in variables:
            del known[var.name]
            self._nbytes -= var.nbytes
            self._state_version -= var.version
            self._frozen -= var.frozen
            if var.mode is not ASYNC:
                self._moded -= 1
            deletion.release(var)
        self._deletions += 1
        self.mutations += 1
        self.dedup.record(worker_id, seq)
        if self.waiters.waiting:  # a poll on a deleted variable answers 404 at once
            self.waiters.wake(list(op.names))
        return {"status": "applied", "deleted": list(op.names)}

    async def _settled_targets(
        self,
        names: list[str] | None,
        prefix: str | None,
        max_matched: int,
        *,
        counters: bool,
        missing_ok: bool = False,
    ) -> list[Variable]:
        """The variables a request names (checked: 400, 421, and 404 unless ``missing_ok``,
        which leaves unknown names out) or its prefix matches (:meth:`_matching`), once no
        push writes one of them off the loop; with no ``await`` between the last look and the
        return."""
        while True:
            if prefix is not None:
                variables = self._matching(prefix, max_matched, counters)
            elif missing_ok:
                known = self._vars
                checked = self.check_names(names or [])
                variables = [known[n] for n in dict.fromkeys(checked) if n in known]
            else:
                variables = self._existing(dict.fromkeys(self.check_names(names or [])))
            if not any(var.writing is not None for var in variables):
                return variables
            await self._off_loop.settled(variables)

    def _matching(self, prefix: str, max_matched: int, counters: bool) -> list[Variable]:
        """Every variable whose name starts with ``prefix`` (tensors only, unless
        ``counters``), in the order they were made. A look at every name the shard holds: a
        prefix is for changing or removing a run, not for a training step. 400 for an empty
        prefix or one no name can start with; 413 past ``max_matched``."""
        if not prefix:
            raise ShardError(
                "bad_request",
                "an empty 'prefix' would match every variable of the fleet, so it is refused: "
                "to change or delete them all, name them (GET /v1/variables lists them)",
                {"field": "prefix"},
            )
        try:
            validate_name(prefix)
        except ValueError:
            raise ShardError(
                "bad_request",
                f"'prefix' {prefix[:40]!r}: a prefix is the start of variable names, 1-256 "
                "characters of A-Z a-z 0-9 _ . : / -",
                {"field": "prefix"},
            ) from None
        found = [
            var
            for name, var in self._vars.items()
            if name.startswith(prefix) and (counters or var.kind != "counter")
        ]
        if len(found) > max_matched:
            raise ShardError(
                "too_large",
                f"'prefix' {prefix!r} matches {len(found)} variables on shard {self.shard_index}, "
                f"more than one request may change ({max_matched}, --max-request-names): name "
                f"them in lists of at most {max_matched} (GET /v1/variables lists them)",
                {"limit": max_matched, "matched": len(found), "field": "prefix"},
            )
        return found

    def _refuse_frozen(self, variables: list[Variable]) -> None:
        """409 ``frozen`` if one of ``variables`` is frozen."""
        frozen = [var.name for var in variables if var.frozen]
        if frozen:
            raise optimizer_change.frozen_error(frozen)

    # -- reads ------------------------------------------------------------------------------

    def pull(
        self, names: Iterable[str], versions: Mapping[str, int] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Current versions and (read-only) values; a value equal to ``versions[name]`` is left
        out."""
        names = self.check_names(names)
        held = versions or {}
        out: dict[str, dict[str, Any]] = {}
        for var in self._existing(names):
            entry: dict[str, Any] = {"version": var.version}
            if held.get(var.name) != var.version:
                entry["value"] = var.export()
            out[var.name] = entry
        return out

    def pull_rows(
        self, names: Iterable[str], versions: Mapping[str, int] | list[int | None] | None = None
    ) -> PullRows:
        """:meth:`pull` as the columns of a tensor table (docs/PROTOCOL.md, pull).
        ``versions`` is a map name -> version held, or a list of them parallel to ``names``
        (``None`` where none is held)."""
        names = list(names)
        variables = self._checked(names)
        rows = PullRows(names)
        current = rows.versions = [var.version for var in variables]
        if versions is None:
            held = None
        elif isinstance(versions, list):
            held = versions
        else:
            held = [versions.get(var.name) for var in variables]
        if held is None or True not in map(operator.eq, held, current):
            # Every row gets its value (a first pull, or every one changed since): the same
            # as below, in comprehensions.
            rows.values = [var.export() for var in variables]
            metas = [var._wire or var.wire_meta() for var in variables]
            rows.dtypes = [m[0] for m in metas]
            rows.shapes = [m[1] for m in metas]
            slab = variables[0]._slab if variables else None
            if slab is not None and not slab.away and variables == slab.members:
                rows.whole = slab.whole(tuple(rows.values))
            return rows
        add_value = rows.values.append
        add_dtype, add_shape = rows.dtypes.append, rows.shapes.append
        for var, seen, version in zip(variables, held, current):
            if seen == version:
                add_value(None)
                add_dtype(None)
                add_shape(None)
            else:
                add_value(var.export())
                dtype, shape = var._wire or var.wire_meta()
                add_dtype(dtype)
                add_shape(shape)
        return rows

    async def wait(self, names: Iterable[str], timeout: float) -> dict[str, list[str]]:
        """Wait until every name exists or ``timeout`` seconds (at most 30) pass.

        Coroutine; waiters are woken only by the creation of a name they wait for.
        """
        names = self.check_names(names)
        timeout = min(max(float(timeout), 0.0), MAX_WAIT_SECONDS)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        missing = {n for n in names if n not in self._vars}
        while missing:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            event = asyncio.Event()
            for n in missing:
                self._waiters.setdefault(n, set()).add(event)
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                for n in missing:
                    waiting = self._waiters.get(n)
                    if waiting is not None:
                        waiting.discard(event)
                        if not waiting:
                            del self._waiters[n]
            missing = {n for n in missing if n not in self._vars}
        ordered = list(dict.fromkeys(names))
        return {
            "ready": [n for n in ordered if n not in missing],
            "missing": [n for n in ordered if n in missing],
        }

    # -- waits around a big push applied off the loop ---------------------------------------

    async def poll(
        self,
        names: list[str],
        versions: Mapping[str, int] | list[int | None] | None,
        min_version: int | None,
        timeout: float,
        gone: Awaitable[Any] | None = None,
    ) -> bool:
        """Wait until a poll's condition holds (:func:`server.store.waiters.poll`): one of
        ``names``' versions differs from ``versions``, or (with ``min_version``) all reached
        it. Returns whether it did; coroutine."""
        return await waiters.poll(self, names, versions, min_version, timeout, gone)

    async def settled(self, names: Iterable[str]) -> None:
        """Return once no push computing off the loop writes a variable in ``names`` (unknown
        names are ignored). The loop awaits this before a synchronous :meth:`assign` or
        :meth:`increment`, with no ``await`` in between."""
        known = self._vars
        await self._off_loop.settled([known[n] for n in names if type(n) is str and n in known])

    async def readable(self, names: Iterable[str]) -> None:
        """Return once no push is writing the live arrays of a variable in ``names`` in place
        off the loop (unknown names are ignored). The loop awaits this before reading values
        (pull, inspection), with no ``await`` between it and the read; it costs one int check
        while no such write runs (:meth:`OffLoop.readable
        <server.store.apply.OffLoop.readable>`)."""
        if self._off_loop.in_place:
            await self._off_loop.readable(names)

    def settled_now(self, names: Iterable[str]) -> bool:
        """Whether :meth:`readable` would return at once for ``names``: no push is writing one
        of them in place off the loop."""
        return self._off_loop.settled_now(names)

    # -- snapshots --------------------------------------------------------------------------

    def capture(self) -> Capture:
        """The whole state at this instant: read-only arrays no later update touches, and
        copies of the bookkeeping and the dedup table. Synchronous and cheap (no array is
        copied); call it on the event-loop thread while no update is being applied."""
        return Capture(
            shard_index=self.shard_index,
            num_shards=self.num_shards,
            state_version=self._state_version,
            mutations=self.mutations,
            variables={
                name: (var.meta(), var.snapshot_views()) for name, var in self._vars.items()
            },
            dedup=self.dedup.export(),
        )

    def restore(self, variables: Iterable[Variable], dedup: DedupTable) -> None:
        """Replace the whole state with restored ``variables`` and ``dedup`` table (at start,
        before any request is served), laid out in slabs as their init made them
        (:func:`~server.store.slab.into_slabs`). The state version becomes the sum of their
        versions; the table keeps this store's bounds (:meth:`DedupTable.bound`)."""
        self._vars.clear()
        self._nbytes = 0
        self._frozen = 0
        variables = list(variables)
        into_slabs(variables)
        self._moded = 0
        self.deadlines.clear()
        started = time.monotonic()
        for var in variables:
            self._add(var)
            if var.round is not None:  # its timeout starts again now
                var.round.opened = started
                self.deadlines.add(var.name, var.version, var.round.deadline)
        dedup.bound(self.dedup.max_workers, self.dedup.idle_seconds)
        self.dedup = dedup
        self._state_version = sum(v.version for v in self._vars.values())
        self.waiters.wake_all()

    # -- bookkeeping ------------------------------------------------------------------------

    def _add(self, var: Variable) -> None:
        self._vars[var.name] = var
        self._nbytes += var.nbytes
        self._frozen += var.frozen
        self.mutations += 1
        if var.mode is not ASYNC:
            self._moded += 1
        for event in self._waiters.pop(var.name, ()):
            event.set()

    def _touch(self, var: Variable, writer: str | None) -> None:
        var.touch(writer)
        self._state_version += 1
        self.mutations += 1
        if self.waiters.waiting:
            self.waiters.wake([var.name])

    def _applied(self, op: operations.Push) -> dict[str, dict[str, Any]]:
        """The bookkeeping of a push whose new values are in place: each version, update count
        and optimizer step count up by one, one clock reading for all, the seq recorded; the
        push's result."""
        variables, worker_id = op.variables, op.worker_id
        held = op.versions or {}
        now = time.time()
        out = {}
        worst = _NO_STALENESS  # the push's largest staleness, for the worker's window
        for var in variables:
            before = var.version
            var.version = version = before + 1
            var.updates += 1
            var.steps += 1
            var.last_update = now
            var.last_writer = worker_id
            seen = held.get(var.name)
            if seen is None:
                staleness = None
            else:
                staleness = before - seen
                if staleness > worst:
                    worst = staleness
            out[var.name] = {"status": "applied", "version": version, "staleness": staleness}
        self._state_version += len(variables)
        self.mutations += len(variables)
        self.dedup.record(worker_id, op.seq)
        self.dedup.gradients(
            worker_id, len(variables), 0, 0, 0, None if worst == _NO_STALENESS else worst
        )
        if self.waiters.waiting:
            self.waiters.wake([var.name for var in variables])
        return out

    def _moded_applied(self, moded: modes.ModedPush) -> dict[str, dict[str, Any]]:
        """The bookkeeping of a push to sync or bounded variables once written: the versions
        of those applied up by one, the rounds opened timed, the counts, the windows, the seq
        recorded; the push's result, in request order."""
        op = moded.op
        worker_id = op.worker_id
        now = time.time()
        bumped = ([] if moded.now is None else moded.now.variables) + [s.var for s in moded.scaled]
        for var in bumped:
            var.version += 1
            var.updates += 1
            var.steps += 1
            var.last_update = now
            var.last_writer = worker_id
        for j in moded.joins:
            var = j.var
            var.training.accepted += 1
            if var.round is not None and var.round.count == 1:  # opened by this push
                self.deadlines.add(var.name, var.version, var.round.deadline)
        for f in moded.fills:
            self.deadlines.remove(f.var.name)
        for var in moded.dropped:
            var.training.dropped += 1
        for s in moded.scaled:
            s.var.training.scaled += 1
        variables = self._vars
        for name, staleness in moded.staleness.items():
            var = variables[name]
            window = var.training.staleness
            if window is None:
                window = var.training.staleness = Window()
            window.add(staleness)
        out = {}
        for var in op.variables:
            entry = moded.results[var.name]
            out[var.name] = {"status": entry.pop("status"), "version": var.version, **entry}
        self._state_version += len(bumped)
        self.mutations += len(bumped) + len(moded.joins) + 1
        self.dedup.record(worker_id, op.seq)
        if bumped and self.waiters.waiting:
            self.waiters.wake([var.name for var in bumped])
        self.dedup.gradients(
            worker_id,
            len(bumped),
            len(moded.joins),
            len(moded.dropped),
            len(moded.scaled),
            max(moded.staleness.values(), default=None),
        )
        return out

    def close_due_rounds(self, now: float) -> int:
        """Close every sync round whose timeout passed by ``now`` (``time.monotonic()``):
        apply the mean of what it had, or discard it when that would not be finite; either
        way the variable's version goes up by one. Returns how many closed. Called by
        :func:`server.store.rounds.close_when_due` (the shard's app runs it) while the shard
        takes writes."""
        closed = 0
        for name, version in self.deadlines.due(now):
            var = self._vars.get(name)
            if var is None:
                continue
            close = modes.close_timed_out(var, version)
            if close is None:
                continue
            if modes.apply_close(close) == "timed_out":
                var.updates += 1
                var.steps += 1
            self._touch(var, None)
            closed += 1
        return closed

    @staticmethod
    def _duplicates(variables: Iterable[Variable]) -> dict[str, dict[str, Any]]:
        out = {}
        for var in variables:
            var.training.duplicates += 1
            out[var.name] = {"status": "duplicate", "version": var.version, "staleness": None}
        return out

    def _seen(self, verb: str, worker_id: str, seq: int) -> bool:
        """True if ``seq`` was applied already (counted as a duplicate); raises
        ``seq_expired`` when it is too old to tell."""
        outcome = self.dedup.check(worker_id, seq)
        if outcome == "new":
            return False
        self.dedup.count(worker_id, outcome)
        if outcome == "duplicate":
            return True
        record = self.dedup.get(worker_id)
        raise _expired(verb, worker_id, seq, record.high if record else -1)


def _expired(verb: str, worker_id: str, seq: int, high: int) -> ShardError:
    return ShardError(
        "seq_expired",
        f"{verb} seq {seq} of worker {worker_id!r} is too far below the highest seq this shard "
        f"applied for it ({high}) to tell whether it was applied already, so it was not applied. "
        "Two processes sharing one worker_id, or a worker restarted with its clock set back, "
        "cause this: give every worker process its own worker_id",
        {"worker_id": worker_id, "seq": seq, "high_seq": high},
    )


def _result_dropped(worker_id: str, seq: int, high: int) -> ShardError:
    return ShardError(
        "seq_expired",
        f"increment seq {seq} of worker {worker_id!r} was applied already, but this shard no "
        f"longer holds what it answered (it keeps the results of each worker's {MAX_RESULTS} "
        "highest-numbered increments), so it cannot answer the value the first attempt got; "
        "nothing was added. A worker retries an increment with the seq of that attempt, so this "
        f"means {MAX_RESULTS} or more later increments of the worker were applied first: two "
        "processes sharing one worker_id cause this; give every worker process its own",
        {"worker_id": worker_id, "seq": seq, "high_seq": high, "results_kept": MAX_RESULTS},
    )
