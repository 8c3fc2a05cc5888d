"""Optimizer specs a worker attaches to a variable at ``init``; the shard applies them.

A spec is a small frozen dataclass; on the wire it is a map ``{"type": ..., <fields>}``
(:meth:`to_wire` / :func:`from_wire`). The math lives on the shard (``server/optim.py``).

    ps.init({"w": w0}, optimizer=Adagrad(lr=0.1))

``SGD``      value -= lr * (grad + weight_decay * value)
``Adagrad``  acc += g*g;  value -= lr * g / (sqrt(acc) + epsilon)    (Downpour's choice)
``Add``      value += grad  (the worker runs its own optimizer and pushes deltas)

Every field is a finite number in ``0..MAX_SETTING`` (1e6), and Adagrad needs ``epsilon`` or
``initial_accumulator_value`` above 0 (else a zero gradient divides 0 by 0): a spec outside
that raises ``ValueError`` at construction here, and is refused (400) by the shard at init.
The shard also refuses an Adagrad whose ``epsilon`` and ``initial_accumulator_value`` are both
0 in the variable's dtype (e.g. below float16's smallest number), and any update whose result
would not be finite (422, nothing applied).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

__all__ = ["MAX_SETTING", "SGD", "Adagrad", "Add", "Optimizer", "from_wire"]

#: The largest value of any optimizer field (a learning rate above it is a mistake, and
#: its products overflow float32).
MAX_SETTING = 1e6


@dataclass(frozen=True)
class Optimizer:
    type: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(
                    f"{type(self).__name__}.{f.name} must be a finite number, got {v!r}"
                )
            if not 0 <= v <= MAX_SETTING:
                raise ValueError(
                    f"{type(self).__name__}.{f.name} must be in 0..{MAX_SETTING:g}, got {v!r}"
                )

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **{k: float(v) for k, v in asdict(self).items()}}


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD: ``value -= lr * (grad + weight_decay * value)``."""

    type: ClassVar[str] = "sgd"
    lr: float = 0.01
    weight_decay: float = 0.0


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad, as in Downpour SGD: per-element step sizes shrink with the squared-gradient sum."""

    type: ClassVar[str] = "adagrad"
    lr: float = 0.01
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epsilon == 0 and self.initial_accumulator_value == 0:
            raise ValueError(
                "Adagrad.epsilon and Adagrad.initial_accumulator_value are both 0: "
                "a zero gradient would divide 0 by 0; make epsilon > 0 (1e-7 is "
                "the default)"
            )


@dataclass(frozen=True)
class Add(Optimizer):
    """No optimizer on the shard: a pushed tensor is a delta added to the value."""

    type: ClassVar[str] = "add"


_BY_TYPE: dict[str, type[Optimizer]] = {c.type: c for c in (SGD, Adagrad, Add)}


def from_wire(spec: Any) -> Optimizer:
    """Parse an optimizer map; raises ``ValueError`` naming what is wrong and what is allowed."""
    if not isinstance(spec, Mapping):
        raise ValueError("optimizer must be a map like {'type': 'sgd', 'lr': 0.1}")
    kind = spec.get("type")
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown optimizer type {kind!r}; known: {sorted(_BY_TYPE)}")
    names = {f.name for f in fields(cls)}
    extra = set(spec) - names - {"type"}
    if extra:
        raise ValueError(
            f"optimizer {kind!r} has no field(s) {sorted(extra)}; fields: {sorted(names)}"
        )
    return cls(**{k: v for k, v in spec.items() if k != "type"})
