"""One variable: its value, its bookkeeping, and whether a reader still holds the value.

A :class:`Variable` is what the store keeps per name. Its value is a native-byte-order,
C-contiguous array; its optimizer slots (``state``) sit beside it. What this module owns is the
rule that lets updates write in place without a reader ever seeing its bytes change:

* **Copy on write, only while read.** A reader gets a read-only view of the live value
  (:meth:`Variable.export`; a pull's reply may still be writing it to a socket after the handler
  returned) and the variable is marked shared. Before the next update writes, it asks whether a
  reader still holds that view or anything made from it (:meth:`Variable.held`, from reference
  counts): if one does, the update goes to fresh memory and the reader's bytes never change; if
  none does (the usual case in training: the pull finished long before the next push came), it
  writes in place, about twice as fast as writing to fresh memory. Pulls cost no copy, and an
  update after a pull no extra pass. :meth:`Variable.target` says where the next value goes;
  :meth:`Variable.replace` makes it the value.
* **Snapshots see one instant.** :meth:`Variable.snapshot_views` hands out read-only views of
  the value and the slots at once; the value's next updates go to fresh memory while they are
  held, and the slots are copied before the next update writes them
  (:meth:`Variable.own_state`).
* A variable made by one init with others of its dtype and shape lives in a row of their shared
  block of memory (:mod:`server.store.slab`): it leaves the row while a reader holds it and comes
  back at the first update after every reader let go.

What changes a variable is :mod:`server.store.apply`; this module only says where a new value
may go. Not thread-safe: the event-loop thread only (a big push's worker thread writes the arrays
it was given, never these fields).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from client_sdk.modes import ASYNC, Mode
from client_sdk.optimizers import Optimizer

from .. import optim
from .rounds import Round, RoundStats
from .slab import Slab
from .staleness import EMPTY, Window

__all__ = ["REFCOUNTS", "Variable", "export_all", "none_held"]

#: Whether reference counts can tell that no reader holds a value any more (CPython's are
#: exact). Elsewhere a value, once handed out, counts as held until an update replaces it.
REFCOUNTS = sys.implementation.name == "cpython" and hasattr(sys, "getrefcount")


_refs = sys.getrefcount  # (obj) -> int; as an alias, not a wrapper: one call less per use


class _Holder:
    obj: object


def _refs_of_attribute() -> int:
    """What :func:`_refs` says of an object that one attribute holds, and nothing else."""
    holder = _Holder()
    holder.obj = object()
    return _refs(holder.obj)


_HELD_ONCE = _refs_of_attribute() if REFCOUNTS else 0


@dataclass(eq=False, slots=True)
class Training:
    """A variable's training mode and what the mode keeps (:mod:`server.store.modes`)."""

    mode: Mode = ASYNC
    #: A sync variable's open round, or None; and its closed rounds (None for a variable of
    #: another mode).
    round: Round | None = None
    rounds: RoundStats | None = None
    #: Gradients dropped by the mode, applied with a scaled step, accepted into a round, and
    #: retries answered ``"duplicate"`` (applied ones: the variable's ``updates``, or a sync
    #: variable's ``rounds.gradients``).
    dropped: int = 0
    scaled: int = 0
    accepted: int = 0
    duplicates: int = 0
    #: A sync or bounded variable's staleness of its latest gradients that had one (made at
    #: the first; an async variable keeps none: its pushes' bookkeeping is the hot path).
    staleness: Window | None = None


