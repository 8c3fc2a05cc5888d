"""Applying the store's writes to the live arrays: on the event loop, or off it for a big push.

An operation (:mod:`server.store.operations`) arrives here checked on its own and past the dedup
table; this module writes it, keeping these rules:

* **Nothing written until everything is checked.** Whether an update stays finite is told from
  bounds kept per variable (:mod:`server.store.bounds`, a few float operations); an update they
  cannot vouch for is computed into fresh memory and checked first (:func:`checked_update`), so
  a push that would overflow is refused whole (422) with nothing written. Once all is
  checked, :func:`push` says so (:func:`server.store.journal.decided`) before its first write.
* **In place unless a reader holds the value.** Each update goes where
  :meth:`Variable.target <server.store.variable.Variable.target>` says: the value's own buffer,
  or fresh memory (or the variable's slab row) while a reader holds the current value.
* **One update for a whole slab.** A push of every member of a slab, in its order, as one block
  (a tensor table's same-shaped rows), with one optimizer whose update is the same elementwise
  function for every variable (:func:`server.optim.uniform`) and no reader holding a value, is
  one numpy operation on the slab (:func:`one_update`).
* **Each update is the optimizer's next step.** :func:`server.optim.apply` gets the variable's
  ``steps + 1`` (Adam's bias correction, schedules); the caller counts it with the version.
* **No torn reads, no lost updates.** On the event loop (:func:`push`, :func:`assign`,
  :func:`increment`, :func:`init`) there is no ``await`` between the first write and the last,
  so no other request observes a half-applied write. A push of at least :data:`OFFLOAD_BYTES`
  is applied in a worker thread instead (:meth:`OffLoop.push`; numpy releases the GIL) while the
  loop serves other requests: its variables are marked as being written, other writers of them
  wait (:meth:`OffLoop.settled`), and readers of the ones written in place wait too
  (:meth:`OffLoop.readable`); the others are computed into fresh buffers, which replace the live
  ones on the loop, all at once, while readers go on reading the values before the push.

The versions and the dedup table are the caller's (``ParameterStore``): they move after the
write, on the loop. Everything here runs on the event-loop thread but :func:`_compute_off_loop`,
which runs in a worker thread on arrays no one else writes meanwhile.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from client_sdk.optimizers import Add, Optimizer

from .. import optim
from .bounds import LIMITS, bounds_after, bounds_for, bounds_known, magnitude
from .checks import grad_to_apply, native, tensor_error
from .journal import decided
from .operations import Assign, Increment, Init, Push
from .slab import homes
from .variable import Variable, none_held

__all__ = [
    "OFFLOAD_BYTES",
    "OffLoop",
    "assign",
    "checked_update",
    "in_place_ok",
    "increment",
    "init",
    "not_being_written",
    "one_update",
    "push",
]

#: A push whose gradients hold at least this many bytes is checked and applied off the event
#: loop, in a worker thread (:meth:`OffLoop.push`). Smaller ones are checked and applied on
#: it: for them the hand-off and the fresh buffers cost more than the loop gains by not doing
#: the arithmetic, both for one push and for a shard serving several workers.
OFFLOAD_BYTES = 16 << 20


# -- on the event loop ----------------------------------------------------------------------


def push(op: Push) -> None:
    """Apply a push whose gradients are checked (:func:`~server.store.operations.check_values`),
    all of it on this thread; 422 ``bad_tensor``, with nothing written, if an update would not
    stay finite. Hot path: a step's push is typically a hundred small gradients or more, so the
    work per gradient is only the arithmetic (in place unless a reader holds the value) and,
    for an update the bounds cannot vouch for, its check; no object is made per gradient."""
    variables, todo, squares, block = op.variables, op.grads, op.squares, op.block
    # No local name for a value anywhere before target() below: it would count as a reader
    # holding it (Variable.held).
    whole = one_update(variables, todo, block)
    if whole is not None:  # one bound for all the slab's members
        after = bounds_for(
            whole[1],
            max([v.bound for v in variables]),
            0.0,
            max(squares),
            LIMITS[block.itemsize],
        )
        if after is None:
            whole = None
    computed = None
    with np.errstate(all="ignore"):
        if whole is None:
            bounds = list(map(bounds_after, variables, squares))
            if None in bounds:
                bounds = list(map(bounds_known, variables, squares, bounds))
                if None in bounds:
                    computed = _compute_unsure(variables, todo, bounds)
        decided()  # nothing below refuses: the journal may take it (server/store/journal.py)
        if whole is not None:
            rows, opt = whole
            # uniform: the same function whatever each member's step
            optim.apply(opt, rows, block, {}, step=1, out=rows, scratch=block.flags.writeable)
            bound = after[0]
            for var in variables:
                var.bound = bound
        else:
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
                        step=var.steps + 1,
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


def one_update(
    variables: list[Variable], grads: Sequence[np.ndarray], block: np.ndarray | None
) -> tuple[np.ndarray, Optimizer] | None:
    """For a push whose gradients ``grads`` are the rows of ``block``, in order: when the
    variables are every member of one slab, in its order, all home, none held by a reader,
    all with one uniform optimizer (:func:`server.optim.uniform`), and the block has their
    dtype and shape, the
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
        or not optim.uniform(opt)
        or block.dtype != dtype
        or block.shape[1:] != shape
        or len(block) != len(grads)
        or variables != slab.members
    ):
        return None
    for var in variables:
        if var.optimizer is not opt:
            return None
    if not none_held(variables):
        return None
    return slab.rows(dtype, shape), opt


