"""The store's changes of variables other than their values: ``set_optimizer`` and ``delete``
(docs/PROTOCOL.md §3), each naming its variables or a prefix that matches them.

Each runs a write's steps (:mod:`server.store.operations`) around an operation of its own
module: :mod:`server.store.optimizer_change` and :mod:`server.store.deletion` build and apply
it; here the targets are found (:meth:`Control._settled_targets`, once no push writes one of
them off the loop), the dedup table asked, and the shard's counts kept.

Thread-safety: none; call from one thread (the event loop's).
"""

from __future__ import annotations

from typing import Any

from client_sdk import wire
from client_sdk.modes import ASYNC
from client_sdk.placement import validate_name

from ..errors import ShardError
from . import deletion, optimizer_change
from .journal import journaled
from .state import StoreState
from .variable import Variable

__all__ = ["Control"]


class Control(StoreState):
    """The changes of optimizer, frozen state and existence of
    :class:`~server.store.verbs.ParameterStore`."""

    @journaled
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

    @journaled
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
        if prefix is not None:
            partitioned = self.layouts.matching(prefix)
        else:
            partitioned = [n for n in dict.fromkeys(names or []) if n in self.layouts]
        op = deletion.build(variables, worker_id, seq, tuple(partitioned))
        removed = self.layouts.remove(op.layouts)
        known = self._vars
        for var in variables:
            del known[var.name]
            self._nbytes -= var.nbytes
            self._state_version -= var.version
            self._frozen -= var.frozen
            if var.mode is not ASYNC:
                self._moded -= 1
            deletion.release(var)
        if variables:
            self.collector.released()
            self.groups.released(variables)
        if variables or removed:
            self._deletions += 1
        self.mutations += 1
        self.dedup.record(worker_id, seq)
        if self.waiters.waiting:  # a poll on a deleted variable answers 404 at once
            self.waiters.wake(list(op.names))
        out: dict[str, Any] = {"status": "applied", "deleted": [*op.names, *op.layouts]}
        if removed:
            out["partitioned"] = {layout.name: layout.to_wire() for layout in removed}
        return out

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
