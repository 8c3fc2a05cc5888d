"""The replication log: every write of a primary, in the order it took effect.

:class:`ReplicationLog` is the store's journal (:mod:`server.store.journal`) on a shard that
is one replica of a group. Each write the store takes becomes one :class:`Entry`: the epoch it
was taken at, its **lsn** (log sequence number: 1, 2, 3, ... in the order the writes took
effect), the store method called (``Writes.push_async``, ``EmbeddingTables.create``, ...) and
the arguments it was called with, the request's decoded arguments as the verb's builder takes
them (its ``worker_id`` and ``seq`` among them, so the dedup table replays with the entries),
each array held as ``{TENSOR: array}``, ready for the wire.
A backup replays an entry by calling the same method with the same arguments
(:mod:`server.replication.replay`): the builders are pure and the state is the same, so it
computes what the primary did. A refused write is never an entry (it changed nothing).

Before the write runs, :meth:`ReplicationLog.begin` refuses it on a replica that does not
take writes (421 ``not_primary``: :meth:`Role.check_writable
<server.replication.role.Role.check_writable>`), and makes the arguments' arrays read-only,
uncopied: the write then computes into memory of its own (an update uses a gradient's buffer
as scratch space only when it is writable), as a backup's replay does, so the entry keeps the
bytes as they came (views of the request's body: what goes to the backups is that memory).
A push's ``finite`` (the sums of squares it found checking its gradients as they arrived)
travels with the entry, so a backup neither scans those gradients again nor finds other bounds
for their updates than its primary did; ``block`` (the gradients as one array) is left out, a
hint the backup does without, and made read-only too, being the gradients' memory.

The entry is taken, and its lsn given, when the write commits (:mod:`server.store.journal`):
for a push applied on the event loop, once it can no longer be refused and before it writes,
so :attr:`ReplicationLog.on_commit` (the forwarder) may start sending it while it applies.

The log keeps in memory the entries some replica of the group may still need, at most
``max_bytes`` of their arrays (at least the newest one): a backup that needs older ones catches
up from a snapshot instead. An entry every replica of the group has applied is let go
(:meth:`ReplicationLog.release`; the primary knows where each backup is, and tells its backups
in each batch, :mod:`server.replication.forward`): no replica can ask for it again but one that
restarts from a snapshot of its own older than it, which is sent a snapshot. So while the
backups keep up the log holds the writes on their way, and the memory of a push's request body
goes back to the heap once its backups have it, for the next push to reuse, instead of growing
the heap by a body per push until ``max_bytes`` is reached. A backup keeps the entries it
replayed the same way (:meth:`ReplicationLog.append`), at the lsns its primary gave them, so
it can serve the tail if it becomes primary.

An entry is known by its **(epoch, lsn)**, not its lsn alone: a primary frozen or cut off may
have applied a write at lsn ``L`` that never reached a backup, while the backup, elected in its
place, took another write at ``L`` in a newer epoch. Only one primary ever writes at an epoch,
and a backup appends an entry only after the one before it matched its primary's (Raft's log
matching, :mod:`server.replication.replay`), so two logs holding the same (epoch, lsn) hold
the same writes up to it. The log knows the epoch of every entry it holds and of the one just
before the oldest (its **base**: the lsn a snapshot or catch-up left it at, or the newest entry
it let go): :meth:`ReplicationLog.epoch_at`.

Thread-safety: none; the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .role import Role

__all__ = [
    "DROPPED_KWARGS",
    "ENTRY_OVERHEAD",
    "TENSOR",
    "Entry",
    "ReplicationLog",
    "current_stage",
]

#: The key of the one-entry map an entry holds each array in: no variable's name (``#`` is
#: not a name's character), so an argument's own maps are never mistaken for one.
TENSOR = "#nd"
#: Keyword arguments of the store's writes that are hints a backup does without: never logged.
DROPPED_KWARGS = frozenset({"block", "group"})
#: Bytes an entry is counted for beyond its arrays' (its fields, containers and names).
ENTRY_OVERHEAD = 256
#: The stage the current request's body was streamed as (:mod:`server.replication.stages`):
#: the write's entry keeps it, so that it names the stage instead of carrying those bytes.
current_stage: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "paramshard_stage", default=None
)


@dataclass(slots=True)
class Entry:
    """One write as the primary took it (module docstring)."""

    lsn: int
    epoch: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    #: Bytes counted against the log's bound.
    nbytes: int
    #: The stage its request's body was streamed as to some backups
    #: (:class:`server.replication.stages.Stage`), or ``None``.
    stage: Any = None

    def to_wire(self) -> list[Any]:
        return [self.lsn, self.epoch, self.method, self.args, self.kwargs]


def _kept(obj: Any, sizes: list[int]) -> Any:
    """``obj`` as an entry keeps it: its containers copied (mappings as dicts, tuples as
    lists), each array as ``{TENSOR: array}``, made read-only (the write then never changes
    its bytes), every array's bytes added to ``sizes[0]``."""
    if isinstance(obj, np.ndarray):
        sizes[0] += obj.nbytes
        obj.flags.writeable = False
        return {TENSOR: obj}
    if type(obj) in (str, int, float, bool) or obj is None:
        return obj
    if isinstance(obj, Mapping):
        return {k: _kept(v, sizes) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_kept(v, sizes) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


class ReplicationLog:
    """The writes of this replica, in order (module docstring). ``head`` is the lsn of the
    newest entry (0: none yet); entries from ``first`` to ``head`` are held."""

    def __init__(self, role: Role, max_bytes: int) -> None:
        self.role = role
        self.max_bytes = max_bytes
        self.head = 0
        #: The epoch of the entry at ``first - 1`` (0: none, or the state before any write).
        self.base_epoch = 0
        self._entries: deque[Entry] = deque()
        self._bytes = 0
        #: Set whenever an entry is added (the forwarders wait on it), then replaced.
        self._added = asyncio.Event()
        #: Entries let go to stay within ``max_bytes``, since the start.
        self.trimmed = 0
        #: Entries let go once every replica of the group had applied them, since the start.
        self.released = 0
        #: Called (synchronously, on the loop) each time this replica commits an entry of its
        #: own, possibly in the middle of the write: it must not raise nor wait.
        self.on_commit: Callable[[], None] | None = None

    # -- the journal (server.store.journal) -------------------------------------------------

    def begin(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, list[Any], dict[str, Any], int, Any]:
        self.role.check_writable()
        sizes = [ENTRY_OVERHEAD]
        kept_args = [_kept(a, sizes) for a in args]
        kept_kwargs = {k: _kept(v, sizes) for k, v in kwargs.items() if k not in DROPPED_KWARGS}
        block = kwargs.get("block")
        if isinstance(block, np.ndarray):  # the gradients' memory: no scratch space either
            block.flags.writeable = False
        return method, kept_args, kept_kwargs, sizes[0], current_stage.get()

    def commit(self, begun: tuple[str, list[Any], dict[str, Any], int, Any]) -> None:
        method, args, kwargs, nbytes, stage = begun
        self._add(Entry(self.head + 1, self.role.epoch, method, args, kwargs, nbytes, stage))
        if self.on_commit is not None:
            self.on_commit()

    # -- a backup's copy ----------------------------------------------------------------------

    def append(self, entry: Entry) -> None:
        """Keep an entry replayed from the primary (its lsn must follow ``head``)."""
        if entry.lsn != self.head + 1:
            raise ValueError(f"entry lsn {entry.lsn} does not follow the log's head {self.head}")
        self._add(entry)

    def restart_at(self, lsn: int, epoch: int = 0) -> None:
        """Forget every entry: the state is now what ``lsn`` writes made (a snapshot
        installed), the last of them written at ``epoch``, and the next entry is ``lsn + 1``."""
        self._entries.clear()
        self._bytes = 0
        self.head = lsn
        self.base_epoch = epoch
        self._wake()

    def release(self, lsn: int) -> None:
        """Let go of the entries up to ``lsn``: every replica of the group has applied them,
        so none will be sent again (module docstring)."""
        entries = self._entries
        while entries and entries[0].lsn <= lsn:
            gone = entries.popleft()
            self._bytes -= gone.nbytes
            self.base_epoch = gone.epoch
            self.released += 1

    # -- reading ------------------------------------------------------------------------------

    @property
    def first(self) -> int:
        """The lsn of the oldest entry held (``head + 1`` when none is)."""
        return self._entries[0].lsn if self._entries else self.head + 1

    @property
    def last_epoch(self) -> int:
        """The epoch of the entry at ``head`` (the base's when none is held)."""
        return self._entries[-1].epoch if self._entries else self.base_epoch

    @property
    def position(self) -> tuple[int, int]:
        """``(last_epoch, head)``: how complete this log is (the higher, the more complete)."""
        return self.last_epoch, self.head

    def epoch_at(self, lsn: int) -> int | None:
        """The epoch of the entry at ``lsn``, for ``first - 1 <= lsn <= head``; ``None``
        outside (not known here)."""
        first = self.first
        if lsn == first - 1:
            return self.base_epoch
        if first <= lsn <= self.head:
            return self._entries[lsn - first].epoch
        return None

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def since(self, lsn: int, max_bytes: int) -> list[Entry] | None:
        """The entries after ``lsn``, oldest first, as many as fit in ``max_bytes`` (at least
        one when there is one); ``None`` when some of them are not held any more."""
        if lsn >= self.head:
            return []
        first = self.first
        if lsn + 1 < first:
            return None
        out: list[Entry] = []
        total = 0
        entries = self._entries
        for i in range(lsn + 1 - first, len(entries)):
            entry = entries[i]
            total += entry.nbytes
            if out and total > max_bytes:
                break
            out.append(entry)
        return out

    async def added_after(self, lsn: int) -> None:
        """Return once the log's head is past ``lsn``."""
        while self.head <= lsn:
            await self._added.wait()

    # -- internals ----------------------------------------------------------------------------

    def _add(self, entry: Entry) -> None:
        self._entries.append(entry)
        self.head = entry.lsn
        self._bytes += entry.nbytes
        entries = self._entries
        while self._bytes > self.max_bytes and len(entries) > 1:
            gone = entries.popleft()
            self._bytes -= gone.nbytes
            self.base_epoch = gone.epoch
            self.trimmed += 1
        self._wake()

    def _wake(self) -> None:
        added, self._added = self._added, asyncio.Event()
        added.set()
