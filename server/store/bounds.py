"""What an update provably keeps finite: per variable, a bound on its magnitudes, and per
optimizer, what one gradient can do to it.

A push is refused whole (422) if any of its updates would make a value or an optimizer slot
NaN or infinite (an overflow), with nothing written. Computing every update into fresh memory
and checking it first would cost a pass and the memory of a copy per push; instead each variable
keeps :attr:`~server.store.variable.Variable.bound` (at least the largest magnitude in its value)
and ``slot_bound`` (the same for its optimizer slots), and from them and a gradient's sum of
squares (which the finiteness check yields: :func:`server.store.checks.finite_squares`) a few
float operations tell that the update stays finite and what the bounds are after it
(:func:`bounds_after`). Only an update they cannot vouch for is computed into fresh memory and
checked before anything is written (:func:`server.store.apply.checked_update`).

An optimizer the shard learns (server/optim.py) needs its rule in :func:`bounds_for`; until it
has one, every update of it is computed into fresh memory and checked. FTRL has none: its value
is a closed form that divides by the learning rate, which a schedule or a staleness scale can
make as small as it likes, so each FTRL update is checked that way.

The rules use what holds for every update: the schedule's learning rate is at most ``lr`` (and
a staleness scale at most 1); a clipped gradient's entries are at most ``clip_norm``; an
exponential average is at most the larger of its old value and its new input; a step divided
by ``sqrt(v) + epsilon`` is at most the numerator over ``epsilon``.

Pure arithmetic on a few floats, plus :func:`bounds_known`'s read-only passes; thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from client_sdk.optimizers import SGD, Adagrad, Adam, AdamW, Add, Optimizer, RMSprop

from .variable import Variable

__all__ = ["LIMITS", "bounds_after", "bounds_for", "bounds_known", "magnitude"]

#: Half the largest value of each float dtype, by item size: a bound below it leaves room
#: for rounding.
LIMITS = {np.dtype(t).itemsize: float(np.finfo(t).max) / 2 for t in ("f2", "f4", "f8")}
#: Adagrad's step is at most ``lr`` times this (``|g| / sqrt(acc + g*g)`` is at most 1, up
#: to rounding).
_ADAGRAD_STEP = 1.001


def bounds_after(var: Variable, squares: float) -> tuple[float, float] | None:
    """The variable's :attr:`~Variable.bound` and ``slot_bound`` after applying a gradient
    whose sum of squares is at most ``squares`` (so is the square of its largest magnitude),
    when they show the update stays finite; else None (the update must be computed into
    fresh memory and checked). The update's values are not read."""
    return bounds_for(var.optimizer, var.bound, var.slot_bound, squares, LIMITS[var.value.itemsize])


def bounds_for(
    opt: Optimizer, bound: float, slot_bound: float, squares: float, limit: float
) -> tuple[float, float] | None:
    """:func:`bounds_after` of a value and slots bounded by ``bound`` and ``slot_bound``,
    for ``opt``, against ``limit`` (:data:`LIMITS`)."""
    kind = type(opt)
    grad = math.sqrt(squares)
    if kind is Add:
        after, slot, peak = bound + grad, 0.0, 0.0
    elif kind not in _RULES:  # no rule for it: computed into fresh memory and checked
        return None
    else:
        clip = opt.clip_norm
        after, slot, peak = _RULES[kind](
            opt, bound, slot_bound, grad if clip is None else min(grad, clip)
        )
    if after <= limit and slot <= limit and peak <= limit:  # False for NaN too
        return after, slot
    return None


# Each rule: (the value's bound after the update, the slots' bound after it, the largest
# magnitude of anything computed on the way: a temporary that overflows makes the value
# non-finite even if the rest of the formula would bring it back in range).


