"""The variables one shard owns, and the verbs that read and change them. No HTTP in here.

:class:`ParameterStore` implements ``init``, ``pull``, ``push``, ``assign``, ``increment`` and
``wait`` (docs/PROTOCOL.md §3) as plain methods on decoded arguments. Refusals are
:class:`~server.errors.ShardError` with the protocol's codes.

Rules every verb keeps:

* **Validate the whole request, then apply it.** A verb checks every name (valid, owned, known),
  every tensor (dtype, shape, finite) and every option before it changes anything, so a refused
  request leaves no trace. That includes what a push's update makes: each variable keeps a
  bound on its magnitudes (:attr:`Variable.bound`), from which a few float operations tell
  that an update stays finite (:func:`_bounds_after`); one they cannot vouch for is computed
  into fresh memory and checked first (:func:`_checked_update`), so an update that would
  overflow is refused (422) with nothing written.
* **No torn reads.** Live arrays (values and optimizer slots) are written on the event-loop
  thread with no ``await`` between validation and the last write, so no other request
  observes a half-applied update; or, for a big push (:meth:`ParameterStore.push_async`), in
  a worker thread while every reader of those variables waits for it
  (:meth:`ParameterStore.readable`), at most one such push each. A big push whose value a
  reader still holds (or waits for) is computed in the thread into fresh buffers instead,
  which replace the live ones on the loop, all at once. Meanwhile its variables are marked as
  being written, and other writers of them wait (:meth:`ParameterStore.settled`), so no
  update is lost either. Thread-safety: none — call from one thread (the loop's).
* **Copy on write, only while read.** ``pull`` hands out a read-only view of the live value (it
  may still be being written to a socket after the handler returns) and marks the variable
  shared. The next update of a shared variable first asks whether a reader still holds that
  view, or anything made from it (:meth:`Variable.held`): if one does (a response in flight, a
  snapshot being written), the result goes to a fresh buffer, so the reader's bytes never
  change; if none does (the usual case in training: the pull finished long before the next
  push came), the update writes in place, about twice as fast as writing to fresh
  memory. Pulls cost no copy at all, and an update after a pull no extra pass.
* **Values made together live together.** The same-shaped variables of one init (a model's
  layers of one shape, a step's many small tensors) share one block of memory, side by side
  in the order named (:class:`_Slab`; also after a restore). A pull of all of them in that
  order writes the block as one buffer, a push to all of them is one update of the block.
  A value a reader holds while it must change moves to fresh memory and comes back to its
  row at the first update after the reader let go; meanwhile both are kept (at most twice
  the slab's bytes).
* **Work proportional to the request**, never to the number of variables the shard holds
  (``bytes`` and counts are kept up to date, not recomputed).
* **Applied once.** A write that carries ``worker_id`` and ``seq`` is checked against the
  :class:`~server.store.dedup.DedupTable` after validation: a seq already applied is answered
  ``"duplicate"`` and changes nothing (a retried increment gets the value it got the first
  time, while the shard still holds that result: ``dedup.MAX_RESULTS`` per worker); a seq too
  old to tell, or an increment's whose result is no longer held, is refused (409
  ``seq_expired``).
* **Snapshots see one instant.** :meth:`ParameterStore.capture` takes read-only views of every
  value and optimizer slot at once and marks them shared, so while the snapshot is written the
  updates go to fresh memory (as while a pull's reply is in flight) and the writer reads a
  state no update touches.
"""

from __future__ import annotations

import asyncio
import math
import operator
import sys
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from client_sdk.optimizers import SGD, Add, Optimizer, from_wire
from client_sdk.placement import shard_for, validate_name

from .. import optim
from ..errors import ShardError
from .dedup import MAX_RESULTS, DedupTable

__all__ = [
    "COUNTER_KINDS",
    "DEFAULT_OPTIMIZER",
    "MAX_WAIT_SECONDS",
    "OFFLOAD_BYTES",
    "Capture",
    "ParameterStore",
    "PullRows",
    "Variable",
]

DEFAULT_OPTIMIZER: Optimizer = SGD(lr=0.01)
MAX_WAIT_SECONDS = 30.0
#: The kinds of counter an increment may ask for (``"kind"``): int64 or float64.
COUNTER_KINDS = ("int", "float")
#: A push whose gradients hold at least this many bytes is checked and applied off the event
#: loop, in a worker thread (:meth:`ParameterStore.push_async`). Smaller ones are checked and
#: applied on it: for them the hand-off and the fresh buffers cost more than the loop gains by
#: not doing the arithmetic, both for one push and for a shard serving several workers.
OFFLOAD_BYTES = 16 << 20
#: Same-shaped variables of one init share a slab when each holds at most this many bytes.
#: What a slab saves is per variable (a buffer in a reply's write, a numpy call in a push),
#: nothing next to moving a bigger value; and a value that moves away from
#: its row while a reader holds it keeps both until it comes back (:class:`_Slab`).
SLAB_ROW_BYTES = 1 << 20
#: No gradient checked already (:meth:`ParameterStore.push`'s ``finite``).
_NONE: Mapping[str, float] = MappingProxyType({})


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