@dataclass(eq=False)
class Variable:
    """One variable: its value (native byte order, C-contiguous) and bookkeeping.

    ``version`` goes up by one per applied change (push, assign, increment); ``updates`` counts
    applied gradients only; ``steps`` counts the gradients the current optimizer has applied
    (its next update is number ``steps + 1``: Adam's bias correction and the learning-rate
    schedules read it; a change of optimizer type starts it again at 0). ``kind`` is
    ``"tensor"`` (made by init) or ``"counter"`` (made by increment). ``optimizer_version`` goes
    up by one per change of the optimizer or of ``frozen`` (set_optimizer,
    :mod:`server.store.optimizer_change`); a frozen variable refuses pushes.
    """

    name: str
    value: np.ndarray
    optimizer: Optimizer
    state: dict[str, np.ndarray]
    kind: str = "tensor"
    version: int = 0
    updates: int = 0
    steps: int = 0
    created_at: float = field(default_factory=time.time)
    last_update: float | None = None
    last_writer: str | None = None
    optimizer_version: int = 0
    frozen: bool = False
    shared: bool = False
    state_shared: bool = False
    #: At least the largest magnitude in the value, and in its optimizer slots (Adagrad's
    #: accumulator): what a push's update provably keeps finite is told from these
    #: (:func:`server.store.bounds.bounds_after`); ``inf``: not known, so the next push
    #: computes its update into fresh memory and checks it.
    bound: float = field(default=math.inf, repr=False)
    slot_bound: float = field(default=math.inf, repr=False)
    #: Set while a push computes this variable's next value off the event loop (resolved when
    #: it is done): other writers wait for it (:class:`server.store.apply.OffLoop`).
    writing: asyncio.Future | None = field(default=None, repr=False)
    #: True while that push writes the live arrays themselves (in place, off the loop):
    #: readers wait for ``writing`` too (:meth:`server.store.apply.OffLoop.readable`).
    in_place: bool = field(default=False, repr=False)
    #: How many readers wait for that in-place write to end.
    readers_waiting: int = field(default=0, repr=False)
    #: The read-only view :meth:`export` hands out, made once per value.
    _view: np.ndarray | None = field(default=None, repr=False)
    #: ``(dtype type string, shape list)`` as a tensor table row carries them (made once: a
    #: variable's dtype and shape never change). Shared by every reply: do not modify.
    _wire: tuple[str, list[int]] | None = field(default=None, repr=False)
    #: The slab whose row ``_row`` is this variable's home (values made by one init, see
    #: :class:`~server.store.slab.Slab`), or None.
    _slab: Slab | None = field(default=None, repr=False)
    _row: int = field(default=0, repr=False)
    #: While the value is away from its row: a weak reference to the row's last value (dead
    #: once no reader holds it, and the row is free again).
    _gone: weakref.ref | None = field(default=None, repr=False)
    #: Its training mode and what the mode keeps (:class:`Training`): one attribute, so that
    #: a variable's instance dict stays small enough for CPython's fast attribute access,
    #: which the push's hot path reads a dozen times per variable.
    training: Training = field(default_factory=lambda: Training(), repr=False)

    @property
    def mode(self) -> Mode:
        """How the variable takes gradients (docs/PROTOCOL.md §3, Training modes): async, sync
        rounds or bounded staleness; fixed at init (:mod:`server.store.modes`)."""
        return self.training.mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        self.training.mode = mode

    @property
    def round(self) -> Round | None:
        """A sync variable's open round (:class:`~server.store.rounds.Round`), or None."""
        return self.training.round

    @round.setter
    def round(self, value: Round | None) -> None:
        self.training.round = value

    @property
    def nbytes(self) -> int:
        return self.value.nbytes + optim.state_nbytes(self.state)

    def export(self) -> np.ndarray:
        """A read-only view of the current value; no write touches its memory while anyone
        holds the view (or anything made from it)."""
        self.shared = True
        view = self._view
        if view is None:
            view = self._view = self.value.view()
            view.flags.writeable = False
        return view

    def held(self) -> bool:
        """True if a reader may still hold the current value: the view :meth:`export` handed
        out (or :meth:`snapshot_views`'s views) is referenced from anywhere but this variable, or
        anything made from it (a memoryview waiting to be written to a socket, a numpy view,
        whose base is the value itself). CPython-specific (reference counts; see
        :data:`REFCOUNTS`): elsewhere, True once the value was handed out."""
        if not self.shared:
            return False
        if not REFCOUNTS:
            return True
        # No local names for the arrays here: each would add a reference of its own.
        if self._view is not None and _refs(self._view) > _HELD_ONCE:
            return True
        return _refs(self.value) > _HELD_ONCE + (self._view is not None)

    def target(self) -> np.ndarray:
        """Where the next value goes: the value's own buffer, or fresh memory if a reader
        still holds the current one (:meth:`held`); for a variable away from its slab row
        that no reader holds any more, that row. Pass it to the update, then :meth:`replace`
        with it."""
        if self.shared and not self.held():
            self.shared = False
        if self.shared or self.row_free():
            return self.elsewhere()
        return self.value

    def row_free(self) -> bool:
        """Whether the value is away from its slab row and no reader holds that row any more
        (the next value goes there)."""
        gone = self._gone
        return gone is not None and gone() is None

    def elsewhere(self) -> np.ndarray:
        """Memory for the next value other than the current value's: the variable's slab row
        when :meth:`row_free`, else fresh memory."""
        if self.row_free():
            return self._slab.row(self._row, self.value.dtype, self.value.shape)
        return np.empty_like(self.value)

    def wire_meta(self) -> tuple[str, list[int]]:
        """The value's dtype type string and shape list, for tensor tables."""
        meta = self._wire
        if meta is None:
            meta = self._wire = (self.value.dtype.str, list(self.value.shape))
        return meta

    def replace(self, new: np.ndarray) -> None:
        """Make ``new`` the value (after an update into it: the value's own buffer when the
        update went in place, else fresh memory, or the variable's slab row)."""
        if new is not self.value:
            slab = self._slab
            if slab is not None:
                if self._gone is None:  # leaves its row, which a reader holds
                    self._gone = weakref.ref(self.value)
                    slab.away += 1
                elif slab.owns(new):  # back home
                    self._gone = None
                    slab.away -= 1
            self.value = new
            self._view = None
        # else: updated in place, so no reader held the value (see target) and the read-only
        # view export() made of it can be handed out again, rather than making a view and
        # flagging it read-only per variable and pull after every push.
        self.shared = False

    def own_state(self) -> dict[str, np.ndarray]:
        """The optimizer slots, copied first if a snapshot still reads the current ones."""
        if self.state_shared:
            self.state = {k: a.copy() for k, a in self.state.items()}
            self.state_shared = False
        return self.state

    def snapshot_views(self) -> dict[str, np.ndarray]:
        """Read-only views of the value (key ``"value"``), the optimizer slots and an open sync
        round's sum (key ``"round"``), which no later update touches while they are held (the
        value's next updates go to fresh memory while they are; the slots are copied at the
        next update, the sum added into fresh memory)."""
        out = {"value": self.export()}
        for slot, a in self.state.items():
            view = a.view()
            view.flags.writeable = False
            out[slot] = view
        self.state_shared = bool(self.state)
        if self.round is not None:
            out["round"] = self.round.frozen()
        return out

    def training_summary(self) -> dict[str, Any]:
        """What ``GET /v1/variables/{name}`` shows of its gradients (docs/PROTOCOL.md §4):
        ``counts``; for a sync or bounded variable ``staleness`` percentiles; for a sync one
        ``round`` and ``rounds``."""
        out: dict[str, Any] = {"counts": self.counts()}
        t = self.training
        if t.mode is not ASYNC:
            out["staleness"] = dict(EMPTY) if t.staleness is None else t.staleness.summary()
        if t.mode.sync is not None:
            out["round"] = None if t.round is None else t.round.summary(time.monotonic())
            out["rounds"] = (t.rounds or RoundStats()).summary()
        return out

    def counts(self) -> dict[str, int]:
        """What became of its gradients (docs/PROTOCOL.md §4)."""
        t = self.training
        return {
            "applied": self.updates if t.rounds is None else t.rounds.gradients,
            "accepted": t.accepted,
            "dropped": t.dropped,
            "scaled": t.scaled,
            "duplicate": t.duplicates,
        }

    def meta(self) -> dict[str, Any]:
        """The bookkeeping a snapshot keeps besides the arrays."""
        return {
            "kind": self.kind,
            "dtype": self.value.dtype.str,
            "shape": list(self.value.shape),
            "version": self.version,
            "updates": self.updates,
            "steps": self.steps,
            "optimizer": self.optimizer.to_wire(),
            "optimizer_version": self.optimizer_version,
            "frozen": self.frozen,
            "created_at": self.created_at,
            "last_update": self.last_update,
            "last_writer": self.last_writer,
            **self._mode_meta(),
        }

    def _mode_meta(self) -> dict[str, Any]:
        """A snapshot's fields of the training mode (docs/PROTOCOL.md §5): none for an async
        variable that no mode counted anything of."""
        out: dict[str, Any] = self.mode.to_wire()
        counts = self.counts()
        del counts["applied"]
        if out or any(counts.values()):
            out["counts"] = counts
        if self.training.rounds is not None:
            out["rounds"] = self.training.rounds.summary()
        if self.round is not None:
            out["round"] = self.round.meta()
        return out

    def touch(self, writer: str | None = None) -> None:
        self.version += 1
        self.last_update = time.time()
        if writer is not None:
            self.last_writer = writer

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.value.shape),
            "dtype": self.value.dtype.str,
            "version": self.version,
            "updates": self.updates,
            "steps": self.steps,
            "optimizer": self.optimizer.to_wire(),
            "optimizer_version": self.optimizer_version,
            "frozen": self.frozen,
            "created_at": self.created_at,
            "last_update": self.last_update,
            "last_writer": self.last_writer,
            "nbytes": self.value.nbytes,
            **self.mode.summary(),
        }


def none_held(variables: list[Variable]) -> bool:
    """Whether no reader holds the value of any of ``variables``: :meth:`Variable.held` for
    many at once, the same reference counts read without a method call per variable (a step
    group's push asks it of every member of a slab). Each one found not held is marked not
    shared, as :meth:`Variable.target` does; stops at the first one held."""
    if not REFCOUNTS:
        return not any(var.shared for var in variables)
    refs, once = _refs, _HELD_ONCE
    for var in variables:
        if var.shared:
            # No local names for the arrays here: each would add a reference of its own.
            if var._view is not None:
                if refs(var._view) > once or refs(var.value) > once + 1:
                    return False
            elif refs(var.value) > once:
                return False
            var.shared = False
    return True


def export_all(variables: list[Variable]) -> list[np.ndarray]:
    """:meth:`Variable.export` of each of ``variables``, in order, without a method call per
    variable where the read-only view is made already (a step group's pull exports every
    member of a slab)."""
    out = []
    for var in variables:
        var.shared = True
        view = var._view
        out.append(view if view is not None else var.export())
    return out
