"""Which reads a replica of a group answers, and what its replies say of where it is.

A replica's data-plane reads (``pull``, ``pull_rows``, ``poll``, ``wait``) are the primary's
to answer: a client that reads from a replica it takes for the primary must learn when that
is no longer true, or it would read a state that stopped moving (a replica cut off from its
group) for ever. So a replica that does not take writes now (a backup, a replica that stepped
down or does not know its primary yet, a primary whose lease ran out) refuses them with 421
``not_primary``, naming the primary when it knows it, as it refuses writes.

A fleet checkpoint is the primary's too: it is the state writes are acknowledged from, and a
backup that took one would neither pause the primary's writes nor hold every acknowledged
write. A replica that does not take writes refuses a checkpoint's ``pause`` and ``resume``
with the same 421, so the SDK sends the checkpoint to the primary (its ``snapshot`` round
needs the pause; a plain ``POST /v1/snapshot`` of this replica's own state is answered by any
replica).

A read that says a backup may answer it (header ``x-paramshard-allow-backup: 1``: the SDK's
``pull(..., allow_backup=True)``) is answered by a **backup** from its own state: every write
its primary forwarded and it applied, which is never ahead of the primary and may be behind
by the writes still on their way (its lag). Such a read is still refused (421 ``not_primary``)
by a replica that is not a backup of a known primary, and, under leadership from etcd, by a
backup the in-sync set does not list (it may be far behind, or hold writes no primary has):
the SDK then reads from the primary.

Every reply of a replica of a group says where the replica was when the request came in
(:func:`position_headers`): ``x-paramshard-role``, ``x-paramshard-epoch`` and
``x-paramshard-lsn`` (the values of the reply hold every write up to that lsn). A shard
without replicas adds nothing.
"""

from __future__ import annotations

from typing import Any

from client_sdk import wire

from ..errors import ShardError
from .role import BACKUP, Role, not_primary

__all__ = [
    "ALLOW_BACKUP",
    "CHECKPOINT",
    "PRIMARYS",
    "READS",
    "allows_backup",
    "position_headers",
    "read_refusal",
    "refusal",
]

#: The data-plane verbs that read: the primary's to answer, a backup's when allowed.
READS = frozenset({"pull", "pull_rows", "poll", "wait"})
#: A fleet checkpoint's rounds that only the primary answers (module docstring).
CHECKPOINT = frozenset({"pause", "resume"})
#: Every verb a replica that does not take writes refuses (the reads unless allowed).
PRIMARYS = READS | CHECKPOINT
ALLOW_BACKUP = wire.HEADER_ALLOW_BACKUP.encode()
_ROLE = wire.HEADER_ROLE.encode()
_EPOCH = wire.HEADER_EPOCH.encode()
_LSN = wire.HEADER_LSN.encode()


def allows_backup(value: bytes | str | None) -> bool:
    """Whether the ``x-paramshard-allow-backup`` header's value (``None``: absent) lets a
    backup answer the read."""
    return value is not None and value.strip() in (b"1", "1")


def refusal(role: Role, leadership: Any, allow_backup: bool) -> ShardError | None:
    """421 ``not_primary`` for a read this replica must not answer (module docstring), else
    ``None``. ``leadership``: the shard's campaign in etcd (``None`` for a static group)."""
    if role.acknowledges:
        return None
    if (
        allow_backup
        and role.kind == BACKUP
        and (leadership is None or getattr(leadership, "eligible", False))
    ):
        return None
    error = not_primary(role.view)
    if allow_backup and role.kind == BACKUP:
        error.message = (
            f"this backup of the shard is not listed in-sync (in etcd) now, so it may lack "
            f"acknowledged writes: read from the primary {role.primary}"
        )
        error.details = {**error.details, "in_sync": False}
    else:
        error.message += (
            "; reads and fleet checkpoints are the primary's too (a read may say a backup "
            f"may answer it: {wire.HEADER_ALLOW_BACKUP}: 1)"
        )
    return error


def read_refusal(replication: Any, state: Any, allow: bytes | str | None) -> ShardError | None:
    """:func:`refusal` for ``replication`` (a shard's; ``state`` its ``app.state``, where its
    leadership is) and a read whose ``x-paramshard-allow-backup`` is ``allow`` (``None``:
    absent)."""
    return refusal(replication.role, getattr(state, "leadership", None), allows_backup(allow))


def position_headers(replication: Any) -> list[tuple[bytes, bytes]]:
    """The headers saying where ``replication``'s replica is now: role, epoch, applied lsn."""
    view = replication.role.view
    return [
        (_ROLE, view.kind.encode()),
        (_EPOCH, str(view.epoch).encode()),
        (_LSN, str(replication.log.head).encode()),
    ]
