"""The store's writes as operations: each one checked whole and built before anything changes.

Every change of a shard's state is one of these, built from a request's decoded arguments by
the function of the same name here, then applied by :mod:`server.store.apply`:

* :class:`Init` creates the variables that do not exist yet (create-if-absent: a retry finds
  them made, so it carries no ``seq``);
* :class:`Push` applies one gradient per variable with the variable's optimizer, once per
  ``(worker_id, seq)``;
* :class:`Assign` overwrites values, once per ``(worker_id, seq)`` when both are given;
* :class:`Increment` adds to a counter (made at 0 first), once per ``(worker_id, seq)`` when
  both are given;
* :class:`~server.store.optimizer_change.SetOptimizer` changes variables' optimizer or freezes
  them, and :class:`~server.store.deletion.Delete` removes variables, each once per
  ``(worker_id, seq)``: each with its builder and its application in a module of its own.

(A restore replaces the whole state at start, before any request: ``ParameterStore.restore``.)

A builder refuses (:class:`~server.errors.ShardError`, nothing changed) or returns the
operation, which then holds everything its application needs: the variables it writes, in the
request's order, its tensors (cast where that was checked), its ``worker_id`` and ``seq``.
``ParameterStore`` (:mod:`server.store.writes` and :mod:`server.store.control`) runs every
write in the same order:

1. check what a retry of the request would find the same: names and ownership, fields, and
   tensors against the variables' dtypes and shapes (which never change);
2. ask the dedup table whether ``(worker_id, seq)`` was applied already: a retry is answered
   ``"duplicate"`` (an increment's with the value the first attempt got), whatever has
   changed since;
3. check what depends on the state now (a counter's value, whether an update overflows) and
   apply the operation (:mod:`server.store.apply`), writing nothing until every check passed;
4. count it: versions, the dedup table.

:func:`init`, :func:`push`, :func:`assign` and :func:`increment_delta` are step 1;
:func:`increment` is step 3 of an increment. A push's values (cast, finite) are checked in step
1 when it is applied on the event loop (:func:`check_values`), and in a big push's worker
thread after step 2, where a pass over its bytes costs the loop nothing. Steps 2 to 4 run on
the event-loop thread with no ``await`` in between, but for a big push's wait for its worker
thread, during which its variables are marked as being written and no other write of them
starts: a variable's writes are applied one at a time, in the order their step 2 ran (the
order a log of them would keep).

Pure functions of their arguments; they change nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from client_sdk import modes
from client_sdk.modes import ASYNC, Mode
from client_sdk.optimizers import SGD, Optimizer, from_wire

from .. import optim
from ..errors import ShardError
from .checks import (
    OneBound,
    cast_checked,
    check_dtypes_and_shapes,
    finite_squares,
    grad_to_apply,
    native,
    tensor_error,
)
from .variable import Variable

__all__ = [
    "COUNTER_KINDS",
    "DEFAULT_OPTIMIZER",
    "Assign",
    "Increment",
    "Init",
    "Push",
    "assign",
    "check_values",
    "increment",
    "increment_delta",
    "init",
    "push",
    "push_fitted",
]

DEFAULT_OPTIMIZER: Optimizer = SGD(lr=0.01)
#: The kinds of counter an increment may ask for (``"kind"``): int64 or float64.
COUNTER_KINDS = ("int", "float")


# -- init -------------------------------------------------------------------------------------


@dataclass(eq=False)
class Init:
    """Create the variables of ``new`` (name, value as sent, optimizer), in the order named;
    ``bounds`` holds each one's largest magnitude and ``modes`` its training mode, in the same
    order. ``names`` is every name of the request: those not in ``new`` exist already with the
    requested shape, dtype and stated mode, and are left alone."""

    names: list[str]
    new: list[tuple[str, np.ndarray, Optimizer]]
    bounds: list[float]
    modes: list[Mode]


def _mode(name: str, fields: Mapping[str, Any] | None) -> Mode:
    """The training mode an init entry's ``fields`` state (400 naming the field)."""
    if not fields:
        return ASYNC
    try:
        return modes.from_wire(fields)
    except modes.ModeError as exc:
        raise ShardError(
            "bad_request", f"init: {name}: {exc}", {"field": exc.field, "variable": name}
        ) from None