class _Mem:
    """Memory that arrays are made over (numpy's array interface), kept alive by ``owner``.
    An array made over it has this object as its ``base``, so the arrays made from that array
    point at *it* (numpy collapses a view's base only through arrays): its reference count
    still tells whether a reader holds it (:meth:`Variable.held`), as for an array that owns
    its memory."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(
        self, address: int, shape: tuple[int, ...], typestr: str, readonly: bool, owner: object
    ) -> None:
        self.__array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (address, readonly),
            "version": 3,
        }
        self.owner = owner


class _Slab:
    """One block of memory for the values of the same-shaped variables one init made, in the
    order it named them, one right after another: as a packed table lays out its rows
    (docs/PROTOCOL.md §2), so a pull of all of them, in that order, writes the block as one
    buffer instead of one per variable (the kernel's send costs per buffer).

    A variable's home is its row. An update that must not write in place (a reader holds the
    value, or a big push computes it off the loop into new memory while readers go on reading
    the old value: Adagrad's) moves the value to fresh memory and the variable is *away*; the
    first update after every reader of the row has let go of it brings the value home again
    (:meth:`Variable.target`). The block goes out whole only while every member is home."""

    __slots__ = ("memory", "address", "stride", "members", "away", "_rows")

    def __init__(self, count: int, stride: int) -> None:
        self.memory = np.empty(count * stride, np.uint8)
        self.address = self.memory.ctypes.data
        self.stride = stride
        self.members: list[Variable] = []
        self.away = 0
        self._rows: np.ndarray | None = None

    def rows(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Every row at once, writable, as one ``(members, *shape)`` array (for an update of
        all the members together; it holds no member's value, so it never counts as a
        reader)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = self.memory.view(dtype).reshape(len(self.members), *shape)
        return rows

    def row(self, i: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The writable array over row ``i``."""
        return np.asarray(_Mem(self.address + i * self.stride, shape, dtype.str, False, self))

    def whole(self, views: tuple[np.ndarray, ...]) -> np.ndarray:
        """The block, read-only bytes, holding ``views`` (the members' exported values, in
        order) for as long as it lives: while a reply writes it, every member counts as held
        and no update writes its row."""
        return np.asarray(_Mem(self.address, (len(views) * self.stride,), "|u1", True, views))


@dataclass(eq=False)
class Variable:
    """One variable: its value (native byte order, C-contiguous) and bookkeeping.

    ``version`` goes up by one per applied change (push, assign, increment); ``updates`` counts
    applied gradients only. ``kind`` is ``"tensor"`` (made by init) or ``"counter"`` (made by
    increment).
    """

    name: str
    value: np.ndarray
    optimizer: Optimizer
    state: dict[str, np.ndarray]
    kind: str = "tensor"
    version: int = 0
    updates: int = 0
    created_at: float = field(default_factory=time.time)
    last_update: float | None = None
    last_writer: str | None = None
    shared: bool = False
    state_shared: bool = False
    #: At least the largest magnitude in the value, and in its optimizer slots (Adagrad's
    #: accumulator): what a push's update provably keeps finite is told from these
    #: (:func:`_bounds_after`); ``inf``: not known, so the next push computes its update into
    #: fresh memory and checks it.
    bound: float = field(default=math.inf, repr=False)
    slot_bound: float = field(default=math.inf, repr=False)
    #: Set while a push computes this variable's next value off the event loop (resolved when
    #: it is done): other writers wait for it.
    writing: asyncio.Future | None = field(default=None, repr=False)
    #: True while that push writes the live arrays themselves (in place, off the loop):
    #: readers wait for ``writing`` too (:meth:`ParameterStore.readable`).
    in_place: bool = field(default=False, repr=False)
    #: How many readers wait (:meth:`ParameterStore.readable`) for that in-place write to end.
    readers_waiting: int = field(default=0, repr=False)
    #: The read-only view :meth:`export` hands out, made once per value.
    _view: np.ndarray | None = field(default=None, repr=False)
    #: ``(dtype type string, shape list)`` as a tensor table row carries them (made once: a
    #: variable's dtype and shape never change). Shared by every reply: do not modify.
    _wire: tuple[str, list[int]] | None = field(default=None, repr=False)
    #: The slab whose row ``_row`` is this variable's home (values made by one init, see
    #: :class:`_Slab`), or None.
    _slab: _Slab | None = field(default=None, repr=False)
    _row: int = field(default=0, repr=False)
    #: While the value is away from its row: a weak reference to the row's last value (dead
    #: once no reader holds it, and the row is free again).
    _gone: weakref.ref | None = field(default=None, repr=False)

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
        out (or :meth:`frozen`'s views) is referenced from anywhere but this variable, or
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
                elif type(new.base) is _Mem and new.base.owner is slab:  # back home
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

    def frozen(self) -> dict[str, np.ndarray]:
        """Read-only views of the value (key ``"value"``) and the optimizer slots, which no
        later update touches while they are held (the value's next updates go to fresh memory
        while they are; the slots are copied at the next update)."""
        out = {"value": self.export()}
        for slot, a in self.state.items():
            view = a.view()
            view.flags.writeable = False
            out[slot] = view
        self.state_shared = bool(self.state)
        return out

    def meta(self) -> dict[str, Any]:
        """The bookkeeping a snapshot keeps besides the arrays."""
        return {
            "kind": self.kind,
            "dtype": self.value.dtype.str,
            "shape": list(self.value.shape),
            "version": self.version,
            "updates": self.updates,
            "optimizer": self.optimizer.to_wire(),
            "created_at": self.created_at,
            "last_update": self.last_update,
            "last_writer": self.last_writer,
        }

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
            "optimizer": self.optimizer.to_wire(),
            "created_at": self.created_at,
            "last_update": self.last_update,
            "last_writer": self.last_writer,
            "nbytes": self.value.nbytes,
        }


class PullRows:
    """A pull as parallel lists, one row per name: the checked ``names``, their current
    ``versions``, and per row the read-only value with its ``dtypes`` type string and
    ``shapes`` list, or ``None`` in all three where the puller holds the current version."""

    __slots__ = ("names", "versions", "values", "dtypes", "shapes", "whole")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        #: When the rows are every member of one slab, in its order, all home and all sent:
        #: their bytes as one buffer, laid out as a packed table's rows (:meth:`_Slab.whole`).
        self.whole: np.ndarray | None = None
        self.versions: list[int] = []
        self.values: list[np.ndarray | None] = []
        self.dtypes: list[str | None] = []
        self.shapes: list[list[int] | None] = []


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (``>f4`` -> ``<f4`` on x86)."""
    return dtype.newbyteorder("=")


#: f2 arrays up to this many elements are checked with a temporary (cheaper per call than the
#: sum).
SMALL_CHECK = 1 << 16


def all_finite(a: np.ndarray) -> bool:
    """True if ``a`` has no NaN or infinity. One streaming pass, no array-sized temporary in
    the common case: a reduction that any NaN or infinity carries through is finite exactly
    when no element is non-finite, unless it overflowed, which the exact fallback settles.
    For f4 and f8 the reduction is the dot product of ``a`` with itself (BLAS, one thread in a
    shard: quicker than ``isfinite().all()`` for small arrays and than numpy's pairwise sum
    for big ones); for f2 (no BLAS) the sum,
    or for small arrays ``isfinite().all()``. The dot may warn when it overflows: call it
    under ``np.errstate(all="ignore")`` (the store does, once per request)."""
    dtype = a.dtype
    if dtype.kind != "f" or a.size == 0:
        return True
    if dtype.itemsize >= 4:  # BLAS raises no floating-point warnings: no errstate needed
        flat = a if a.ndim == 1 else a.reshape(-1)
        total = float(np.dot(flat, flat))
    elif a.size <= SMALL_CHECK:
        return bool(np.isfinite(a).all())
    else:
        with np.errstate(all="ignore"):
            total = float(np.add.reduce(a, axis=None))
    if math.isfinite(total):
        return True
    return bool(np.isfinite(a).all())


def finite_squares(a: np.ndarray) -> float | None:
    """None if ``a`` has a NaN or an infinity; else at least its sum of squares (exact for f4
    and f8 up to rounding, the same pass as :func:`all_finite`'s; ``inf`` where it is not
    known: f2, integers, or an overflow). The dot may warn when it overflows: call it under
    ``np.errstate(all="ignore")``."""
    dtype = a.dtype
    if dtype.kind != "f":
        return math.inf
    if a.size == 0:
        return 0.0
    if dtype.itemsize >= 4:
        flat = a if a.ndim == 1 else a.reshape(-1)
        total = float(np.dot(flat, flat))
        if math.isfinite(total):
            return total
    return math.inf if all_finite(a) else None


def _finite_quiet(a: np.ndarray) -> bool:
    """:func:`all_finite` without its overflow warning, for callers outside a loop that
    silences floating-point errors once for many arrays (as push does)."""
    with np.errstate(all="ignore"):
        return all_finite(a)


def _tensor_error(name: str, message: str, **details: Any) -> ShardError:
    return ShardError("bad_tensor", f"{name}: {message}", {"variable": name, **details})


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

    All methods but :meth:`wait` are synchronous and must be called from the event-loop thread;
    :meth:`wait` is a coroutine on that same loop. None of them blocks on I/O.
    """

    def __init__(self, shard_index: int, num_shards: int, dedup: DedupTable | None = None) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in 0..{num_shards - 1}, got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self._vars: dict[str, Variable] = {}
        self._nbytes = 0
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self.dedup = DedupTable() if dedup is None else dedup
        self._state_version = 0
        #: How many variables a push is writing in place off the loop right now (see
        #: :meth:`readable`): 0 nearly always, so readers check one int.
        self._in_place = 0
        #: Changes of any kind (init included); a snapshot is due when it moved.
        self.mutations = 0

    # -- reading ----------------------------------------------------------------------------

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

    # -- verbs ------------------------------------------------------------------------------

    def init(self, entries: Mapping[str, tuple[np.ndarray, Any]]) -> dict[str, dict[str, Any]]:
        """Create each variable that does not exist yet (version 0), atomically per request.

        ``entries`` maps name -> (value, optimizer wire spec or ``None``). An existing variable
        with the same shape and dtype is left alone (``created: False``); another shape or dtype
        is 409 and nothing is created.
        """
        self.check_names(entries)
        plans: list[tuple[str, np.ndarray, Optimizer]] = []
        optimizers: dict[Optimizer, Optimizer] = {}
        bounds: dict[str, float] = {}
        conflicts = {}
        for name, (value, spec) in entries.items():
            dtype = native(value.dtype)
            existing = self._vars.get(name)
            if existing is not None:
                if existing.value.shape != value.shape or existing.value.dtype != dtype:
                    conflicts[name] = {
                        "existing": {
                            "shape": list(existing.value.shape),
                            "dtype": existing.value.dtype.str,
                        },
                        "requested": {"shape": list(value.shape), "dtype": dtype.str},
                    }
                continue
            with np.errstate(all="ignore"):
                squares = finite_squares(value)
            if squares is None:
                raise _tensor_error(name, "initial value has NaN or infinite entries")
            try:
                opt = DEFAULT_OPTIMIZER if spec is None else from_wire(spec)
                optim.check_settings(opt, dtype)
            except (ValueError, TypeError) as exc:
                raise ShardError(
                    "bad_request", f"{name}: bad optimizer: {exc}", {"variable": name}
                ) from None
            # One object per distinct optimizer of the request (they are immutable): a push
            # to all of a slab's members tells that they share one by identity.
            plans.append((name, value, optimizers.setdefault(opt, opt)))
            bounds[name] = math.sqrt(squares)
        if conflicts:
            first = next(iter(conflicts))
            c = conflicts[first]
            raise ShardError(
                "conflict",
                f"{first!r} already exists with shape {c['existing']['shape']} and dtype "
                f"{c['existing']['dtype']}, not {c['requested']['shape']} {c['requested']['dtype']}"
                ": use another name, or init with the existing shape and dtype",
                {"conflicts": conflicts},
            )
        # -- apply (no refusal past this point) --
        homes = _homes(plans)
        for (name, value, opt), home in zip(plans, homes):
            dtype = native(value.dtype)
            owned = (
                np.empty(value.shape, dtype=dtype)
                if home is None
                else home[0].row(home[1], dtype, value.shape)
            )
            np.copyto(owned, value)
            var = Variable(
                name=name,
                value=owned,
                optimizer=opt,
                state=optim.init_state(opt, owned),
                bound=bounds[name],
                slot_bound=optim.init_bound(opt),
            )
            if home is not None:
                var._slab, var._row = home
                home[0].members.append(var)
            self._add(var)
        created = {name for name, _, _ in plans}
        return {
            name: {"version": self._vars[name].version, "created": name in created}
            for name in entries
        }

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
        NaN and infinities already (:mod:`server.store.checks`) to at least their sum of squares;
        they are not checked again unless they are cast. An update whose result would not be finite
        (an overflow) is refused whole, 422, and changes nothing (:func:`_bounds_after`). ``block``:
        the gradients, when they are the rows of one array in the order of ``grads`` (a table's,
        ``wire.table_rows(..., with_block=True)``). The event loop calls :meth:`push_async` instead.
        """
        return self._push(self._checked(grads), worker_id, seq, grads, versions, finite, block)

    def _push(
        self,
        variables: list[Variable],
        worker_id: str,
        seq: int,
        grads: Mapping[str, np.ndarray],
        versions: Mapping[str, int] | None,
        finite: Mapping[str, float],
        block: np.ndarray | None = None,
    ) -> dict[str, dict[str, Any]]:
        """:meth:`push` of the checked ``variables`` (``grads``' names, in order), all of it on
        this thread. A step's push is typically a hundred small gradients or more, so the work
        per gradient is only what it needs: a check, a cast if its dtype differs, the
        finiteness check unless ``finite`` names it, the arithmetic (in place unless a reader
        holds the value), and the bookkeeping, which reads the clock once per push. No object
        is made per gradient but its entry of the result. And when the gradients are all the members
        of one slab, in its order, as one ``block`` (a table's same-shaped rows,
        ``wire.table_rows``), with one optimizer that keeps no slots and no reader holding a value,
        the arithmetic is one operation on the whole slab (:meth:`_one_update`). Whether the update
        stays finite is told from bounds kept per variable (:func:`_bounds_after`, a few float
        operations); only an update they cannot vouch for is computed into fresh memory and checked
        before
        anything is written."""
        _not_being_written(variables)
        todo = [grads[var.name] for var in variables]
        # Every dtype and shape, then the values. No local name for a value anywhere before
        # target() below: it would count as a reader holding it (Variable.held).
        _check_kinds(variables, todo)
        squares: list[float] = []
        with np.errstate(all="ignore"):  # once per push, not per variable (it is not free)
            todo = [
                _ready(var, grad, finite.get(var.name), squares)
                for var, grad in zip(variables, todo)
            ]
        if self._seen("push", worker_id, seq):
            return self._duplicates(variables)
        whole = _one_update(variables, todo, block)
        if whole is not None:  # one bound for all the slab's members
            after = _after(
                whole[1],
                max([v.bound for v in variables]),
                0.0,
                max(squares),
                _LIMITS[block.itemsize],
            )
            if after is None:
                whole = None
        computed = None
        with np.errstate(all="ignore"):
            if whole is not None:
                rows, opt = whole
                optim.apply(opt, rows, block, {}, out=rows, scratch=block.flags.writeable)
                bound = after[0]
                for var in variables:
                    var.bound = bound
            else:
                bounds = list(map(_bounds_after, variables, squares))
                if None in bounds:
                    bounds = list(map(_bounds_known, variables, squares, bounds))
                    if None in bounds:
                        computed = _compute_unsure(variables, todo, bounds)
                for var, grad in zip(variables, todo):
                    if computed is not None and var.name in computed:
                        continue  # computed into fresh memory and checked already
                    target = var.target() if var.shared or var._gone is not None else var.value
                    value = var.value
                    opt = var.optimizer
                    if type(opt) is Add:  # the one that needs neither slots nor scratch
                        np.add(value, grad, out=target)
                    else:
                        optim.apply(
                            opt,
                            value,
                            grad,
                            var.own_state(),
                            out=target,
                            scratch=grad.flags.writeable,
                        )
                    if target is value:
                        var.shared = False  # what replace() does for an update in place
                    else:
                        var.replace(target)
                for var, (bound, slot_bound) in zip(variables, bounds):
                    var.bound = bound
                    var.slot_bound = slot_bound
        if computed is not None:
            _install(computed)
        out = self._applied(variables, worker_id, versions)
        self.dedup.record(worker_id, seq)
        return out

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
        (writers of a variable are serialised). Gradients of fewer than :data:`OFFLOAD_BYTES`
        in all are then applied at once, as :meth:`push` does. Bigger ones are checked (finite
        values, casts) and applied in a worker thread (numpy releases the GIL) while the loop
        goes on serving other requests, each variable where it costs least:

        * a variable whose optimizer is one or two passes over the value (``Add``, ``SGD``)
          and whose value no reader holds (:meth:`Variable.held`) is updated in place: half
          the memory traffic of writing to fresh memory. From the moment that is decided (on
          the loop) until the thread is done, readers of the variable wait for it
          (:meth:`readable`), so none sees it half-done and no new one can hold it;
        * any other (a reader holds the value or waits for the write before, or ``Adagrad``'s
          many passes) is computed into fresh buffers for the value and slots, which replace
          the old ones back on the loop; its readers meanwhile read the value before the push.

        Every gradient is checked before any variable is written, and so is every update that
        might not stay finite (computed into fresh memory first, :func:`_bounds_after`). The
        versions move, all at
        once, back on the loop once every variable of the push is done: a pull sees the value
        before the push or after it, never a torn one.
        """
        variables = self._checked(grads)
        await self._settled(variables)
        if sum(g.nbytes for g in grads.values()) < OFFLOAD_BYTES:
            return self._push(variables, worker_id, seq, grads, versions, finite, block)
        plans = self._push_plans(variables, grads, finite)
        if self._seen("push", worker_id, seq):
            return self._duplicates(variables)
        # Decided here, on the loop, with no await before the variables are marked: no reader
        # can take hold of a value that is to be written in place. The new buffers are
        # allocated here too, on the loop's thread (see server/store/heap.py).
        outputs = [
            None
            if _in_place_ok(p.var) and not p.var.row_free()
            else (p.var.elsewhere(), optim.fresh_state(p.var.state) or None)
            for p in plans
        ]
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        for var, computed in zip(variables, outputs):
            var.writing = done
            if computed is None:
                var.in_place = True
                self._in_place += 1
        try:
            await loop.run_in_executor(None, _compute_offloop, plans, outputs)
        finally:
            for var in variables:
                var.writing = None
                if var.in_place:
                    var.in_place = False
                    self._in_place -= 1
            done.set_result(None)
        for plan, computed in zip(plans, outputs):
            var = plan.var
            var.bound, var.slot_bound = plan.bounds
            if computed is None:  # written in place
                var.replace(var.value)
                continue
            value, state = computed
            var.replace(value)
            if state is not None:
                var.state = state
                var.state_shared = False
        out = self._applied(variables, worker_id, versions)
        self.dedup.record(worker_id, seq)
        return out

    def _push_plans(
        self,
        variables: list[Variable],
        grads: Mapping[str, np.ndarray],
        finite: Mapping[str, float] = _NONE,
    ) -> list[_PushPlan]:
        """Check dtypes and shapes of a whole push (not yet the values: see _PushPlan)."""
        todo = [grads[var.name] for var in variables]
        _check_kinds(variables, todo)
        return [_PushPlan(var, grad, finite.get(var.name)) for var, grad in zip(variables, todo)]

    def _applied(
        self, variables: list[Variable], worker_id: str, versions: Mapping[str, int] | None
    ) -> dict[str, dict[str, Any]]:
        """The bookkeeping of a push whose new values are in place: each version and update
        count up by one, one clock reading for all; the push's result."""
        held = versions or {}
        now = time.time()
        out = {}
        for var in variables:
            before = var.version
            var.version = version = before + 1
            var.updates += 1
            var.last_update = now
            var.last_writer = worker_id
            seen = held.get(var.name)
            out[var.name] = {
                "status": "applied",
                "version": version,
                "staleness": None if seen is None else before - seen,
            }
        self._state_version += len(variables)
        self.mutations += len(variables)
        return out

    @staticmethod
    def _duplicates(variables: Iterable[Variable]) -> dict[str, dict[str, Any]]:
        return {
            var.name: {"status": "duplicate", "version": var.version, "staleness": None}
            for var in variables
        }

    async def settled(self, names: Iterable[str]) -> None:
        """Return once no push computing off the loop writes a variable in ``names`` (unknown
        names are ignored). The loop awaits this before a synchronous :meth:`assign` or
        :meth:`increment`, with no ``await`` in between."""
        known = self._vars
        await self._settled([known[n] for n in names if type(n) is str and n in known])

    async def readable(self, names: Iterable[str]) -> None:
        """Return once no push is writing the live arrays of a variable in ``names`` in place
        off the loop (unknown names are ignored). The loop awaits this before reading values
        (pull, inspection), with no ``await`` between it and the read; it costs one int check
        while no such write runs. Each time it wakes it looks at ``names`` again: a push that
        began writing another of them in place while it waited is waited for too."""
        if not self._in_place:
            return
        names = list(names)
        while self._in_place:
            written = [v for v in self._written_in_place(names) if v.writing is not None]
            if not written:
                return
            # Meanwhile the next big push of these variables computes into fresh memory
            # rather than in place (_in_place_ok): a reader waits for one writer at most.
            for var in written:
                var.readers_waiting += 1
            try:
                await asyncio.wait({v.writing for v in written})  # never cancels the writers
            finally:
                for var in written:
                    var.readers_waiting -= 1

    def settled_now(self, names: Iterable[str]) -> bool:
        """Whether :meth:`readable` would return at once for ``names``: no push is writing one
        of them in place off the loop."""
        return not self._in_place or not any(
            v.writing is not None for v in self._written_in_place(names)
        )

    def _written_in_place(self, names: Iterable[str]) -> list[Variable]:
        """The variables of ``names`` whose live arrays a push may be writing off the loop
        (unknown names are ignored)."""
        known = self._vars
        return [
            v for n in names if type(n) is str and (v := known.get(n)) is not None and v.in_place
        ]

    async def _settled(self, variables: Iterable[Variable]) -> None:
        """Return once none of ``variables`` is being written off the loop."""
        while True:
            pending = {v.writing for v in variables if v.writing is not None}
            if not pending:
                return
            await asyncio.wait(pending)  # never cancels the writer's future

    def assign(
        self, values: Mapping[str, np.ndarray], worker_id: str | None = None, seq: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """Overwrite existing variables (same shape; cast to the variable's dtype); once per
        ``(worker_id, seq)`` when both are given. On the event loop, await :meth:`settled`
        first."""
        variables = self._checked(values)
        _not_being_written(variables)
        plans = []
        for var in variables:
            value = values[var.name]
            if value.shape != var.value.shape:
                raise _tensor_error(
                    var.name,
                    f"value shape {list(value.shape)} differs from the "
                    f"variable's {list(var.value.shape)}",
                    shape=list(var.value.shape),
                )
            plans.append((var, _cast_checked(var.name, value, var.value.dtype)))
        if worker_id is not None and seq is not None and self._seen("assign", worker_id, seq):
            return {var.name: {"status": "duplicate", "version": var.version} for var, _ in plans}
        for var, value in plans:
            target = var.target()
            np.copyto(target, value, casting="unsafe")
            var.replace(target)
            var.bound = math.inf
            self._touch(var, worker_id)
        if worker_id is not None and seq is not None:
            self.dedup.record(worker_id, seq)
        return {var.name: {"status": "applied", "version": var.version} for var, _ in plans}

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
        """
        self.check_names([name])
        if isinstance(delta, bool) or not isinstance(delta, (int, float)):
            raise ShardError(
                "bad_request", f"'delta' must be an int or a float, got {type(delta).__name__}"
            )
        if isinstance(delta, float) and not math.isfinite(delta):
            raise _tensor_error(name, f"delta must be finite, got {delta}")
        if kind is not None:
            if kind not in COUNTER_KINDS:
                raise ShardError(
                    "bad_request",
                    f"increment: 'kind' must be 'int' or 'float', got {kind!r}",
                    {"field": "kind"},
                )
            if kind == "float":
                delta = float(delta)
            elif isinstance(delta, float):
                if not delta.is_integer():
                    raise ShardError(
                        "bad_request",
                        f"increment of {name!r}: delta {delta} is "
                        "not a whole number, but 'kind' is 'int': send a whole "
                        "delta, or kind 'float'",
                        {"field": "delta"},
                    )
                delta = int(delta)
        keyed = worker_id is not None and seq is not None
        if keyed and self.dedup.check(worker_id, seq) != "new":
            earlier = self.dedup.result(worker_id, seq)
            if earlier is not None:
                self.dedup.count(worker_id, "duplicate")
                return {"value": earlier[0], "version": earlier[1], "status": "duplicate"}
            record = self.dedup.get(worker_id)
            self.dedup.count(worker_id, "expired")
            if record is not None and record.status(seq) == "duplicate":
                raise _result_dropped(worker_id, seq, record.high)
            raise _expired("increment", worker_id, seq, record.high if record else -1)
        var = self._vars.get(name)
        if var is not None:
            _not_being_written([var])
            if kind is not None and (var.value.dtype.kind == "f") != (kind == "float"):
                have = "float" if var.value.dtype.kind == "f" else "int"
                raise ShardError(
                    "conflict",
                    f"{name!r} is an {have} counter (dtype "
                    f"{var.value.dtype.str}), but the increment says kind "
                    f"{kind!r}: send kind {have!r} (or none)",
                    {"variable": name, "kind": have, "dtype": var.value.dtype.str},
                )
        dtype = (
            var.value.dtype
            if var is not None
            else np.dtype("<i8" if isinstance(delta, int) else "<f8")
        )
        if var is not None and var.value.shape != ():
            raise _tensor_error(
                name,
                f"increment needs a scalar, but the variable has shape {list(var.value.shape)}",
                shape=list(var.value.shape),
            )
        current = var.value.item() if var is not None else 0
        if dtype.kind in "iu":
            if isinstance(delta, float):
                raise _tensor_error(
                    name,
                    f"float delta {delta} on integer counter of dtype "
                    f"{dtype.str}: send an int delta",
                )
            new = current + delta
            info = np.iinfo(dtype)
            if not info.min <= new <= info.max:
                raise _tensor_error(
                    name,
                    f"{current} + {delta} overflows dtype {dtype.str} "
                    f"(range {info.min}..{info.max})",
                )
            new_value = np.array(new, dtype=dtype)
        else:
            with np.errstate(all="ignore"):
                new_value = np.array(float(current) + float(delta), dtype=dtype)
            if not math.isfinite(float(new_value)):
                raise _tensor_error(name, f"{current} + {delta} is not finite in dtype {dtype.str}")
        # -- apply --
        if var is None:
            var = Variable(
                name=name,
                value=np.zeros((), dtype=dtype),
                optimizer=Add(),
                state={},
                kind="counter",
            )
            self._add(var)
        var.replace(new_value)  # a fresh 0-d array: no reader's view is touched
        var.bound = math.inf
        self._touch(var, worker_id)
        if keyed:
            self.dedup.record(worker_id, seq, [new_value.item(), var.version])
        return {"value": new_value.item(), "version": var.version, "status": "applied"}

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
            variables={name: (var.meta(), var.frozen()) for name, var in self._vars.items()},
            dedup=self.dedup.export(),
        )

    def restore(self, variables: Iterable[Variable], dedup: DedupTable) -> None:
        """Replace the whole state with restored ``variables`` and ``dedup`` table (at start,
        before any request is served). The state version becomes the sum of their versions;
        the table keeps this store's bounds (:meth:`DedupTable.bound`)."""
        self._vars = {}
        self._nbytes = 0
        variables = list(variables)
        _into_slabs(variables)
        for var in variables:
            self._add(var)
        dedup.bound(self.dedup.max_workers, self.dedup.idle_seconds)
        self.dedup = dedup
        self._state_version = sum(v.version for v in self._vars.values())

    # -- internals --------------------------------------------------------------------------

    def _add(self, var: Variable) -> None:
        self._vars[var.name] = var
        self._nbytes += var.nbytes
        self.mutations += 1
        for event in self._waiters.pop(var.name, ()):
            event.set()

    def _touch(self, var: Variable, writer: str | None) -> None:
        var.touch(writer)
        self._state_version += 1
        self.mutations += 1

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


def _cast_checked(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` as ``dtype``, refusing what would not survive the cast (NaN, inf, overflow)."""
    if value.dtype == dtype:
        if not _finite_quiet(value):
            raise _tensor_error(name, "value has NaN or infinite entries")
        return value
    if dtype.kind == "f":
        with np.errstate(all="ignore"):
            cast = value.astype(dtype)
        if not _finite_quiet(cast):
            raise _tensor_error(name, f"value has NaN or infinite entries once cast to {dtype.str}")
        return cast
    if not _finite_quiet(value):
        raise _tensor_error(name, "value has NaN or infinite entries")
    if value.size:
        info = np.iinfo(dtype)
        lo, hi = value.min(), value.max()
        if lo < info.min or hi > info.max:
            raise _tensor_error(
                name,
                f"values in [{lo}, {hi}] do not fit dtype {dtype.str} "
                f"(range {info.min}..{info.max})",
            )
    return value.astype(dtype)


class _PushPlan:
    """One variable's part of a push: the gradient as received, and once :meth:`prepare`-d,
    cast to the variable's dtype and checked finite, with the bounds the update keeps
    (request-local work, safe off the loop)."""

    __slots__ = ("var", "grad", "scratch", "checked", "bounds")

    def __init__(self, var: Variable, grad: np.ndarray, checked: float | None = None) -> None:
        self.var = var
        self.grad = grad
        self.scratch = bool(grad.flags.writeable)
        #: Found finite already, as received, with at least this sum of squares
        #: (server/store/checks.py); None: not checked.
        self.checked = checked
        #: The variable's :attr:`~Variable.bound` and ``slot_bound`` after the update, once
        #: known (:func:`_bounds_after`), else None.
        self.bounds: tuple[float, float] | None = None

    def prepare(self) -> None:
        grad = self.grad
        squares: list[float] = []
        with np.errstate(all="ignore"):
            self.grad = _ready(self.var, grad, self.checked, squares)
        if self.grad is not grad:
            self.scratch = True
        self.bounds = _bounds_known(self.var, squares[0], _bounds_after(self.var, squares[0]))


#: Optimizers whose update is at most two passes over the value: a big push updates these in
#: place (readers waiting) when no reader holds the value (:meth:`ParameterStore.push_async`).
_CHEAP_IN_PLACE = (Add, SGD)


def _in_place_ok(var: Variable) -> bool:
    """Whether a big push may update ``var`` in place (off the loop, readers waiting): not
    while a reader holds the value, nor while readers wait for the write before."""
    return type(var.optimizer) in _CHEAP_IN_PLACE and not var.readers_waiting and not var.held()


def _compute_offloop(
    plans: list[_PushPlan], outputs: list[tuple[np.ndarray, dict[str, np.ndarray] | None] | None]
) -> None:
    """In a worker thread: check every gradient, then compute each update that might not stay
    finite into fresh memory and check it (replacing its ``outputs`` entry; 422 for one that
    is not finite, before anything is written), then each other new value and optimizer
    state into its ``outputs`` entry (fresh buffers), or for a ``None`` entry, in place into
    the live arrays (which the loop keeps every reader away from meanwhile)."""
    with np.errstate(all="ignore"):
        for plan in plans:
            plan.prepare()
        unsure = [i for i, plan in enumerate(plans) if plan.bounds is None]
        for i in unsure:
            plan = plans[i]
            computed = outputs[i]
            value, state, plan.bounds = _checked_update(
                plan.var, plan.grad, *(computed if computed is not None else (None, None))
            )
            outputs[i] = (value, state)
        for i, (plan, computed) in enumerate(zip(plans, outputs)):
            if unsure and i in unsure:
                continue
            var = plan.var
            if computed is None:
                optim.apply(var.optimizer, var.value, plan.grad, var.state, scratch=plan.scratch)
                continue
            value, state = computed
            optim.apply(
                var.optimizer,
                var.value,
                plan.grad,
                var.state,
                out=value,
                state_out=state,
                scratch=plan.scratch,
            )


def _into_slabs(variables: list[Variable]) -> None:
    """Restored variables laid out as their init made them: each run of two or more tensors in
    a row with one dtype and shape in a slab of its own (their values copied there), and one
    object per distinct optimizer, so pulls and pushes of them take the same ways as before a
    restart."""
    optimizers: dict[Optimizer, Optimizer] = {}
    for var in variables:
        var.optimizer = optimizers.setdefault(var.optimizer, var.optimizer)
    homes = _homes([(v.name, v.value, v.optimizer) for v in variables])
    for var, home in zip(variables, homes):
        if home is None:
            continue
        slab, i = home
        row = slab.row(i, var.value.dtype, var.value.shape)
        np.copyto(row, var.value)
        var.value, var._view, var._slab, var._row = row, None, slab, i
        slab.members.append(var)


def _one_update(
    variables: list[Variable], grads: list[np.ndarray], block: np.ndarray | None
) -> tuple[np.ndarray, Optimizer] | None:
    """For a push whose gradients ``grads`` are the rows of ``block``, in order: when the
    variables are every member of one slab, in its order, all home, none held by a reader,
    all with one optimizer that keeps no slots, and the block has their dtype and shape, the
    slab's rows as one array and that optimizer (one update for all: 100 x 1,000 float32 in
    one ``np.add`` instead of a hundred); else None."""
    if block is None or not variables:
        return None
    first = variables[0]
    # No local name for a value here: it would count as a reader holding it (Variable.held).
    slab, opt, dtype, shape = first._slab, first.optimizer, first.value.dtype, first.value.shape
    if (
        slab is None
        or slab.away
        or type(opt) not in _CHEAP_IN_PLACE
        or block.dtype != dtype
        or block.shape[1:] != shape
        or len(block) != len(grads)
        or variables != slab.members
    ):
        return None
    for var in variables:
        if var.optimizer is not opt:
            return None
        if var.shared:
            if var.held():
                return None
            var.shared = False
    return slab.rows(dtype, shape), opt


def _homes(plans: list[tuple[str, np.ndarray, Optimizer]]) -> list[tuple[_Slab, int] | None]:
    """Per new variable of an init, its slab and row, or None: each run of two or more
    variables in a row with one dtype and one shape (at least one dimension, some bytes, at
    most :data:`SLAB_ROW_BYTES` each) gets a slab of its own."""
    homes: list[tuple[_Slab, int] | None] = [None] * len(plans)
    start = 0
    while start < len(plans):
        first = plans[start][1]
        key = (native(first.dtype), first.shape)
        end = start + 1
        while end < len(plans) and (native(plans[end][1].dtype), plans[end][1].shape) == key:
            end += 1
        if end - start >= 2 and first.ndim and 0 < first.nbytes <= SLAB_ROW_BYTES:
            slab = _Slab(end - start, first.nbytes)
            for i in range(start, end):
                homes[i] = (slab, i - start)
        start = end
    return homes


def _grad_error(var: Variable, grad: np.ndarray) -> ShardError:
    """Why ``grad`` cannot be applied to ``var`` (dtype kinds, then shape); call only when one
    of them is wrong."""
    if var.value.dtype.kind != "f":
        return _tensor_error(
            var.name,
            f"variable has integer dtype {var.value.dtype.str}; gradients apply "
            "to float variables only (use increment or assign to change it)",
        )
    if grad.dtype.kind != "f":
        return _tensor_error(
            var.name, f"gradient dtype {grad.dtype.str} is not a float type: send f2, f4 or f8"
        )
    return _tensor_error(
        var.name,
        f"gradient shape {list(grad.shape)} differs from the variable's {list(var.value.shape)}",
        shape=list(var.value.shape),
    )


def _check_kinds(variables: list[Variable], grads: list[np.ndarray]) -> None:
    """Refuse a push (:func:`_grad_error`) unless every variable is a float one and its
    gradient (``grads``, in order) is of a float dtype and the variable's shape."""
    for var, grad in zip(variables, grads):
        if var.value.dtype.kind != "f" or grad.dtype.kind != "f" or grad.shape != var.value.shape:
            raise _grad_error(var, grad)


def _ready(
    var: Variable, grad: np.ndarray, checked: float | None, squares: list[float]
) -> np.ndarray:
    """``grad`` as it is applied to ``var``: cast to its dtype if need be (a fresh, writable
    copy) and found finite, unless ``checked`` (at least its sum of squares) says it was
    already and it needed no cast (a cast can overflow: what is applied is checked). At
    least its sum of squares goes to ``squares``. Call under ``np.errstate``."""
    if grad.dtype != var.value.dtype:
        grad = grad.astype(var.value.dtype)
        checked = None
    if checked is None:
        checked = finite_squares(grad)
        if checked is None:
            raise _not_finite(var)
    squares.append(checked)
    return grad


#: Half the largest value of each float dtype, by item size: a bound below it leaves room
#: for rounding.
_LIMITS = {np.dtype(t).itemsize: float(np.finfo(t).max) / 2 for t in ("f2", "f4", "f8")}
#: Adagrad's step is at most ``lr`` times this (``|g| / sqrt(acc + g*g)`` is at most 1, up
#: to rounding).
_ADAGRAD_STEP = 1.001


def _bounds_after(var: Variable, squares: float) -> tuple[float, float] | None:
    """The variable's :attr:`~Variable.bound` and ``slot_bound`` after applying a gradient
    whose sum of squares is at most ``squares`` (so is the square of its largest magnitude),
    when they show the update stays finite; else None (the update must be computed into
    fresh memory and checked, :func:`_checked_update`). Pure arithmetic on a few floats:
    the update's values are not read."""
    return _after(var.optimizer, var.bound, var.slot_bound, squares, _LIMITS[var.value.itemsize])


def _after(
    opt: Optimizer, bound: float, slot_bound: float, squares: float, limit: float
) -> tuple[float, float] | None:
    """:func:`_bounds_after` of a value and slots bounded by ``bound`` and ``slot_bound``,
    for ``opt``, against ``limit`` (:data:`_LIMITS`)."""
    kind = type(opt)
    grad = math.sqrt(squares)
    if kind is Add:
        after, slot = bound + grad, 0.0
    elif kind is SGD:
        after, slot = abs(1.0 - opt.lr * opt.weight_decay) * bound + opt.lr * grad, 0.0
    else:  # Adagrad: |g| <= |grad| + wd*|value|; acc grows by g*g; the step is <= lr
        g = grad + opt.weight_decay * bound
        slot = slot_bound + g * g
        after = bound + opt.lr * _ADAGRAD_STEP
    if after <= limit and slot <= limit:  # False for NaN too
        return after, slot
    return None


def _bounds_known(
    var: Variable, squares: float, bounds: tuple[float, float] | None
) -> tuple[float, float] | None:
    """``bounds`` (:func:`_bounds_after`'s), or where that is None because the variable's own
    bounds are not known (after an assign, a restart, a push that was not vouched for), those
    measured first (two read-only passes over the value and slots) and tried again: such an
    update need not go to fresh memory."""
    if bounds is None and (var.bound == math.inf or var.slot_bound == math.inf):
        var.bound = _magnitude(var.value)
        var.slot_bound = max(map(_magnitude, var.state.values())) if var.state else 0.0
        if math.isfinite(var.bound) and math.isfinite(var.slot_bound):
            return _bounds_after(var, squares)
        var.bound = var.slot_bound = math.inf
    return bounds


def _magnitude(a: np.ndarray) -> float:
    """The largest magnitude in ``a`` (NaN if it holds one, inf if an infinity); two
    passes, no temporary."""
    if not a.size:
        return 0.0
    return max(abs(float(a.max())), abs(float(a.min())))


def _checked_update(
    var: Variable,
    grad: np.ndarray,
    value: np.ndarray | None = None,
    state: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray] | None, tuple[float, float]]:
    """Apply ``grad`` to ``var`` into fresh memory (``value`` and ``state`` if given, else
    new), and the new value and slots with their exact bounds; 422 ``bad_tensor`` if a result
    is not finite (the live arrays are untouched). Call under ``np.errstate``."""
    if value is None:
        value = np.empty_like(var.value)
    if state is None:
        state = optim.fresh_state(var.state) or None
    optim.apply(
        var.optimizer,
        var.value,
        grad,
        var.state,
        out=value,
        state_out=state,
        scratch=bool(grad.flags.writeable),
    )
    bound = _magnitude(value)
    slot = max(map(_magnitude, state.values())) if state else 0.0
    if not (math.isfinite(bound) and math.isfinite(slot)):
        where = "value" if not math.isfinite(bound) else "optimizer state"
        raise _tensor_error(
            var.name,
            f"this update would make the {where} NaN or infinite in "
            f"{var.value.dtype.str} ({type(var.optimizer).__name__}), so none of the push was "
            "applied: clip the gradient or lower the learning rate",
        )
    return value, state, (bound, slot)


def _compute_unsure(
    variables: list[Variable], grads: list[np.ndarray], bounds: list[tuple[float, float] | None]
) -> dict[str, tuple[Variable, np.ndarray, dict[str, np.ndarray] | None]]:
    """Each update of a push that :func:`_bounds_after` cannot vouch for (a ``None`` in
    ``bounds``, filled in here), computed into fresh memory and checked (:func:`_checked_update`:
    422 before anything is written if one is not finite); on the event loop."""
    computed = {}
    with np.errstate(all="ignore"):
        for i, (var, grad, known) in enumerate(zip(variables, grads, bounds)):
            if known is None:
                value, state, bounds[i] = _checked_update(var, grad, var.elsewhere())
                computed[var.name] = (var, value, state)
    return computed


def _install(
    computed: Mapping[str, tuple[Variable, np.ndarray, dict[str, np.ndarray] | None]],
) -> None:
    """Make the values and slots :func:`_compute_unsure` computed the live ones."""
    for var, value, state in computed.values():
        var.replace(value)
        if state is not None:
            var.state = state
            var.state_shared = False


def _not_finite(var: Variable) -> ShardError:
    return _tensor_error(
        var.name,
        f"gradient has NaN or infinite entries (in {var.value.dtype.str}): skip or clip this step",
    )


def _not_being_written(variables: Iterable[Variable]) -> None:
    for var in variables:
        if var.writing is not None:
            raise RuntimeError(
                f"{var.name!r} is being written off the event loop: use "
                "push_async, or await settled() first"
            )
