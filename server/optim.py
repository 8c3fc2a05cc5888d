"""Server-side optimizer math, applied in place on numpy arrays.

The specs (``client_sdk/optimizers.py``) say *what* to do; this module does it:

``SGD``      value -= lr * (grad + weight_decay * value)
``Adagrad``  g = grad + weight_decay * value;  acc += g*g;  value -= lr * g / (sqrt(acc) + epsilon)
``Add``      value += grad

``value`` is updated in place and its slots (``state``, e.g. Adagrad's accumulator) too. Big
variables are the point of a parameter server, so the math is written with ``out=`` and allocates
at most two temporaries the size of the variable (none when ``scratch`` says the gradient buffer
may be overwritten, as a framed request's buffer may). Everything here is synchronous, pure CPU
(numpy releases the GIL) and not thread-safe: the caller serialises updates to one variable
(the store runs small ones on the event-loop thread, in place, and big ones in a worker thread
into fresh ``out``/``state_out`` buffers). Settings that would divide by zero are refused at
init (:func:`check_settings`); the store checks that an update stays finite.
"""

from __future__ import annotations

import numpy as np

from client_sdk.optimizers import SGD, Adagrad, Add, Optimizer

__all__ = ["apply", "check_settings", "fresh_state", "init_bound", "init_state", "state_nbytes"]


def init_state(opt: Optimizer, value: np.ndarray) -> dict[str, np.ndarray]:
    """The optimizer's slots for a new variable (Adagrad: the accumulator); empty for SGD/Add."""
    if isinstance(opt, Adagrad):
        return {
            "accumulator": np.full(value.shape, opt.initial_accumulator_value, dtype=value.dtype)
        }
    return {}


def init_bound(opt: Optimizer) -> float:
    """The largest magnitude in the slots :func:`init_state` makes (0 when there are none)."""
    return float(opt.initial_accumulator_value) if isinstance(opt, Adagrad) else 0.0


def check_settings(opt: Optimizer, dtype: np.dtype) -> None:
    """``ValueError`` for settings that would divide by zero on a variable of ``dtype``:
    Adagrad's ``epsilon`` and ``initial_accumulator_value`` both 0 in that dtype (the first
    zero gradient would make the value NaN). The specs check their ranges themselves
    (``client_sdk/optimizers.py``)."""
    if (
        isinstance(opt, Adagrad)
        and dtype.kind == "f"
        and not (dtype.type(opt.epsilon) > 0 or dtype.type(opt.initial_accumulator_value) > 0)
    ):
        raise ValueError(
            f"Adagrad epsilon {opt.epsilon!r} and initial_accumulator_value "
            f"{opt.initial_accumulator_value!r} are both 0 in {dtype.str}: a zero gradient would "
            f"divide 0 by 0; make epsilon at least {float(np.finfo(dtype).tiny):g} "
            "(1e-7 is the default)"
        )


def state_nbytes(state: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in state.values())


def apply(
    opt: Optimizer,
    value: np.ndarray,
    grad: np.ndarray,
    state: dict[str, np.ndarray],
    *,
    out: np.ndarray | None = None,
    state_out: dict[str, np.ndarray] | None = None,
    scratch: bool = False,
) -> None:
    """Apply one gradient: the new value goes to ``out`` (default: ``value``, in place), and the
    optimizer's new slots to ``state_out`` (default: ``state``, in place).

    ``grad`` must have ``value``'s shape and dtype; ``out``, if given, too (and must not overlap
    ``value``); ``state_out``, if given, holds an array of the same shape as each slot (see
    :func:`fresh_state`) and then ``value`` and ``state`` are only read. With ``scratch=True``
    the function may overwrite ``grad`` instead of allocating a temporary. Writing to a fresh
    ``out`` costs no more than updating in place, which is how the store moves a value that a
    reader still holds to new memory, and how it computes an update off the event loop.
    """
    if out is None:
        out = value
    if isinstance(opt, Add):
        np.add(value, grad, out=out)
    elif isinstance(opt, SGD):
        _sgd(opt, value, grad, out, scratch)
    elif isinstance(opt, Adagrad):
        acc = state["accumulator"]
        _adagrad(
            opt,
            value,
            grad,
            acc,
            acc if state_out is None else state_out["accumulator"],
            out,
            scratch,
        )
    else:  # from_wire only builds the three above
        raise TypeError(f"no server-side math for optimizer {type(opt).__name__}")


def fresh_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """New, uninitialised arrays shaped like each slot in ``state`` (for ``state_out``)."""
    return {key: np.empty_like(slot) for key, slot in state.items()}


def _sgd(opt: SGD, value: np.ndarray, grad: np.ndarray, out: np.ndarray, scratch: bool) -> None:
    step = grad if scratch else np.empty_like(value)
    np.multiply(grad, opt.lr, out=step)
    if opt.weight_decay:
        # value - lr*(g + wd*value) == value*(1 - lr*wd) - lr*g, without a temporary for wd*value
        np.multiply(value, 1.0 - opt.lr * opt.weight_decay, out=out)
        np.subtract(out, step, out=out)
    else:
        np.subtract(value, step, out=out)


def _adagrad(
    opt: Adagrad,
    value: np.ndarray,
    grad: np.ndarray,
    acc: np.ndarray,
    acc_out: np.ndarray,
    out: np.ndarray,
    scratch: bool,
) -> None:
    g = grad if scratch else grad.copy()
    tmp = np.empty_like(value)
    if opt.weight_decay:
        np.multiply(value, opt.weight_decay, out=tmp)
        np.add(g, tmp, out=g)
    np.multiply(g, g, out=tmp)
    np.add(acc, tmp, out=acc_out)
    np.sqrt(acc_out, out=tmp)
    np.add(tmp, opt.epsilon, out=tmp)
    np.divide(g, tmp, out=g)
    np.multiply(g, opt.lr, out=g)
    np.subtract(value, g, out=out)
