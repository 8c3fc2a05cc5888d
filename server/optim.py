"""Server-side optimizer math, applied in place on numpy arrays.

The specs (``client_sdk/optimizers.py``) say *what* to do; this module does it, with the
semantics of PyTorch's ``torch.optim`` (SGD, Adam, AdamW, RMSprop, Adagrad) and TensorFlow's
``Ftrl`` (docs/PROTOCOL.md states every formula):

* :func:`init_state` makes a new variable's slots (momentum buffers, moments, accumulators),
  :func:`init_bound` says how big their entries start, :func:`check_settings` refuses settings
  that would divide by zero in the variable's dtype;
* :func:`apply` applies one gradient. Its ``step`` is the number of this update among the ones
  the optimizer has applied to the variable (1 for the first): Adam's bias correction, Adagrad's
  ``lr_decay``, SGD's first momentum step and every learning-rate schedule read it. For the
  rows of an embedding table ``step`` is a column of each row's own number; the factors made
  from it (Adagrad's decayed rate, Adam's corrections) are computed in float64 like a dense
  variable's and rounded to the value's dtype before they meet the rows, as numpy rounds a
  dense variable's Python-float factor: a row gets the bits a dense variable of its shape gets
  at the same step (and a float32 column is three times cheaper to broadcast than a float64
  one).

The order of one update: the gradient is clipped (``clip_norm``: scaled by
``min(1, clip_norm / ||g||)``, its L2 norm summed in float64 a block at a time), then weight
decay enters (added to the gradient, or for AdamW shrinking the value), then the optimizer's
rule runs with the learning rate the schedule gives for ``step - 1`` earlier updates.

``value`` is updated in place and its slots (``state``) too. Big variables are the point of a
parameter server, so the math is written with ``out=``, and a big variable is updated a block
of 4 MiB per array at a time (:data:`_BLOCK_BYTES`): each block's passes run in the cache, and
the temporaries, at most two, are the size of a block, not of the variable (the size of a
smaller variable; one fewer where ``scratch`` says the gradient's buffer may be overwritten, as a
framed request's buffer may). Everything here is synchronous, pure CPU
(numpy releases the GIL) and not thread-safe: the caller serialises updates to one variable
(the store runs small ones on the event-loop thread, in place, and big ones in a worker thread
into fresh ``out``/``state_out`` buffers). Both ways run the same operations in the same order,
so they give the same bits. The store checks that an update stays finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from client_sdk.optimizers import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Add,
    Constant,
    Ftrl,
    Optimizer,
    RMSprop,
    SpecError,
)

__all__ = [
    "apply",
    "check_settings",
    "fresh_state",
    "init_bound",
    "init_state",
    "learning_rate",
    "state_nbytes",
    "stateless",
    "uniform",
]

State = dict[str, np.ndarray]


def init_state(opt: Optimizer, value: np.ndarray) -> State:
    """The optimizer's slots for a new variable, each shaped like the value: zeros, but
    Adagrad's and FTRL's accumulators, which start at ``initial_accumulator_value``. Empty
    for ``Add`` and SGD without momentum."""
    names = _slots(opt)
    state = {name: np.zeros(value.shape, dtype=value.dtype) for name in names}
    if isinstance(opt, (Adagrad, Ftrl)):
        state["accumulator"].fill(opt.initial_accumulator_value)
    return state


def _slots(opt: Optimizer) -> tuple[str, ...]:
    if isinstance(opt, SGD):
        return ("momentum_buffer",) if opt.momentum else ()
    if isinstance(opt, (Adam, AdamW)):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if opt.amsgrad else ())
    if isinstance(opt, RMSprop):
        return (
            ("square_avg",)
            + (("grad_avg",) if opt.centered else ())
            + (("momentum_buffer",) if opt.momentum else ())
        )
    if isinstance(opt, Adagrad):
        return ("accumulator",)
    if isinstance(opt, Ftrl):
        return ("accumulator", "linear")
    return ()


def init_bound(opt: Optimizer) -> float:
    """The largest magnitude in the slots :func:`init_state` makes (0 when there are none)."""
    return float(opt.initial_accumulator_value) if isinstance(opt, (Adagrad, Ftrl)) else 0.0


def check_settings(opt: Optimizer, dtype: np.dtype) -> None:
    """:class:`~client_sdk.optimizers.SpecError` for settings that would divide by zero on a
    variable of ``dtype``: an Adam, AdamW or RMSprop ``epsilon`` that is 0 in that dtype (e.g.
    1e-8 in float16), an Adagrad whose ``epsilon`` and ``initial_accumulator_value`` are both 0
    in it, an FTRL whose ``1 / lr`` is not finite in it or whose accumulator starts at 0 in it
    with no l2 or beta. The specs check their own ranges (``client_sdk/optimizers.py``)."""
    if dtype.kind == "f":
        _check_dtype(opt, dtype)


def stateless(opt: Optimizer) -> bool:
    """Whether ``opt`` keeps no slots (``Add``, SGD without momentum)."""
    return not _slots(opt)


def uniform(opt: Optimizer) -> bool:
    """Whether ``opt``'s update is one elementwise function of value and gradient, the same for
    every variable and every step: no slots, no schedule, no clipping (``Add``; SGD without
    momentum, clip_norm or schedule). Such an update of many same-shaped variables may be one
    update of the array that holds them all, whatever each one's step count."""
    if type(opt) is Add:
        return True
    return (
        type(opt) is SGD
        and not opt.momentum
        and opt.clip_norm is None
        and type(opt.schedule) is Constant
    )