def checked_update(
    var: Variable,
    grad: np.ndarray,
    value: np.ndarray | None = None,
    state: dict[str, np.ndarray] | None = None,
    *,
    scale: float = 1.0,
) -> tuple[np.ndarray, dict[str, np.ndarray] | None, tuple[float, float]]:
    """Apply ``grad`` to ``var`` into fresh memory (``value`` and ``state`` if given, else
    new), and the new value and slots with their exact bounds; 422 ``bad_tensor`` if a result
    is not finite (the live arrays are untouched). ``scale`` multiplies the update's learning
    rate (a staleness policy's damping, :func:`server.optim.apply`). Call under
    ``np.errstate``."""
    if value is None:
        value = np.empty_like(var.value)
    if state is None:
        state = optim.fresh_state(var.state) or None
    optim.apply(
        var.optimizer,
        var.value,
        grad,
        var.state,
        step=var.steps + 1,
        scale=scale,
        out=value,
        state_out=state,
        scratch=bool(grad.flags.writeable),
    )
    bound = magnitude(value)
    slot = max(map(magnitude, state.values())) if state else 0.0
    if not (math.isfinite(bound) and math.isfinite(slot)):
        where = "value" if not math.isfinite(bound) else "optimizer state"
        raise tensor_error(
            var.name,
            f"this update would make the {where} NaN or infinite in "
            f"{var.value.dtype.str} ({type(var.optimizer).__name__}), so none of the push was "
            "applied: clip the gradient or lower the learning rate",
        )
    return value, state, (bound, slot)


def _compute_unsure(
    variables: list[Variable], grads: list[np.ndarray], bounds: list[tuple[float, float] | None]
) -> dict[str, tuple[Variable, np.ndarray, dict[str, np.ndarray] | None]]:
    """Each update of a push that :func:`~server.store.bounds.bounds_after` cannot vouch for (a
    ``None`` in ``bounds``, filled in here), computed into fresh memory and checked
    (:func:`checked_update`: 422 before anything is written if one is not finite)."""
    computed = {}
    with np.errstate(all="ignore"):
        for i, (var, grad, known) in enumerate(zip(variables, grads, bounds)):
            if known is None:
                value, state, bounds[i] = checked_update(var, grad, var.elsewhere())
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


def assign(op: Assign) -> None:
    """Write an assign's values (each where :meth:`Variable.target` says). Their bounds are
    not known any more: the next push measures them."""
    for var, value in zip(op.variables, op.values):
        target = var.target()
        np.copyto(target, value, casting="unsafe")
        var.replace(target)
        var.bound = math.inf


