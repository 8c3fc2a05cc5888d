"""``set_optimizer``: a variable's optimizer changed, or the variable frozen or unfrozen, while
it trains (docs/PROTOCOL.md §3).

:func:`build` checks such a request against the variables it names or matches and returns a
:class:`SetOptimizer`, the one operation that makes the change: the request's ``worker_id`` and
``seq``, the names it changes (a prefix resolved to them, so that replaying the operation changes
the same variables) and the decoded optimizer and ``frozen``. :func:`apply` applies it and
cannot fail; :class:`~server.store.verbs.ParameterStore` runs the two around the dedup table
like every write (:mod:`server.store.operations` says in which order).

What a change does to a variable:

* the same optimizer type with other settings keeps the slots (a slot the new settings need
  and the old ones had no use for starts as a new variable's does; one no longer used is
  dropped), and the optimizer's count of steps;
* another type resets the slots to a new variable's, and the count;
* ``optimizer_version`` goes up by one when the optimizer or ``frozen`` changes, not when the
  request asks for what the variable has; the value and its ``version`` never change.

A frozen variable refuses pushes (409 ``frozen``): :func:`frozen_error` is that refusal.

Pure functions of their arguments but for :func:`apply`, which changes the variables it is
given; the event-loop thread only, while no push writes them off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from client_sdk.optimizers import Optimizer, from_wire

from .. import optim
from ..errors import ShardError
from . import operations
from .variable import Variable

__all__ = ["KEPT", "RESET", "SetOptimizer", "apply", "build", "frozen_error"]

#: What a change did to a variable's optimizer slots, as the reply says it.
KEPT, RESET = "kept", "reset"


@dataclass(frozen=True, slots=True)
class SetOptimizer:
    """Give each variable of ``names`` the optimizer ``optimizer`` (None: keep its own) and
    the frozen state ``frozen`` (None: keep it); once per ``(worker_id, seq)``."""

    worker_id: str
    seq: int
    names: tuple[str, ...]
    optimizer: Optimizer | None
    frozen: bool | None


def build(
    variables: list[Variable], worker_id: str, seq: int, spec: Any, frozen: bool | None
) -> SetOptimizer:
    """The operation that gives ``variables`` (found and owned already) the optimizer of the
    wire ``spec`` and ``frozen`` (either may be None, not both): 400 for neither or a bad spec
    (``details.field`` ``optimizer``, the message naming the setting), 409 for a counter."""
    if spec is None and frozen is None:
        raise ShardError(
            "bad_request",
            "set_optimizer: nothing to change: send 'optimizer' (a spec, as at init), 'frozen' "
            "(true or false), or both",
            {"field": "optimizer"},
        )
    counters = [var.name for var in variables if var.kind == "counter"]
    if counters:
        raise ShardError(
            "conflict",
            f"set_optimizer: {counters[0]!r} is a counter (made by increment): it has no "
            "optimizer and cannot be frozen; leave it out of the request",
            {"variable": counters[0], "kind": "counter"},
        )
    opt = None
    if spec is not None:
        try:
            opt = from_wire(spec)
        except (ValueError, TypeError) as exc:
            raise ShardError(
                "bad_request",
                f"set_optimizer: bad optimizer: {exc}",
                {"field": operations.spec_field(exc)},
            ) from None
        checked: set[np.dtype] = set()
        for var in variables:
            dtype = var.value.dtype
            if dtype in checked:
                continue
            try:
                optim.check_settings(opt, dtype)
            except (ValueError, TypeError) as exc:
                raise ShardError(
                    "bad_request",
                    f"set_optimizer: bad optimizer for {var.name!r}: {exc}",
                    {"field": operations.spec_field(exc), "variable": var.name},
                ) from None
            checked.add(dtype)
    return SetOptimizer(worker_id, seq, tuple(var.name for var in variables), opt, frozen)


def apply(op: SetOptimizer, variables: list[Variable]) -> list[str]:
    """Apply ``op`` to ``variables`` (its names' variables, in order); per variable, what
    became of its slots (:data:`KEPT` or :data:`RESET`). Cannot fail."""
    out = []
    for var in variables:
        new = var.optimizer if op.optimizer is None else op.optimizer
        frozen = var.frozen if op.frozen is None else op.frozen
        changed = new != var.optimizer
        if not changed:
            slots = KEPT
        elif type(new) is type(var.optimizer):
            slots = KEPT
            _keep_slots(var, new)
        else:
            slots = RESET
            var.state = optim.init_state(new, var.value)
            var.state_shared = False
            var.slot_bound = optim.init_bound(new)
            var.steps = 0  # the count a schedule and a bias correction read
        if changed or frozen != var.frozen:
            var.optimizer_version += 1
        if changed:
            # One object for every variable the request changes (specs are immutable): a
            # push to all of a slab's members tells that they share one by identity.
            var.optimizer = new
        var.frozen = frozen
        out.append(slots)
    return out


def _keep_slots(var: Variable, new: Optimizer) -> None:
    """``var``'s slots as ``new`` (of its optimizer's type) uses them: those it had kept as
    they are, those it lacked made as a new variable's, those ``new`` has no use for dropped."""
    wanted = optim.init_state(new, np.zeros((1,), var.value.dtype))
    old = var.state
    if set(wanted) <= set(old):
        state = {slot: old[slot] for slot in wanted}
    else:
        made = optim.init_state(new, var.value)
        state = {slot: old[slot] if slot in old else made[slot] for slot in made}
        var.slot_bound = max(var.slot_bound, optim.init_bound(new))
    var.state = state
    if not var.state:
        var.state_shared = False


def frozen_error(names: list[str]) -> ShardError:
    """The refusal of a push that names the frozen variables ``names``."""
    shown = names if len(names) <= 10 else [*names[:10], "..."]
    return ShardError(
        "frozen",
        f"push refused whole, nothing applied: {shown} "
        f"{'is' if len(names) == 1 else 'are'} frozen (set_optimizer with frozen: true). Leave "
        f"{'it' if len(names) == 1 else 'them'} out of the push, or unfreeze: "
        f"ps.set_optimizer({names[:10]!r}, frozen=False)",
        {"frozen": names},
    )