def _check_dtype(opt: Optimizer, dtype: np.dtype) -> None:
    zero = _zero_in(dtype)
    tiny = float(np.finfo(dtype).tiny)
    if isinstance(opt, (Adam, AdamW, RMSprop)) and zero(opt.epsilon):
        raise SpecError(
            "epsilon",
            f"{type(opt).__name__} epsilon {opt.epsilon!r} is 0 in {dtype.str}: a zero gradient "
            f"would divide 0 by 0; make epsilon at least {tiny:g}",
        )
    if isinstance(opt, Adagrad) and zero(opt.epsilon) and zero(opt.initial_accumulator_value):
        raise SpecError(
            "epsilon",
            f"Adagrad epsilon {opt.epsilon!r} and initial_accumulator_value "
            f"{opt.initial_accumulator_value!r} are both 0 in {dtype.str}: a zero gradient would "
            f"divide 0 by 0; make epsilon at least {tiny:g}",
        )
    if isinstance(opt, Ftrl):
        biggest = float(np.finfo(dtype).max)
        if 1.0 / opt.lr > biggest:
            raise SpecError(
                "lr",
                f"Ftrl lr {opt.lr!r} is too small for {dtype.str}: FTRL divides by it; make "
                f"it at least {1.0 / biggest:g}",
            )
        if (
            zero(opt.initial_accumulator_value)
            and not opt.l2
            and not opt.beta
            and opt.learning_rate_power < 0
        ):
            raise SpecError(
                "initial_accumulator_value",
                f"Ftrl initial_accumulator_value {opt.initial_accumulator_value!r} is 0 in "
                f"{dtype.str} and l2 and beta are 0: a zero gradient would divide by 0; make "
                f"initial_accumulator_value at least {tiny:g}",
            )


def _zero_in(dtype: np.dtype) -> Callable[[float], bool]:
    return lambda x: not dtype.type(x) > 0


def state_nbytes(state: State) -> int:
    return sum(a.nbytes for a in state.values())


def fresh_state(state: State) -> State:
    """New, uninitialised arrays shaped like each slot in ``state`` (for ``state_out``)."""
    return {key: np.empty_like(slot) for key, slot in state.items()}