def init(
    entries: Mapping[str, tuple[np.ndarray, Any] | tuple[np.ndarray, Any, Any]],
    existing: Mapping[str, Variable],
) -> Init:
    """An init of ``entries`` (name -> (value, optimizer wire spec or ``None``[, the entry's
    training mode fields: ``sync``, ``max_staleness``, ``staleness_policy``, or ``None``])),
    names checked already. 422 for a value with NaN or infinities, 400 for a bad optimizer or
    mode, 409 for a name that exists with another shape or dtype, or with another optimizer or
    mode than the entry states (an entry that states none takes the variable as it is)."""
    plans: list[tuple[str, np.ndarray, Optimizer]] = []
    optimizers: dict[Optimizer, Optimizer] = {}
    bounds: list[float] = []
    made_modes: list[Mode] = []
    conflicts: dict[str, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    parsed: dict[tuple[str, str], Optimizer] = {}
    with np.errstate(all="ignore"):  # once per request, not per variable (it is not free)
        for name, (value, spec, *rest) in entries.items():
            dtype = native(value.dtype)
            fields = rest[0] if rest else None
            mode = _mode(name, fields)
            have = existing.get(name)
            if have is not None:
                if have.value.shape != value.shape or have.value.dtype != dtype:
                    conflicts[name] = {
                        "existing": {
                            "shape": list(have.value.shape),
                            "dtype": have.value.dtype.str,
                        },
                        "requested": {"shape": list(value.shape), "dtype": dtype.str},
                    }
                else:
                    differ = dict(have.mode.conflicts(fields)) if fields else {}
                    if (
                        spec is not None
                        and (stated := _optimizer(name, spec, dtype)) != have.optimizer
                    ):
                        optimizer = {
                            "existing": have.optimizer.to_wire(),
                            "requested": stated.to_wire(),
                        }
                        differ = {"optimizer": optimizer, **differ}
                    if differ:
                        settings[name] = {
                            "existing": {k: d["existing"] for k, d in differ.items()},
                            "requested": {k: d["requested"] for k, d in differ.items()},
                        }
                        if "optimizer" in differ:
                            settings[name]["existing"]["optimizer_version"] = have.optimizer_version
                continue
            squares = finite_squares(value)
            if squares is None:
                raise tensor_error(name, "initial value has NaN or infinite entries")
            if spec is None:
                opt = DEFAULT_OPTIMIZER
            else:  # parsed once per distinct spec and dtype (repr: 1, 1.0 and True stay apart)
                key = (repr(spec), dtype.str)
                opt = parsed.get(key)
                if opt is None:
                    opt = parsed[key] = _optimizer(name, spec, dtype)
            # One object per distinct optimizer of the request (they are immutable): a push
            # to all of a slab's members tells that they share one by identity.
            plans.append((name, value, optimizers.setdefault(opt, opt)))
            bounds.append(math.sqrt(squares))
            made_modes.append(mode)
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
    if settings:
        first = next(iter(settings))
        c = settings[first]
        field = next(iter(c["requested"]))  # the optimizer first, then the mode's fields
        more = f" ({len(settings) - 1} more variable(s) differ too)" if len(settings) > 1 else ""
        if field == "optimizer":
            message = (
                f"{first!r} already exists with optimizer {c['existing']['optimizer']} "
                f"(optimizer_version {c['existing']['optimizer_version']}), not "
                f"{c['requested']['optimizer']}: to change it, call set_optimizer "
                "(ps.set_optimizer([name], spec)); to take it as it is, init without an optimizer"
            )
        else:
            message = (
                f"{first!r} already exists with {c['existing']}, not {c['requested']}: a "
                "variable's training mode is fixed when it is made; use another name, delete "
                "it first, or init without stating a mode"
            )
        raise ShardError("conflict", message + more, {"conflicts": settings, "field": field})
    return Init(list(entries), plans, bounds, made_modes)


def _optimizer(name: str, spec: Any, dtype: np.dtype) -> Optimizer:
    """The optimizer a wire spec states, for a variable of ``dtype``: 400 naming the variable
    and ``optimizer`` (the message names the setting) if it is not a valid one."""
    try:
        opt = from_wire(spec)
        optim.check_settings(opt, dtype)
    except (ValueError, TypeError) as exc:
        raise ShardError(
            "bad_request",
            f"{name}: bad optimizer: {exc}",
            {"variable": name, "field": spec_field(exc)},
        ) from None
    return opt


def spec_field(exc: Exception) -> str:
    """``details.field`` of a refused optimizer spec: ``optimizer``, or the path of the
    offending field in it (``optimizer.lr``, ``optimizer.schedule.total``) when known."""
    field = getattr(exc, "field", None)
    return f"optimizer.{field}" if isinstance(field, str) and field else "optimizer"


# -- push -------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Push:
    """Apply ``grads[i]`` to ``variables[i]`` with its optimizer, once per ``(worker_id, seq)``.

    ``versions``: the version each gradient was computed on, where the worker said (for the
    staleness in the reply). ``finite``: the gradients found finite already, as received, with
    at least their sum of squares (:mod:`server.store.checks`). ``block``: the gradients, when
    they are the rows of one array in the order of ``variables`` (a tensor table's). Once the
    values are checked (:func:`check_values`, or off the loop), ``grads`` holds them as applied
    (cast to each variable's dtype) and ``squares`` at least each one's sum of squares.

    A gradient array that is writable (a view of a framed request's own buffer, or a cast copy)
    may be overwritten as scratch space by the update."""

    worker_id: str
    seq: int
    variables: list[Variable]
    grads: Sequence[np.ndarray]
    versions: Mapping[str, int] | None
    finite: Mapping[str, float]
    block: np.ndarray | None
    squares: list[float]
    #: Every gradient has its variable's float dtype and shape by construction (a step
    #: group's, :func:`push_fitted`): neither checked nor cast again.
    fitted: bool = False

    @property
    def nbytes(self) -> int:
        """The gradients' bytes, as received."""
        if self.block is not None and len(self.block) == len(self.grads):  # them as one array
            return self.block.nbytes
        return sum(g.nbytes for g in self.grads)


def push(
    variables: list[Variable],
    worker_id: str,
    seq: int,
    grads: Mapping[str, np.ndarray],
    versions: Mapping[str, int] | None,
    finite: Mapping[str, float],
    block: np.ndarray | None,
) -> Push:
    """A push of ``grads`` to ``variables`` (their names, in order; checked already): 422
    unless each gradient fits its variable (a float dtype, the variable's shape)."""
    todo = [grads[var.name] for var in variables]
    check_dtypes_and_shapes(variables, todo)
    return Push(worker_id, seq, variables, todo, versions, finite, block, [])


def push_fitted(
    variables: list[Variable],
    worker_id: str,
    seq: int,
    rows: Sequence[np.ndarray],
    versions: Mapping[str, int] | None,
    finite: Mapping[str, float],
    block: np.ndarray | None,
) -> Push:
    """A push of ``rows`` (in the order of ``variables``) whose dtypes and shapes fit by
    construction: a step group's gradients, views of one flat buffer of the group's dtype cut
    to its variables' shapes, the group's variables all of that float dtype (its
    ``pushable``), checked once when the group was made. So no gradient is looked at one by
    one here, and :func:`check_values` reads only those not in ``finite``."""
    return Push(worker_id, seq, variables, rows, versions, finite, block, [], True)


def check_values(op: Push) -> None:
    """Check a push's gradients as they are applied (cast to the variable's dtype, finite;
    422 otherwise), on this thread: ``op.grads`` becomes them and ``op.squares`` at least
    their sums of squares. The ones in ``op.finite`` that need no cast are not read again."""
    finite = op.finite
    squares = op.squares
    if op.fitted and len(finite) == len(op.grads):
        # Each gradient has its variable's dtype (no cast) and was found finite on arrival.
        if type(finite) is OneBound:  # all at once: one figure for each
            squares.extend([finite.total] * len(op.grads))
        else:
            squares.extend(map(finite.__getitem__, [var.name for var in op.variables]))
        return
    with np.errstate(all="ignore"):  # once per push, not per variable (it is not free)
        op.grads = [
            grad_to_apply(var, grad, finite.get(var.name), squares)
            for var, grad in zip(op.variables, op.grads)
        ]


# -- assign -----------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Assign:
    """Overwrite ``variables[i]``'s value with ``values[i]`` (cast to its dtype, checked);
    once per ``(worker_id, seq)`` when both are given."""

    worker_id: str | None
    seq: int | None
    variables: list[Variable]
    values: list[np.ndarray]


def assign(
    variables: list[Variable],
    values: Mapping[str, np.ndarray],
    worker_id: str | None,
    seq: int | None,
) -> Assign:
    """An assign of ``values`` to ``variables`` (their names, in order; checked already): 422
    for a value of another shape, or one that does not survive the cast to the variable's
    dtype (NaN, infinities, out of an integer dtype's range)."""
    cast = []
    for var in variables:
        value = values[var.name]
        if value.shape != var.value.shape:
            raise tensor_error(
                var.name,
                f"value shape {list(value.shape)} differs from the "
                f"variable's {list(var.value.shape)}",
                shape=list(var.value.shape),
            )
        cast.append(cast_checked(var.name, value, var.value.dtype))
    return Assign(worker_id, seq, variables, cast)


# -- increment --------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Increment:
    """Make ``value`` (a fresh 0-d array: the counter plus the delta) the value of counter
    ``name``; ``var`` is the counter, or None: it does not exist yet and is made. Once per
    ``(worker_id, seq)`` when both are given, and a retry answers this ``value``."""

    worker_id: str | None
    seq: int | None
    name: str
    var: Variable | None
    value: np.ndarray


def increment_delta(name: str, delta: Any, kind: str | None) -> int | float:
    """An increment's ``delta`` checked on its own (400, or 422 if not finite) and taken as
    ``kind`` when given: an int delta as a float for ``"float"``, a float delta that is a whole
    number as an int for ``"int"`` (any other is 400): for a client whose numbers have no such
    distinction."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise ShardError(
            "bad_request", f"'delta' must be an int or a float, got {type(delta).__name__}"
        )
    if isinstance(delta, float) and not math.isfinite(delta):
        raise tensor_error(name, f"delta must be finite, got {delta}")
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
    return delta


def increment(
    name: str,
    var: Variable | None,
    delta: int | float,
    kind: str | None,
    worker_id: str | None,
    seq: int | None,
) -> Increment:
    """An increment of counter ``name`` (``var``, or None if there is none yet: an ``i8``
    counter for an int delta, ``f8`` for a float) by ``delta`` (from :func:`increment_delta`).
    409 if ``kind`` is not the counter's; 422 for a variable that is not a scalar, a float
    delta on an integer counter, or a result that overflows the counter's dtype."""
    if var is not None and kind is not None and (var.value.dtype.kind == "f") != (kind == "float"):
        have = "float" if var.value.dtype.kind == "f" else "int"
        raise ShardError(
            "conflict",
            f"{name!r} is an {have} counter (dtype "
            f"{var.value.dtype.str}), but the increment says kind "
            f"{kind!r}: send kind {have!r} (or none)",
            {"variable": name, "kind": have, "dtype": var.value.dtype.str},
        )
    dtype = (
        var.value.dtype if var is not None else np.dtype("<i8" if isinstance(delta, int) else "<f8")
    )
    if var is not None and var.value.shape != ():
        raise tensor_error(
            name,
            f"increment needs a scalar, but the variable has shape {list(var.value.shape)}",
            shape=list(var.value.shape),
        )
    current = var.value.item() if var is not None else 0
    if dtype.kind in "iu":
        if isinstance(delta, float):
            raise tensor_error(
                name,
                f"float delta {delta} on integer counter of dtype {dtype.str}: send an int delta",
            )
        new = current + delta
        info = np.iinfo(dtype)
        if not info.min <= new <= info.max:
            raise tensor_error(
                name,
                f"{current} + {delta} overflows dtype {dtype.str} (range {info.min}..{info.max})",
            )
        value = np.array(new, dtype=dtype)
    else:
        with np.errstate(all="ignore"):
            value = np.array(float(current) + float(delta), dtype=dtype)
        if not math.isfinite(float(value)):
            raise tensor_error(name, f"{current} + {delta} is not finite in dtype {dtype.str}")
    return Increment(worker_id, seq, name, var, value)
