"""Optimizer specs a worker attaches to a variable at ``init``, and their learning-rate schedules.

The shard applies them, per variable and in place (the math: ``server/optim.py``); this module
only says *what* to apply, and checks it. A spec is a small frozen dataclass; on the wire it is
a map ``{"type": ..., <every field>}`` (:meth:`Spec.to_wire`, :func:`from_wire`).

    ps.init({"w": w0}, optimizer=Adam(lr=3e-4, schedule=Cosine(total=10_000, warmup=100)))

Optimizers (semantics and defaults of PyTorch's ``torch.optim``, and TensorFlow's for FTRL; the
formulas are in docs/PROTOCOL.md):

``SGD``      lr, momentum, dampening, nesterov, weight_decay
``Adam``     lr, betas, epsilon, weight_decay (added to the gradient), amsgrad
``AdamW``    as Adam, weight_decay decoupled (the value shrinks by lr * weight_decay)
``RMSprop``  lr, alpha, epsilon, weight_decay, momentum, centered
``Adagrad``  lr, lr_decay, weight_decay, initial_accumulator_value, epsilon
``Ftrl``     lr, learning_rate_power, initial_accumulator_value, l1, l2, l2_shrinkage, beta
``Add``      no fields: a pushed tensor is a delta added to the value (the worker runs its
             own optimizer)

Every optimizer but ``Add`` also takes ``clip_norm`` (the gradient is scaled so that its L2
norm is at most this, before anything else; ``None``: no clipping) and ``schedule``, which
sets the learning rate of each update from ``t``, the number of gradients the optimizer has
applied to the variable before it (0 for the first):

``Constant()``                      lr
``StepDecay(every, gamma)``         lr * gamma ** floor(t / every)
``ExponentialDecay(gamma, every)``  lr * gamma ** (t / every)
``Cosine(total, warmup, min_lr)``   lr * (t + 1) / warmup while t < warmup; then down to
                                    min_lr along half a cosine until t = total; then min_lr

Every field has its own range (a learning rate >= 0, betas in [0, 1), booleans are booleans,
...): a value outside it, an unknown field, or a combination that cannot work (Nesterov
without momentum) raises :class:`SpecError` (a ``ValueError`` whose ``field`` is the field's
path, e.g. ``"schedule.total"``) naming the field and what is allowed, here at
construction, and on the shard (400, nothing created) at init. The shard also refuses settings
that would divide by zero in the variable's dtype (an ``epsilon`` that is 0 in float16).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

__all__ = [
    "MAX_SETTING",
    "MAX_STEPS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Add",
    "Constant",
    "Cosine",
    "ExponentialDecay",
    "Ftrl",
    "Optimizer",
    "RMSprop",
    "Schedule",
    "SpecError",
    "StepDecay",
    "from_wire",
    "schedule_from_wire",
]

#: The largest value of a rate or strength (a learning rate above it is a mistake, and its
#: products overflow float32).
MAX_SETTING = 1e6
#: The largest step count a schedule field takes (beyond any run, and exact in a double).
MAX_STEPS = 10**12


# -- field checks --------------------------------------------------------------------------------


class _Check:
    """How one field is checked, normalised and written on the wire."""

    def __call__(self, owner: str, name: str, value: Any) -> Any:
        raise NotImplementedError

    def wire(self, value: Any) -> Any:
        return value


class SpecError(ValueError):
    """A spec that cannot be built: ``field`` is the offending field's path in the wire map
    (``"lr"``, ``"betas[1]"``, ``"schedule.total"``; ``"type"`` for an unknown type)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _refuse(owner: str, name: str, allowed: str, value: Any) -> SpecError:
    return SpecError(name, f"{owner}.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class _Real(_Check):
    low: float = 0.0
    high: float = MAX_SETTING
    open_low: bool = False
    open_high: bool = False
    optional: bool = False

    def allowed(self) -> str:
        low = "(" if self.open_low else "["
        high = ")" if self.open_high else "]"
        text = f"a number in {low}{self.low:g}, {self.high:g}{high}"
        return f"None or {text}" if self.optional else text

    def __call__(self, owner: str, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _refuse(owner, name, self.allowed(), value)
        number = float(value)
        if not (
            math.isfinite(number)
            and (number > self.low if self.open_low else number >= self.low)
            and (number < self.high if self.open_high else number <= self.high)
        ):
            raise _refuse(owner, name, self.allowed(), value)
        return number


@dataclass(frozen=True)
class _Count(_Check):
    low: int = 0

    def __call__(self, owner: str, name: str, value: Any) -> Any:
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or not self.low <= int(value) <= MAX_STEPS
        ):
            raise _refuse(owner, name, f"a whole number in {self.low}..{MAX_STEPS}", value)
        return int(value)


class _Flag(_Check):
    def __call__(self, owner: str, name: str, value: Any) -> Any:
        if not isinstance(value, bool):
            raise _refuse(owner, name, "true or false (a boolean)", value)
        return value


class _Betas(_Check):
    ALLOWED = "a pair of numbers, each in [0, 1)"

    def __call__(self, owner: str, name: str, value: Any) -> Any:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
            raise _refuse(owner, name, self.ALLOWED, value)
        one = _Real(0.0, 1.0, open_high=True)
        return (one(owner, f"{name}[0]", value[0]), one(owner, f"{name}[1]", value[1]))

    def wire(self, value: Any) -> Any:
        return list(value)


class _ScheduleField(_Check):
    def __call__(self, owner: str, name: str, value: Any) -> Any:
        if isinstance(value, Schedule):
            return value
        if isinstance(value, Mapping):  # from the wire
            try:
                return schedule_from_wire(value)
            except SpecError as exc:
                raise SpecError(f"{name}.{exc.field}", f"{owner}.{name}: {exc}") from None
        raise _refuse(
            owner, name, "a schedule (Constant(), StepDecay, ExponentialDecay, Cosine)", value
        )

    def wire(self, value: Any) -> Any:
        return value.to_wire()


def _real(default: Any = MISSING, **limits: Any) -> Any:
    return field(default=default, metadata={"check": _Real(**limits)})


def _count(default: Any = MISSING, low: int = 0) -> Any:
    return field(default=default, metadata={"check": _Count(low)})


def _flag(default: bool = False) -> Any:
    return field(default=default, metadata={"check": _Flag()})


def _betas(default: tuple[float, float]) -> Any:
    return field(default=default, metadata={"check": _Betas()})


def _clip_norm() -> Any:
    return _real(None, open_low=True, optional=True)


#: The metadata of every optimizer's ``schedule`` field (its default: ``Constant()``).
_SCHEDULE = {"check": _ScheduleField()}


@dataclass(frozen=True)
class Spec:
    """A spec: a frozen dataclass whose every field is checked at construction."""

    type: ClassVar[str] = ""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for f in fields(self):
            check: _Check = f.metadata["check"]
            object.__setattr__(self, f.name, check(owner, f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """Checks that involve more than one field."""

    def to_wire(self) -> dict[str, Any]:
        """The wire map: ``type`` and every field."""
        out: dict[str, Any] = {"type": self.type}
        for f in fields(self):
            out[f.name] = f.metadata["check"].wire(getattr(self, f.name))
        return out


def _parse(spec: Any, by_type: Mapping[str, type[Spec]], what: str, example: str) -> Spec:
    if not isinstance(spec, Mapping):
        raise SpecError("type", f"{what} must be a map like {example}")
    kind = spec.get("type")
    cls = by_type.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SpecError("type", f"unknown {what} type {kind!r}; known: {sorted(by_type)}")
    names = {f.name for f in fields(cls)}
    extra = sorted(str(k) for k in set(spec) - names - {"type"})
    if extra:
        raise SpecError(
            extra[0], f"{what} {kind!r} has no field(s) {extra}; fields: {sorted(names)}"
        )
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in spec]
    if missing:
        raise SpecError(missing[0], f"{what} {kind!r} needs the field(s) {missing}")
    return cls(**{k: v for k, v in spec.items() if k != "type"})


# -- schedules -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule(Spec):
    """The learning rate of each update: :meth:`lr_at`."""

    def lr_at(self, lr: float, t: int) -> float:
        """The learning rate for the update after ``t`` applied ones, from the base ``lr``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(Schedule):
    """``lr`` for every update."""

    type: ClassVar[str] = "constant"

    def lr_at(self, lr: float, t: int) -> float:
        return lr


@dataclass(frozen=True)
class StepDecay(Schedule):
    """``lr * gamma ** floor(t / every)``: multiplied by ``gamma`` every ``every`` updates
    (torch's ``StepLR``, counted in updates)."""

    type: ClassVar[str] = "step"
    every: int = _count(low=1)
    gamma: float = _real(0.1, high=1.0, open_low=True)

    def lr_at(self, lr: float, t: int) -> float:
        return lr * float(self.gamma ** (t // self.every))


@dataclass(frozen=True)
class ExponentialDecay(Schedule):
    """``lr * gamma ** (t / every)``: multiplied by ``gamma`` over every ``every`` updates,
    smoothly (TensorFlow's ``ExponentialDecay``; torch's ``ExponentialLR`` with
    ``every=1``)."""

    type: ClassVar[str] = "exponential"
    gamma: float = _real(high=1.0, open_low=True)
    every: int = _count(1, low=1)

    def lr_at(self, lr: float, t: int) -> float:
        return lr * float(self.gamma ** (t / self.every))


@dataclass(frozen=True)
class Cosine(Schedule):
    """Linear warmup then cosine decay: ``lr * (t + 1) / warmup`` for the first ``warmup``
    updates, then from ``lr`` down to ``min_lr`` along half a cosine, reached at update
    ``total`` (warmup included), and ``min_lr`` after that."""

    type: ClassVar[str] = "cosine"
    total: int = _count(low=1)
    warmup: int = _count(0)
    min_lr: float = _real(0.0)

    def _check_together(self) -> None:
        if self.warmup > self.total:
            raise SpecError(
                "warmup",
                f"Cosine.warmup ({self.warmup}) must be at most Cosine.total ({self.total}), "
                "the updates the whole schedule takes",
            )

    def lr_at(self, lr: float, t: int) -> float:
        if t < self.warmup:
            return lr * (t + 1) / self.warmup
        if t >= self.total:
            return self.min_lr
        phase = (t - self.warmup) / (self.total - self.warmup)
        return self.min_lr + (lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * phase))


_SCHEDULES: dict[str, type[Spec]] = {
    c.type: c for c in (Constant, StepDecay, ExponentialDecay, Cosine)
}


def schedule_from_wire(spec: Any) -> Schedule:
    """Parse a schedule map; ``ValueError`` naming what is wrong and what is allowed."""
    parsed = _parse(
        spec, _SCHEDULES, "schedule", "{'type': 'cosine', 'total': 10000, 'warmup': 100}"
    )
    assert isinstance(parsed, Schedule)
    return parsed


# -- optimizers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer(Spec):
    """What a push does to a variable (a subclass below)."""

    def _check_together(self) -> None:
        schedule = getattr(self, "schedule", None)
        lr = getattr(self, "lr", None)
        if isinstance(schedule, Cosine) and lr is not None and schedule.min_lr > lr:
            raise SpecError(
                "schedule.min_lr",
                f"{type(self).__name__}.schedule.min_lr ({schedule.min_lr:g}) must be at most "
                f"{type(self).__name__}.lr ({lr:g}): the schedule decays from lr to min_lr",
            )


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD: ``d = g + weight_decay * w``; with momentum, ``buf = d`` on the first
    update and ``buf = momentum * buf + (1 - dampening) * d`` after, ``d = buf`` (Nesterov:
    ``d += momentum * buf``); ``w -= lr * d``."""

    type: ClassVar[str] = "sgd"
    lr: float = _real(1e-3)
    momentum: float = _real(0.0, high=1.0)
    dampening: float = _real(0.0, high=1.0)
    nesterov: bool = _flag()
    weight_decay: float = _real(0.0)
    clip_norm: float | None = _clip_norm()
    schedule: Schedule = field(default=Constant(), metadata=_SCHEDULE)

    def _check_together(self) -> None:
        super()._check_together()
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise SpecError(
                "nesterov",
                "SGD.nesterov needs SGD.momentum > 0 and SGD.dampening = 0 (got momentum "
                f"{self.momentum:g}, dampening {self.dampening:g})",
            )


def _positive_epsilon(default: float) -> Any:
    return _real(default, open_low=True)


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam: ``g += weight_decay * w``; ``m = b1*m + (1-b1)*g``;
    ``v = b2*v + (1-b2)*g*g``; ``w -= lr * (m / (1-b1**k)) / (sqrt(v / (1-b2**k)) + epsilon)``
    at the k-th update (amsgrad: with the running maximum of ``v`` in place of ``v``)."""

    type: ClassVar[str] = "adam"
    lr: float = _real(1e-3)
    betas: tuple[float, float] = _betas((0.9, 0.999))
    epsilon: float = _positive_epsilon(1e-8)
    weight_decay: float = _real(0.0)
    amsgrad: bool = _flag()
    clip_norm: float | None = _clip_norm()
    schedule: Schedule = field(default=Constant(), metadata=_SCHEDULE)


@dataclass(frozen=True)
class AdamW(Optimizer):
    """torch.optim.AdamW: Adam with decoupled weight decay, ``w *= 1 - lr * weight_decay``
    before the step (the gradient is left alone)."""

    type: ClassVar[str] = "adamw"
    lr: float = _real(1e-3)
    betas: tuple[float, float] = _betas((0.9, 0.999))
    epsilon: float = _positive_epsilon(1e-8)
    weight_decay: float = _real(1e-2)
    amsgrad: bool = _flag()
    clip_norm: float | None = _clip_norm()
    schedule: Schedule = field(default=Constant(), metadata=_SCHEDULE)


@dataclass(frozen=True)
class RMSprop(Optimizer):
    """torch.optim.RMSprop: ``g += weight_decay * w``; ``v = alpha*v + (1-alpha)*g*g``;
    centered: ``a = alpha*a + (1-alpha)*g`` and ``v - a*a`` in place of ``v``;
    ``d = g / (sqrt(v) + epsilon)``; momentum: ``buf = momentum*buf + d``, ``d = buf``;
    ``w -= lr * d``."""

    type: ClassVar[str] = "rmsprop"
    lr: float = _real(1e-2)
    alpha: float = _real(0.99, high=1.0, open_high=True)
    epsilon: float = _positive_epsilon(1e-8)
    weight_decay: float = _real(0.0)
    momentum: float = _real(0.0, high=1.0)
    centered: bool = _flag()
    clip_norm: float | None = _clip_norm()
    schedule: Schedule = field(default=Constant(), metadata=_SCHEDULE)


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad: ``g += weight_decay * w``; ``acc += g*g`` (``acc`` starts at
    ``initial_accumulator_value``); ``w -= lr / (1 + (k-1)*lr_decay) * g / (sqrt(acc) +
    epsilon)`` at the k-th update."""

    type: ClassVar[str] = "adagrad"
    lr: float = _real(1e-2)
    lr_decay: float = _real(0.0)
    weight_decay: float = _real(0.0)
    initial_accumulator_value: float = _real(0.0)
    epsilon: float = _real(1e-10)
    clip_norm: float | None = _clip_norm()
    schedule: Schedule = field(default=Constant(), metadata=_SCHEDULE)

    def _check_together(self) -> None:
        super()._check_together()
        if self.epsilon == 0 and self.initial_accumulator_value == 0:
            raise SpecError(
                "epsilon",
                "Adagrad.epsilon and Adagrad.initial_accumulator_value are both 0: a zero "
                "gradient would divide 0 by 0; make epsilon > 0 (1e-10 is the default)",
            )


@dataclass(frozen=True)
class Ftrl(Optimizer):
    """FTRL-Proximal as TensorFlow's ``tf.keras.optimizers.Ftrl``: per element, an
    accumulator ``n`` (starts at ``initial_accumulator_value``) and a linear term ``z``
    (starts at 0); the value is the closed-form solution of the regularised problem (l1
    makes it sparse). The formulas are in docs/PROTOCOL.md."""

    type: ClassVar[str] = "ftrl"
    lr: float = _real(1e-3, open_low=True)
    learning_rate_power: float = _real(-0.5, low=-MAX_SETTING, high=0.0)
    initial_accumulator_value: float = _real(0.1)
    l1: float = _real(0.0)
    l2: float = _real(0.0)
    l2_shrinkage: float = _real(0.0)
    beta: float = _real(0.0)
    clip_norm: float | None = _clip_norm()
    schedule: Schedule = field(default=Constant(), metadata=_SCHEDULE)

    def _check_together(self) -> None:
        super()._check_together()
        if (
            self.initial_accumulator_value == 0
            and self.l2 == 0
            and self.beta == 0
            and self.learning_rate_power < 0
        ):
            raise SpecError(
                "initial_accumulator_value",
                "Ftrl.initial_accumulator_value, Ftrl.l2 and Ftrl.beta are all 0: a zero "
                "gradient would divide by 0; make initial_accumulator_value > 0 (0.1 is "
                "the default)",
            )
        if isinstance(self.schedule, Cosine) and self.schedule.min_lr == 0:
            raise SpecError(
                "schedule.min_lr",
                "Ftrl.schedule.min_lr must be > 0: FTRL divides by the learning rate",
            )


@dataclass(frozen=True)
class Add(Optimizer):
    """No optimizer on the shard: a pushed tensor is a delta added to the value."""

    type: ClassVar[str] = "add"


_OPTIMIZERS: dict[str, type[Spec]] = {
    c.type: c for c in (SGD, Adam, AdamW, RMSprop, Adagrad, Ftrl, Add)
}


def from_wire(spec: Any) -> Optimizer:
    """Parse an optimizer map; raises ``ValueError`` naming what is wrong and what is allowed."""
    parsed = _parse(spec, _OPTIMIZERS, "optimizer", "{'type': 'sgd', 'lr': 0.1}")
    assert isinstance(parsed, Optimizer)
    return parsed