def learning_rate(opt: Optimizer, step: int) -> float:
    """The learning rate of update number ``step`` (1 for the first): the optimizer's
    schedule at ``step - 1`` earlier updates."""
    schedule = opt.schedule
    if type(schedule) is Constant:
        return float(opt.lr)
    return schedule.lr_at(opt.lr, step - 1)


def apply(
    opt: Optimizer,
    value: np.ndarray,
    grad: np.ndarray,
    state: State,
    *,
    step: int | np.ndarray,
    scale: float = 1.0,
    out: np.ndarray | None = None,
    state_out: State | None = None,
    scratch: bool = False,
) -> None:
    """Apply one gradient: the new value goes to ``out`` (default: ``value``, in place), and the
    optimizer's new slots to ``state_out`` (default: ``state``, in place).

    ``step`` is the number of this update among those the optimizer applied to the variable
    (1 for the first); for the rows of an embedding table, an int64 array of shape [rows, 1]
    holding each row's own number (a table's optimizer has a constant schedule). ``scale``
    multiplies this update's learning rate (after the schedule; for ``Add``, the pushed
    delta): the slots advance as for any update. ``grad`` must have
    ``value``'s shape and dtype; ``out``, if given, too (and must not overlap ``value``);
    ``state_out``, if given, holds an array of the same shape as each slot (see
    :func:`fresh_state`) and then ``value`` and ``state`` are only read. With ``scratch=True``
    the function may overwrite ``grad`` instead of allocating a temporary. Writing to a fresh
    ``out`` costs no more than updating in place, which is how the store moves a value that a
    reader still holds to new memory, and how it computes an update off the event loop.
    """
    if out is None:
        out = value
    kind = type(opt)
    if kind is Add:
        if scale == 1.0:
            np.add(value, grad, out=out)
        else:
            delta = grad if scratch else np.empty_like(value)
            np.multiply(grad, scale, out=delta)
            np.add(value, delta, out=out)
        return
    rule = _RULES.get(kind)
    if rule is None:  # from_wire only builds the ones in _RULES
        raise TypeError(f"no server-side math for optimizer {kind.__name__}")
    new = state if state_out is None else state_out
    # learning_rate() and _clip_scale() written out: this runs per variable of every push
    schedule = opt.schedule
    lr = opt.lr if type(schedule) is Constant else schedule.lr_at(opt.lr, step - 1)
    if scale != 1.0:
        lr *= scale
    clip = 1.0 if opt.clip_norm is None else _clip_scale(opt, grad)
    if (
        value.nbytes <= _BLOCK_BYTES
        or type(step) is not int
        or not _contiguous(value, out, *state.values(), *new.values())
    ):
        rule(opt, value, grad, state, new, out, step, lr, clip, scratch)
        return
    # A block at a time: its dozen passes run in the cache instead of over main memory
    block = _BLOCK_BYTES // value.itemsize
    value, grad, out = value.reshape(-1), grad.reshape(-1), out.reshape(-1)
    state = {key: slot.reshape(-1) for key, slot in state.items()}
    new = {key: slot.reshape(-1) for key, slot in new.items()}
    for start in range(0, value.size, block):
        end = start + block
        rule(
            opt,
            value[start:end],
            grad[start:end],
            {key: slot[start:end] for key, slot in state.items()},
            {key: slot[start:end] for key, slot in new.items()},
            out[start:end],
            step,
            lr,
            clip,
            scratch,
        )


#: Bytes of each array one rule call works on: a big variable is updated a block at a time, so
#: that the block's arrays (value, gradient, slots, two temporaries: up to 7 x 4 MiB) stay in a
#: last-level cache between the rule's passes, and each byte of the variable crosses the memory
#: bus once each way instead of once per pass (2-3x faster for Adam than whole-array passes).
#: Few enough blocks that a worker thread takes the GIL back only a few hundred times per update.
_BLOCK_BYTES = 4 << 20


def _contiguous(*arrays: np.ndarray) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


# -- the rules -----------------------------------------------------------------------------------
# Each reads ``value`` and ``state`` before it writes ``out`` and ``new`` over them (they may be
# the same arrays), and allocates at most two temporaries the size of the value.

