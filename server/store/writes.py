"""The store's writes of values: ``init``, ``push``, ``assign`` and ``increment``
(docs/PROTOCOL.md §3), and the close of sync rounds that timed out.

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

A push to sync or bounded variables goes through :mod:`server.store.modes` between building
and counting; a big push is applied off the loop (:meth:`Writes.push_async`).

Thread-safety: none; call from one thread (the event loop's).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from client_sdk.modes import ASYNC

from ..errors import ShardError
from . import apply, layouts, modes, operations, optimizer_change
from .dedup import MAX_RESULTS
from .groups import Group, GroupGrads, RowsApplied
from .journal import journaled
from .rounds import RoundStats
from .staleness import Window
from .state import StoreState, seq_expired
from .variable import Variable

__all__ = ["Writes"]

#: Below any staleness (a version is at most 2**63 - 1).
_NO_STALENESS = -(1 << 64)
#: No gradient checked already (:meth:`Writes.push`'s ``finite``).
_NONE: Mapping[str, float] = MappingProxyType({})


class Writes(StoreState):
    """The writes of :class:`~server.store.verbs.ParameterStore`."""

    @journaled
    def init(
        self,
        entries: Mapping[str, tuple[np.ndarray, Any]],
        partitioned: Mapping[str, Any] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Create each variable that does not exist yet (version 0), atomically per request.

        ``entries`` maps name -> (value, optimizer wire spec or ``None``[, training mode fields
        or ``None``]). An existing variable with the same shape and dtype is left alone
        (``created: False``); another shape or dtype, or another mode than the entry states, is
        409 and nothing is created. ``partitioned`` maps names to the layouts of partitioned
        variables to record (:mod:`server.store.layouts`), checked with the rest.
        """
        self.check_names([*entries, *(partitioned or ())])
        if self.embedding_tables:
            tables = [n for n in [*entries, *(partitioned or ())] if n in self.embedding_tables]
            if tables:
                raise ShardError(
                    "conflict",
                    f"{tables[0]!r} is an embedding table: a name is a variable or a table, "
                    "never both; init the variable under another name",
                    {"name": tables[0], "kind": "embedding_table"},
                )
        made = layouts.create(partitioned, self.layouts, self._vars) if partitioned else None
        if self.layouts:
            layouts.refuse_plain(entries, self.layouts)
        op = operations.init(entries, self._vars)
        if made is not None:
            self.layouts.apply(made)
            self.mutations += 1
            for layout in made.new:
                for event in self._waiters.pop(layout.name, ()):
                    event.set()
        for var, mode in zip(apply.init(op), op.modes):
            if mode is not ASYNC:
                var.training.mode = mode
                if mode.sync is not None:
                    var.training.rounds = RoundStats()
            self._add(var)
        created = {name for name, _, _ in op.new}
        out = {
            name: {"version": self._vars[name].version, "created": name in created}
            for name in op.names
        }
        if made is not None:
            new = {layout.name for layout in made.new}
            for name in made.names:
                parts = self.layouts.get(name).parts  # type: ignore[union-attr]
                out[name] = {"version": 0, "created": name in new, "partitions": parts}
        return out

    @journaled
    def push(
        self,
        worker_id: str,
        seq: int,
        grads: Mapping[str, np.ndarray],
        versions: Mapping[str, int] | None = None,
        *,
        finite: Mapping[str, float] = _NONE,
        block: np.ndarray | None = None,
        group: Group | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Apply one gradient per variable with the variable's optimizer, on this thread, once
        per ``(worker_id, seq)``: a seq already applied is answered ``"duplicate"``.

        Writable gradient arrays (views of a framed request's own buffer, or cast copies) may be
        overwritten as scratch space. ``finite`` maps the gradients the caller has checked for
        NaN and infinities already (:mod:`server.store.checks`) to at least their sum of
        squares; they are not checked again unless they are cast. An update whose result would
        not be finite (an overflow) is refused whole, 422, and changes nothing. ``block``: the
        gradients, when they are the rows of one array in the order of ``grads`` (a table's,
        ``wire.table_rows(..., with_block=True)``). ``group``: the step group whose gradients
        these are (``grads`` its :class:`~server.store.groups.GroupGrads`), a hint the journal
        leaves out: while the group is current its variables and their fit were checked when it
        was made, so they are not looked up nor checked one by one again. The event loop calls
        :meth:`push_async` instead.
        """
        variables = self._fitted(group) or self._checked(grads)
        if self._off_loop.writing:
            apply.not_being_written(variables)
        op = self._build_push(variables, worker_id, seq, grads, versions, finite, block, group)
        return self._push_now(op, bool(self._moded) and modes.check_request(op))

    def _fitted(self, group: Group | None) -> list[Variable] | None:
        """``group``'s variables if it is current and pushable (every name holds the variable
        it held when the group was made, all of one float dtype), else None."""
        if (
            group is None
            or not group.pushable
            or group.gone is not None
            or group.checked_at != (self._deletions, self.restores)
        ):
            return None
        return group.variables

    def _build_push(
        self,
        variables: list[Variable],
        worker_id: str,
        seq: int,
        grads: Mapping[str, np.ndarray],
        versions: Mapping[str, int] | None,
        finite: Mapping[str, float],
        block: np.ndarray | None,
        group: Group | None,
    ) -> operations.Push:
        """The push's operation: a current group's rows as they are (:func:`operations.push_fitted
        <server.store.operations.push_fitted>`), else each gradient looked up and checked."""
        if isinstance(grads, GroupGrads) and variables is self._fitted(group):
            rows = grads.ordered()
            return operations.push_fitted(variables, worker_id, seq, rows, versions, finite, block)
        return operations.push(variables, worker_id, seq, grads, versions, finite, block)

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

    @journaled
    async def push_async(
        self,
        worker_id: str,
        seq: int,
        grads: Mapping[str, np.ndarray],
        versions: Mapping[str, int] | None = None,
        *,
        finite: Mapping[str, float] = _NONE,
        block: np.ndarray | None = None,
        group: Group | None = None,
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
        variables = self._fitted(group) or self._checked(grads)
        while True:
            deletions = self._deletions
            await self._off_loop.settled(variables)
            if self._deletions == deletions:
                break
            variables = self._checked(grads)  # a delete ran meanwhile: 404 if it was one of ours
        op = self._build_push(variables, worker_id, seq, grads, versions, finite, block, group)
        moded = bool(self._moded) and modes.check_request(op)
        if moded or op.nbytes < apply.OFFLOAD_BYTES:  # a moded push: on the loop, whole
            return self._push_now(op, moded)
        if self._seen("push", worker_id, seq):
            return self._duplicates(variables)
        if self._frozen:
            self._refuse_frozen(variables)
        await self._off_loop.push(op)
        return self._applied(op)

    @journaled
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

    @journaled
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
        self.layouts.refuse([name])
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
        raise seq_expired("increment", worker_id, seq, record.high if record else -1)

    def _refuse_frozen(self, variables: list[Variable]) -> None:
        """409 ``frozen`` if one of ``variables`` is frozen."""
        frozen = [var.name for var in variables if var.frozen]
        if frozen:
            raise optimizer_change.frozen_error(frozen)

    # -- counting -------------------------------------------------------------------------

    def _applied(self, op: operations.Push) -> dict[str, dict[str, Any]]:
        """The bookkeeping of a push whose new values are in place: each version, update count
        and optimizer step count up by one, one clock reading for all, the seq recorded; the
        push's result."""
        if op.fitted:
            return self._rows_applied(op)
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

    def _rows_applied(self, op: operations.Push) -> RowsApplied:
        """:meth:`_applied` for a step group's push (``op.fitted``): the same bookkeeping,
        with no object made per variable (the result is a :class:`RowsApplied`) and the
        push's largest staleness taken over the versions as one array."""
        variables, worker_id = op.variables, op.worker_id
        now = time.time()
        for var in variables:
            var.version += 1
            var.updates += 1
            var.steps += 1
            var.last_update = now
            var.last_writer = worker_id
        count = len(variables)
        versions = [var.version for var in variables]
        result = RowsApplied(variables, versions, op.versions)
        self._state_version += count
        self.mutations += count
        self.dedup.record(worker_id, op.seq)
        self.dedup.gradients(worker_id, count, 0, 0, 0, result.worst())
        if self.waiters.waiting:
            self.waiters.wake([var.name for var in variables])
        return result

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
        takes writes. The clock only picks the rounds: closing them is :meth:`close_rounds`,
        a write of its own (:mod:`server.store.journal`)."""
        due = self.deadlines.due(now)
        return self.close_rounds(due) if due else 0

    @journaled
    def close_rounds(self, due: Iterable[tuple[str, int] | list[Any]]) -> int:
        """Close the sync rounds ``due`` names, ``(name, version)`` each (found due by
        :meth:`close_due_rounds`), as a timeout does; a round that is not open any more at that
        version is left alone. Returns how many closed."""
        closed = 0
        for name, version in due:
            self.deadlines.remove(name, version)  # (a replica replaying the close)
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
