"""``increment``: atomic fetch-and-add on a counter (``global_step``); every caller gets a
distinct new value.

The counter is created at 0 on first use, an int64 or a float64 as ``kind`` says (or as
``delta``'s type does). A write like a push: this worker's id and a ``seq`` make a retry
apply at most once, and a retry of an applied increment gets the value the first got.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _args
from .._core import Core
from .._exceptions import BadRequestError, ProtocolError
from .._flow import Flow
from ..placement import shard_for

__all__ = ["increment"]


def increment(core: Core, name: Any, delta: Any = 1, kind: Any = None) -> Flow[int | float]:
    _args.valid_name(name)
    delta = _delta(delta, kind)
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    msg = {
        "name": name,
        "delta": delta,
        "worker_id": core.settings.worker_id,
        "seq": core.next_seq(),
    }
    if kind is not None:
        msg["kind"] = kind
    batch = [
        core.post(
            shard_for(name, core.n),
            "increment",
            msg,
            deadline,
            mutating=True,
            names=[name],
            retry_safe=True,
        )
    ]
    (reply,) = core.collect(batch, (yield batch))
    value = reply.msg.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        url = core.url(batch[0].shard)
        raise ProtocolError(f"shard {url} sent an increment reply without a value", shard=url)
    return value


def _delta(delta: Any, kind: Any) -> int | float:
    """``delta`` checked, and taken as ``kind`` (``"int"``, ``"float"`` or ``None``: its own
    type); :class:`BadRequestError` saying what to pass instead."""
    if isinstance(delta, np.generic):
        delta = delta.item()
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise BadRequestError(f"increment delta must be an int or float, got {delta!r}")
    if isinstance(delta, float) and not math.isfinite(delta):
        raise BadRequestError(f"increment delta must be finite, got {delta!r}")
    if kind not in (None, "int", "float"):
        raise BadRequestError(f"increment kind must be 'int', 'float' or None, got {kind!r}")
    if kind == "float":
        delta = float(delta)
    elif kind == "int" and isinstance(delta, float):
        if not delta.is_integer():
            raise BadRequestError(
                f"increment delta {delta!r} is not a whole number, but kind is 'int'"
            )
        delta = int(delta)
    if isinstance(delta, int) and not -(2**63) <= delta < 2**63:
        raise BadRequestError(f"increment delta must fit in 64 bits, got {delta!r}")
    checked: int | float = delta
    return checked
