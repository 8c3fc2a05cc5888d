"""``delete``: variables removed, so that a run can start over (docs/PROTOCOL.md §3).

:func:`build` checks a delete against the variables it names or matches and returns a
:class:`Delete`, the one operation that removes them: the request's ``worker_id`` and ``seq``
and the names it removes (a prefix resolved to them; names the shard does not hold are left
out: deleting what is not there succeeds, removing nothing). The store removes them from its
table and its counts (:meth:`Control.delete <server.store.control.Control.delete>`),
after :func:`release` has let go of what each one held that others share.

A variable whose sync round is open is not deleted (409 ``conflict``): the gradients the round
accepted would be lost without their workers being told.

The event-loop thread only, while no push writes the variables off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardError
from .variable import Variable

__all__ = ["Delete", "build", "release"]


@dataclass(frozen=True, slots=True)
class Delete:
    """Remove each variable of ``names``; once per ``(worker_id, seq)``."""

    worker_id: str
    seq: int
    names: tuple[str, ...]
    #: The partitioned variables whose layouts it removes (:mod:`server.store.layouts`).
    layouts: tuple[str, ...] = ()


def build(
    variables: list[Variable], worker_id: str, seq: int, layouts: tuple[str, ...] = ()
) -> Delete:
    """The operation that removes ``variables`` (owned, found): 409 ``conflict`` if a sync
    round is open on one (``details.open_rounds``)."""
    open_rounds = [var.name for var in variables if var.round is not None]
    if open_rounds:
        raise ShardError(
            "conflict",
            f"delete refused, nothing deleted: a sync round is open on {open_rounds[:10]}; its "
            "gradients would be lost. Retry once it has closed (when its replicas have pushed, "
            "at the latest after its timeout)",
            {"open_rounds": open_rounds},
        )
    return Delete(worker_id, seq, tuple(var.name for var in variables), layouts)


def release(var: Variable) -> None:
    """Let go of what a deleted variable holds beyond its own arrays: its row of a slab stays
    empty (the block is freed with its last member, and is never again sent or updated
    whole), and its slots go at once (the slab would otherwise keep them alive)."""
    slab = var._slab
    if slab is not None:
        slab.leave(var)
        var._slab = None
    var.state = {}