#: Elements per block when a gradient's squares are summed (a block's sum is exact enough in
#: float32; the blocks are added in float64).
_NORM_BLOCK = 1 << 14


def _l2_norm(grad: np.ndarray) -> float:
    flat = grad.reshape(-1)
    if flat.dtype.itemsize == 8:
        total = float(np.dot(flat, flat))
    else:
        total = 0.0
        for start in range(0, flat.size, _NORM_BLOCK):
            block = flat[start : start + _NORM_BLOCK]
            if block.dtype.itemsize < 4:
                block = block.astype(np.float32)
            part = float(np.dot(block, block))
            if not math.isfinite(part):  # past float32's range: this block in float64
                block = block.astype(np.float64)
                part = float(np.dot(block, block))
            total += part
    return math.sqrt(total)


def _clip_scale(opt: Optimizer, grad: np.ndarray) -> float:
    """The factor that brings ``grad``'s L2 norm down to ``clip_norm`` (1.0 when it is not
    above it, or there is no ``clip_norm``)."""
    limit = opt.clip_norm
    if limit is None:
        return 1.0
    norm = _l2_norm(grad)
    return limit / norm if norm > limit else 1.0


def _gradient(
    value: np.ndarray, grad: np.ndarray, scratch: bool, scale: float, decay: float
) -> tuple[np.ndarray, np.ndarray]:
    """``scale * grad + decay * value`` (``grad`` itself when that changes nothing), and a
    free temporary the size of the value."""
    tmp = np.empty_like(value)
    if scale == 1.0 and not decay:
        return grad, tmp
    g = grad if scratch else np.empty_like(value)
    if scale != 1.0:
        np.multiply(grad, scale, out=g)
        grad = g
    if decay:
        np.multiply(value, decay, out=tmp)
        np.add(grad, tmp, out=g)
    return g, tmp


def _sgd(
    opt: SGD,
    value: np.ndarray,
    grad: np.ndarray,
    state: State,
    new: State,
    out: np.ndarray,
    step: int,
    lr: float,
    clip: float,
    scratch: bool,
) -> None:
    scale = clip
    if not opt.momentum:
        # value - lr*(scale*g + wd*value) == value*(1 - lr*wd) - (lr*scale)*g: one temporary
        d = grad if scratch else np.empty_like(value)
        np.multiply(grad, lr * scale, out=d)
        if opt.weight_decay:
            np.multiply(value, 1.0 - lr * opt.weight_decay, out=out)
            np.subtract(out, d, out=out)
        else:
            np.subtract(value, d, out=out)
        return
    g, tmp = _gradient(value, grad, scratch, clip, opt.weight_decay)
    buf = new["momentum_buffer"]
    first = step == 1
    if first is True:  # torch starts the buffer at the first gradient, undamped
        np.copyto(buf, g)
    else:
        np.multiply(state["momentum_buffer"], opt.momentum, out=buf)
        if opt.dampening:
            np.multiply(g, 1.0 - opt.dampening, out=tmp)
            np.add(buf, tmp, out=buf)
        else:
            np.add(buf, g, out=buf)
        if first is not False:  # per-row steps: the rows at their first step start at g
            np.copyto(buf, g, where=first)
    if opt.nesterov:
        np.multiply(buf, opt.momentum, out=tmp)
        np.add(tmp, g, out=tmp)
        np.multiply(tmp, lr, out=tmp)
    else:
        np.multiply(buf, lr, out=tmp)
    np.subtract(value, tmp, out=out)


#: The smallest normal number of each float dtype, by item size.
_TINY = {np.dtype(t).itemsize: float(np.finfo(t).tiny) for t in ("f2", "f4", "f8")}