def increment(op: Increment) -> Variable:
    """Make an increment's value the counter's, and return the counter (made now when it did
    not exist)."""
    var = op.var
    if var is None:
        var = Variable(
            name=op.name,
            value=np.zeros((), dtype=op.value.dtype),
            optimizer=Add(),
            state={},
            kind="counter",
        )
    var.replace(op.value)  # a fresh 0-d array: no reader's view is touched
    var.bound = math.inf
    return var


def init(op: Init) -> list[Variable]:
    """The variables an init makes (version 0), their values copied into memory of their own:
    the same-shaped ones, side by side in one slab (:func:`server.store.slab.homes`)."""
    made = []
    for (name, value, opt), bound, home in zip(op.new, op.bounds, homes(op.new)):
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
            bound=bound,
            slot_bound=optim.init_bound(opt),
        )
        if home is not None:
            var._slab, var._row = home
            home[0].members.append(var)
        made.append(var)
    return made


def not_being_written(variables: Iterable[Variable]) -> None:
    """Raise (a bug of the caller, not a refusal) if a push is writing one of ``variables`` off
    the loop: the loop awaits :meth:`OffLoop.settled` before any other write."""
    for var in variables:
        if var.writing is not None:
            raise RuntimeError(
                f"{var.name!r} is being written off the event loop: use "
                "push_async, or await settled() first"
            )


# -- off the event loop ---------------------------------------------------------------------


class _PushPlan:
    """One variable's part of a push: the gradient as received, and once :meth:`prepare`-d,
    cast to the variable's dtype and checked finite, with the bounds the update keeps
    (request-local work, safe off the loop)."""

    __slots__ = ("var", "grad", "scratch", "checked", "bounds", "widened")

    def __init__(self, var: Variable, grad: np.ndarray, checked: float | None = None) -> None:
        self.var = var
        self.grad = grad
        self.scratch = bool(grad.flags.writeable)
        #: Where a half-precision gradient of a float32 variable is widened (allocated on the
        #: loop's thread, see server/store/heap.py), else None.
        self.widened = (
            np.empty(grad.shape, var.value.dtype)
            if var.value.dtype == np.float32 and grad.dtype.itemsize == 2
            else None
        )
        #: Found finite already, as received, with at least this sum of squares
        #: (server/store/checks.py); None: not checked.
        self.checked = checked
        #: The variable's :attr:`~Variable.bound` and ``slot_bound`` after the update, once
        #: known (:func:`~server.store.bounds.bounds_after`), else None.
        self.bounds: tuple[float, float] | None = None

    def prepare(self) -> None:
        grad = self.grad
        squares: list[float] = []
        with np.errstate(all="ignore"):
            self.grad = grad_to_apply(self.var, grad, self.checked, squares, self.widened)
        self.widened = None
        if self.grad is not grad:
            self.scratch = True
        self.bounds = bounds_known(self.var, squares[0], bounds_after(self.var, squares[0]))


def in_place_ok(var: Variable) -> bool:
    """Whether a big push may update ``var`` in place (off the loop, readers waiting): only
    for an optimizer that keeps no slots (``Add``, SGD without momentum: at most two passes
    over the value, and no slot a snapshot might still read), and not while a reader holds
    the value, nor while readers wait for the write before."""
    return optim.stateless(var.optimizer) and not var.readers_waiting and not var.held()


