"""``set_optimizer``: change variables' optimizer on the shards, or freeze or unfreeze them.

The variables are a list of names, or a prefix string that every shard matches against what it
holds (``_targets.py``). The same optimizer type with other settings keeps the optimizer's
slots; another type resets them; each variable's reply says which (``"slots"``), and what it
has now (``optimizer``, ``optimizer_version``, ``frozen``). A write like a push: this worker's
id and a ``seq`` make a retry apply at most once.
"""

from __future__ import annotations

from typing import Any

from .. import _args, _replies
from .._core import Core
from .._exceptions import BadRequestError
from .._flow import Flow
from ..optimizers import Optimizer
from . import _targets

__all__ = ["set_optimizer"]


def set_optimizer(
    core: Core, target: Any, spec: Any = None, frozen: Any = None
) -> Flow[dict[str, dict[str, Any]]]:
    names, prefix = _args.target(target, "set_optimizer", core.fleet)
    if spec is None and frozen is None:
        raise BadRequestError(
            "set_optimizer: nothing to change: pass a spec (e.g. SGD(lr=0.01)), "
            "frozen=True or frozen=False, or both"
        )
    fields: dict[str, Any] = {}
    if spec is not None:
        if not isinstance(spec, Optimizer):
            raise BadRequestError(
                "set_optimizer: spec must be an optimizer spec from client_sdk.optimizers "
                f"(e.g. Adam(lr=1e-3)), got {type(spec).__name__}"
            )
        fields["optimizer"] = spec.to_wire()
    if frozen is not None:
        if not isinstance(frozen, bool):
            raise BadRequestError(
                f"set_optimizer: frozen must be True, False or None, got {frozen!r:.40}"
            )
        fields["frozen"] = frozen
    if names == []:
        return {}
    deadline = core.deadline()
    yield from core.require_fleet(deadline)
    batch = _targets.requests(core, "set_optimizer", names, prefix, fields, deadline)
    replies = core.collect(batch, (yield batch))
    if prefix is not None:
        return _targets.merged(batch, replies, "variables", core.shards)
    return _replies.per_variable(batch, replies, "variables", core.shards)