def _sgd(opt: SGD, bound: float, slot_bound: float, grad: float) -> tuple[float, float, float]:
    lr, wd = opt.lr, opt.weight_decay
    if not opt.momentum:  # w * (1 - lr*wd) - lr*g, the learning rate anywhere in 0..lr
        return max(1.0, abs(1.0 - lr * wd)) * bound + lr * grad, 0.0, lr * grad
    d = grad + wd * bound  # |g + wd*w|
    buf = opt.momentum * slot_bound + d  # the first buffer is d itself
    step = d + opt.momentum * buf if opt.nesterov else buf
    return bound + lr * step, buf, max(step, lr * step)


def _adagrad(
    opt: Adagrad, bound: float, slot_bound: float, grad: float
) -> tuple[float, float, float]:
    # |g| <= |grad| + wd*|value|; acc grows by g*g; the step is <= lr (lr_decay only lowers it)
    g = grad + opt.weight_decay * bound
    return bound + opt.lr * _ADAGRAD_STEP, slot_bound + g * g, g * g


def _adam(
    opt: Adam | AdamW, bound: float, slot_bound: float, grad: float
) -> tuple[float, float, float]:
    lr, wd, (b1, b2) = opt.lr, opt.weight_decay, opt.betas
    if type(opt) is AdamW:
        g, base = grad, max(1.0, abs(1.0 - lr * wd)) * bound
    else:
        g, base = grad + wd * bound, bound
    slot = max(slot_bound, g, g * g)  # m, v and max(v) are averages of g and g*g
    # |m / (1 - b1^k)| / (sqrt(v_hat) + eps) <= |m| / ((1 - b1) * eps) for every k >= 1; on
    # the way, m / (sqrt(v) + eps * sqrt(1 - b2^k)) <= |m| / (eps * sqrt(1 - b2)), or m / eps
    ratio = slot / (opt.epsilon * min(1.0, math.sqrt(1.0 - b2)))
    return base + lr * slot / ((1.0 - b1) * opt.epsilon), slot, max(g * g, ratio)


def _rmsprop(
    opt: RMSprop, bound: float, slot_bound: float, grad: float
) -> tuple[float, float, float]:
    g = grad + opt.weight_decay * bound
    d = g / opt.epsilon  # |g| / (sqrt(v) + eps)
    slot = max(slot_bound, g, g * g)  # square_avg and grad_avg: averages of g*g and g
    peak = max(g * g, d)
    if opt.centered:  # a*a, a the average of g (a product: ** raises on overflow)
        a = max(slot_bound, g)
        peak = max(peak, a * a)
    if opt.momentum:
        d = opt.momentum * slot_bound + d
        slot = max(slot, d)
    return bound + opt.lr * d, slot, max(peak, d)


_RULES: dict[type, Callable[[Any, float, float, float], tuple[float, float, float]]] = {
    SGD: _sgd,
    Adagrad: _adagrad,
    Adam: _adam,
    AdamW: _adam,
    RMSprop: _rmsprop,
}


def bounds_known(
    var: Variable, squares: float, bounds: tuple[float, float] | None
) -> tuple[float, float] | None:
    """``bounds`` (:func:`bounds_after`'s), or where that is None because the variable's own
    bounds are not known (after an assign, a restart, a push that was not vouched for), those
    measured first (two read-only passes over the value and slots) and tried again: such an
    update need not go to fresh memory."""
    if bounds is None and (var.bound == math.inf or var.slot_bound == math.inf):
        var.bound = magnitude(var.value)
        var.slot_bound = max(map(magnitude, var.state.values())) if var.state else 0.0
        if math.isfinite(var.bound) and math.isfinite(var.slot_bound):
            return bounds_after(var, squares)
        var.bound = var.slot_bound = math.inf
    return bounds


def magnitude(a: np.ndarray) -> float:
    """The largest magnitude in ``a`` (NaN if it holds one, inf if an infinity); two
    passes, no temporary."""
    if not a.size:
        return 0.0
    return max(abs(float(a.max())), abs(float(a.min())))