def _compute_off_loop(
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
            value, state, plan.bounds = checked_update(
                plan.var, plan.grad, *(computed if computed is not None else (None, None))
            )
            outputs[i] = (value, state)
        for i, (plan, computed) in enumerate(zip(plans, outputs)):
            if unsure and i in unsure:
                continue
            var = plan.var
            if computed is None:
                optim.apply(
                    var.optimizer,
                    var.value,
                    plan.grad,
                    var.state,
                    step=var.steps + 1,
                    scratch=plan.scratch,
                )
                continue
            value, state = computed
            optim.apply(
                var.optimizer,
                var.value,
                plan.grad,
                var.state,
                step=var.steps + 1,
                out=value,
                state_out=state,
                scratch=plan.scratch,
            )


class OffLoop:
    """Big pushes applied in a worker thread, and the waits that keep other requests from
    seeing or losing their writes meanwhile. ``variables``: the store's name -> variable map
    (read only here; the store keeps the same object for good)."""

    def __init__(self, variables: Mapping[str, Variable]) -> None:
        self._vars = variables
        #: How many variables a push is writing in place off the loop right now (see
        #: :meth:`readable`): 0 nearly always, so readers check one int.
        self.in_place = 0
        #: How many variables a push is computing off the loop right now (their ``writing``
        #: set): 0 nearly always, so a write or a check of many variables looks at one int.
        self.writing = 0

    async def push(self, op: Push) -> None:
        """Check and apply a big push (past the dedup table; after :meth:`settled` for its
        variables, with no ``await`` in between), each variable where it costs least:

        * a variable whose optimizer keeps no slots (``Add``, SGD without momentum: one or
          two passes over the value, :func:`in_place_ok`) and whose value no reader holds
          (:meth:`Variable.held`) is updated in place: half the memory traffic of writing to
          fresh memory. From the moment that is decided (on
          the loop) until the thread is done, readers of the variable wait for it
          (:meth:`readable`), so none sees it half-done and no new one can hold it;
        * any other (a reader holds the value or waits for the write before, or an optimizer
          with slots) is computed into fresh buffers for the value and slots, which replace
          the old ones back on the loop; its readers meanwhile read the value before the push.

        Every gradient is checked before any variable is written, and so is every update that
        might not stay finite (computed into fresh memory first). The new values are all in
        place when this returns, back on the loop, so the caller moves every version at once:
        a pull sees the value before the push or after it, never a torn one."""
        variables, finite = op.variables, op.finite
        plans = [_PushPlan(v, grad, finite.get(v.name)) for v, grad in zip(variables, op.grads)]
        # Decided here, on the loop, with no await before the variables are marked: no reader
        # can take hold of a value that is to be written in place. The new buffers are
        # allocated here too, on the loop's thread (see server/store/heap.py).
        outputs = [
            None
            if in_place_ok(p.var) and not p.var.row_free()
            else (p.var.elsewhere(), optim.fresh_state(p.var.state) or None)
            for p in plans
        ]
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.writing += len(variables)
        for var, computed in zip(variables, outputs):
            var.writing = done
            if computed is None:
                var.in_place = True
                self.in_place += 1
        try:
            try:
                await loop.run_in_executor(None, _compute_off_loop, plans, outputs)
            finally:
                self.writing -= len(variables)
                for var in variables:
                    var.writing = None
                    if var.in_place:
                        var.in_place = False
                        self.in_place -= 1
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
        finally:
            # The worker thread lets go of its arguments only once it runs again, which can be
            # well after this loop went on (it needs the GIL back): emptied, they no longer hold
            # the values just made, which would count as a reader's (Variable.held) and send
            # the next update after a pull to fresh memory for nothing.
            plans.clear()
            outputs.clear()

    async def settled(self, variables: Iterable[Variable]) -> None:
        """Return once none of ``variables`` is being written off the loop."""
        while True:
            pending = {v.writing for v in variables if v.writing is not None}
            if not pending:
                return
            await asyncio.wait(pending)  # never cancels the writer's future

    async def readable(self, names: Iterable[str]) -> None:
        """Return once no push is writing the live arrays of a variable in ``names`` in place
        (unknown names are ignored). Each time it wakes it looks at ``names`` again: a push
        that began writing another of them in place while it waited is waited for too."""
        if not self.in_place:
            return
        names = list(names)
        while self.in_place:
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
        """Whether :meth:`readable` would return at once for ``names``."""
        return not self.in_place or not any(
            v.writing is not None for v in self._written_in_place(names)
        )

    def _written_in_place(self, names: Iterable[str]) -> list[Variable]:
        """The variables of ``names`` whose live arrays a push may be writing off the loop
        (unknown names are ignored)."""
        known = self._vars
        return [
            v for n in names if type(n) is str and (v := known.get(n)) is not None and v.in_place
        ]