def _adam(
    opt: Adam | AdamW,
    value: np.ndarray,
    grad: np.ndarray,
    state: State,
    new: State,
    out: np.ndarray,
    step: int,
    lr: float,
    clip: float,
    scratch: bool,
) -> None:
    decoupled = type(opt) is AdamW
    b1, b2 = opt.betas
    g, tmp = _gradient(value, grad, scratch, clip, 0.0 if decoupled else opt.weight_decay)
    m, v = new["exp_avg"], new["exp_avg_sq"]
    np.multiply(state["exp_avg"], b1, out=m)
    np.multiply(g, 1.0 - b1, out=tmp)
    np.add(m, tmp, out=m)
    np.multiply(g, g, out=tmp)
    np.multiply(tmp, 1.0 - b2, out=tmp)
    np.multiply(state["exp_avg_sq"], b2, out=v)
    np.add(v, tmp, out=v)
    if opt.amsgrad:
        np.maximum(state["max_exp_avg_sq"], v, out=new["max_exp_avg_sq"])
        v = new["max_exp_avg_sq"]
    correction1 = 1.0 - b1**step
    # per-row steps (an array) give per-row corrections, broadcast over each row
    root2 = math.sqrt(1.0 - b2**step) if type(step) is int else np.sqrt(1.0 - b2**step)
    # lr/c1 * m / (sqrt(v)/root2 + eps) == (lr*root2/c1) * m / (sqrt(v) + eps*root2): one
    # pass fewer, where eps*root2 is still a normal number in the dtype.
    np.sqrt(v, out=tmp)
    folded = opt.epsilon * root2
    if (folded if type(step) is int else np.min(folded)) >= _TINY[value.dtype.itemsize]:
        np.add(tmp, _per_row(folded, value), out=tmp)
        factor = lr * root2 / correction1
    else:
        np.multiply(tmp, _per_row(1.0 / root2, value), out=tmp)
        np.add(tmp, opt.epsilon, out=tmp)
        factor = lr / correction1
    np.divide(m, tmp, out=tmp)
    np.multiply(tmp, _per_row(factor, value), out=tmp)
    if decoupled and opt.weight_decay:
        np.multiply(value, 1.0 - lr * opt.weight_decay, out=out)
        np.subtract(out, tmp, out=out)
    else:
        np.subtract(value, tmp, out=out)


def _rmsprop(
    opt: RMSprop,
    value: np.ndarray,
    grad: np.ndarray,
    state: State,
    new: State,
    out: np.ndarray,
    step: int,
    lr: float,
    clip: float,
    scratch: bool,
) -> None:
    alpha = opt.alpha
    g, tmp = _gradient(value, grad, scratch, clip, opt.weight_decay)
    v = new["square_avg"]
    np.multiply(g, g, out=tmp)
    np.multiply(tmp, 1.0 - alpha, out=tmp)
    np.multiply(state["square_avg"], alpha, out=v)
    np.add(v, tmp, out=v)
    if opt.centered:
        a = new["grad_avg"]
        np.multiply(state["grad_avg"], alpha, out=a)
        np.multiply(g, 1.0 - alpha, out=tmp)
        np.add(a, tmp, out=a)
        np.multiply(a, a, out=tmp)
        np.subtract(v, tmp, out=tmp)
        # v >= a*a in exact arithmetic; a rounding residue below 0 is taken as 0 (torch's
        # sqrt would make it NaN)
        np.maximum(tmp, 0.0, out=tmp)
        np.sqrt(tmp, out=tmp)
    else:
        np.sqrt(v, out=tmp)
    np.add(tmp, opt.epsilon, out=tmp)
    np.divide(g, tmp, out=tmp)
    if opt.momentum:
        buf = new["momentum_buffer"]
        np.multiply(state["momentum_buffer"], opt.momentum, out=buf)
        np.add(buf, tmp, out=buf)
        np.multiply(buf, lr, out=tmp)
    else:
        np.multiply(tmp, lr, out=tmp)
    np.subtract(value, tmp, out=out)


def _per_row(factor: float | np.ndarray, value: np.ndarray) -> float | np.ndarray:
    """``factor`` as it meets ``value``: a per-row column (from per-row steps) rounded to the
    value's dtype, as numpy rounds a Python float (see the module); a number as it is."""
    return factor.astype(value.dtype) if isinstance(factor, np.ndarray) else factor


def _adagrad(
    opt: Adagrad,
    value: np.ndarray,
    grad: np.ndarray,
    state: State,
    new: State,
    out: np.ndarray,
    step: int,
    lr: float,
    clip: float,
    scratch: bool,
) -> None:
    if opt.lr_decay:
        lr = _per_row(lr / (1.0 + (step - 1) * opt.lr_decay), value)
    g, tmp = _gradient(value, grad, scratch, clip, opt.weight_decay)
    acc = new["accumulator"]
    np.multiply(g, g, out=tmp)
    np.add(state["accumulator"], tmp, out=acc)
    np.sqrt(acc, out=tmp)
    np.add(tmp, opt.epsilon, out=tmp)
    np.divide(g, tmp, out=tmp)
    np.multiply(tmp, lr, out=tmp)
    np.subtract(value, tmp, out=out)


def _power(x: np.ndarray, exponent: float, out: np.ndarray) -> None:
    if exponent == 0.5:
        np.sqrt(x, out=out)
    elif exponent == 1.0:
        np.copyto(out, x)
    elif exponent == 0.0:
        out.fill(1)
    else:
        np.power(x, exponent, out=out)


def _ftrl(
    opt: Ftrl,
    value: np.ndarray,
    grad: np.ndarray,
    state: State,
    new: State,
    out: np.ndarray,
    step: int,
    lr: float,
    clip: float,
    scratch: bool,
) -> None:
    scale = clip  # folded in below: no array for the clipped gradient
    power = -opt.learning_rate_power
    acc, linear = new["accumulator"], new["linear"]
    # linear += g + 2*l2_shrinkage*w - (acc_new^-p - acc^-p) / lr * w, the gradient's part
    # first, so that the gradient's buffer is free for acc_new^-p after
    old = np.empty_like(value)
    if scale != 1.0:
        np.multiply(grad, scale, out=old)
        np.add(state["linear"], old, out=linear)
    else:
        np.add(state["linear"], grad, out=linear)
    if opt.l2_shrinkage:
        np.multiply(value, 2.0 * opt.l2_shrinkage, out=old)
        np.add(linear, old, out=linear)
    now = grad if scratch else np.empty_like(value)
    np.multiply(grad, grad, out=now)
    if scale != 1.0:
        np.multiply(now, scale * scale, out=now)
    _power(state["accumulator"], power, out=old)
    np.add(state["accumulator"], now, out=acc)
    _power(acc, power, out=now)
    np.subtract(now, old, out=old)
    np.multiply(old, value, out=old)
    np.multiply(old, 1.0 / lr, out=old)
    np.subtract(linear, old, out=linear)
    # w = (clip(linear, -l1, l1) - linear) / (acc_new^-p / lr + 2*(l2 + beta / (2*lr)))
    l2 = 2.0 * (opt.l2 + opt.beta / (2.0 * lr))
    if opt.l1:
        np.multiply(now, 1.0 / lr, out=now)
        if l2:
            np.add(now, l2, out=now)
        np.clip(linear, -opt.l1, opt.l1, out=old)
        np.subtract(old, linear, out=old)
        np.divide(old, now, out=out)
    else:  # (0 - linear) / q == linear / -q
        np.multiply(now, -1.0 / lr, out=now)
        if l2:
            np.subtract(now, l2, out=now)
        np.divide(linear, now, out=out)


_Rule = Callable[
    [Optimizer, np.ndarray, np.ndarray, State, State, np.ndarray, int, float, float, bool], None
]
_RULES: dict[type[Optimizer], _Rule] = {
    SGD: _sgd,
    Adam: _adam,
    AdamW: _adam,
    RMSprop: _rmsprop,
    Adagrad: _adagrad,
    Ftrl: _ftrl,
}
