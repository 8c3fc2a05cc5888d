"""A backup's side of replication: the batches its primary forwards, applied in lsn order.

A batch (``POST /v1/replicate``, docs/PROTOCOL.md §6) is a message ``{"epoch", "primary",
"entries": [[lsn, epoch, method, args, kwargs], ...]}`` whose arrays travel as tensors (framed),
each wrapped as ``{TENSOR: tensor}`` (:mod:`server.replication.log`). :class:`Replayer`:

* refuses a batch whose epoch is below the highest this replica has seen (409
  ``stale_epoch``), and otherwise takes its sender as the primary
  (:meth:`Role.accept_forwarded <server.replication.role.Role.accept_forwarded>`);
* applies the entries strictly in lsn order, one batch at a time, and only where its log and
  its primary's agree: a batch of entries carries ``"prev": [lsn, epoch]``, the entry its first
  one follows, and is applied only if that is this replica's newest entry, at that epoch
  (Raft's log matching: two logs that hold the same (epoch, lsn) hold the same writes up to
  it). Otherwise it is refused, changing nothing (409 ``conflict`` with
  ``details.applied_lsn`` and ``details.lsn_epoch``: where this replica's log is); the
  primary then sends from there, or, when this replica holds a write the primary never had (it
  led at an older epoch, and its answer never went out), its whole state (below): a state has no
  undo, so a replica whose log diverged is replaced whole;
* applies an entry by calling the store method it names, one of the journaled writes
  (:mod:`server.store.journal`) and no other, with its arguments, inside
  :func:`~server.store.journal.replaying`: the same builder and the same application as on
  the primary, the dedup table included;
* keeps each entry applied in its own log, at the primary's lsn and epoch, and lets go of
  those up to the batch's ``"stable"`` lsn, which every replica of the group has applied
  (:mod:`server.replication.forward`);
* answers the lsn it has applied up to.

A batch may instead carry ``"install"``: the primary's whole state as snapshot files, at an
(epoch, lsn) (:mod:`server.replication.catchup`), for a backup that needs writes the primary's
log let go, or whose log diverged from it. It is installed first (the whole state replaced, its
log restarted there), then the batch's entries follow; :attr:`Replayer.replaced` is told (a
replica whose state was replaced may campaign only once its primary confirmed it in-sync
after).

An entry the primary applied but this replica refuses means the states differ (a bug): it is
logged, counted (``refused``), and passed over, so replication goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from client_sdk import wire

from ..errors import ShardError
from ..store.journal import replaying
from .log import ENTRY_OVERHEAD, TENSOR, Entry, ReplicationLog
from .role import Role
from .stages import STAGED, StageStore

__all__ = ["Replayer", "writes_of"]

logger = logging.getLogger("paramshard.replication")


def writes_of(*targets: Any) -> dict[str, Any]:
    """The journaled write methods of ``targets`` (bound), by qualified name: what an entry
    may name."""
    out = {}
    for target in targets:
        for name in dir(type(target)):
            method = getattr(type(target), name, None)
            if getattr(method, "journaled", False) is True:
                out[method.__qualname__] = getattr(target, name)
    return out


def _bad(message: str) -> ShardError:
    return ShardError("bad_request", f"replicate: {message}")


def _decoded(
    obj: Any, body: wire.Buffer | None, sizes: list[int], stages: Mapping[str, Any] | None = None
) -> tuple[Any, Any]:
    """``obj`` as received, twice: as the method takes it (each ``{TENSOR: t}`` a read-only
    array over the body's bytes, each ``{STAGED: [id, t]}`` one over that stage's, so no update
    uses it as scratch space) and as the log keeps it (the same arrays, wrapped as
    ``{TENSOR: array}``)."""
    if type(obj) is dict:
        if len(obj) == 1 and (TENSOR in obj or STAGED in obj):
            try:
                if TENSOR in obj:
                    array = wire.decode_tensor(obj[TENSOR], body)
                else:
                    ref = obj[STAGED]
                    if type(ref) is not list or len(ref) != 2 or ref[0] not in (stages or {}):
                        raise _bad(f"{STAGED} must be [id, tensor] naming a stage of 'stages'")
                    array = wire.decode_tensor(ref[1], stages[ref[0]])  # type: ignore[index]
            except wire.WireError as exc:
                raise _bad(f"a tensor of an entry: {exc.message}") from None
            array.flags.writeable = False
            sizes[0] += array.nbytes
            return array, {TENSOR: array}
        call, kept = {}, {}
        for k, v in obj.items():
            call[k], kept[k] = _decoded(v, body, sizes, stages)
        return call, kept
    if type(obj) is list:
        pairs = [_decoded(v, body, sizes, stages) for v in obj]
        return [c for c, _ in pairs], [k for _, k in pairs]
    return obj, obj


class Replayer:
    """Applies forwarded batches to this replica's state (module docstring)."""

    def __init__(
        self,
        role: Role,
        log: ReplicationLog,
        writes: Mapping[str, Any],
        install: Callable[[dict[str, Any], Any], Awaitable[None]] | None = None,
        stages: StageStore | None = None,
    ) -> None:
        self.role = role
        #: The stages the primary streamed to this replica (:mod:`server.replication.stages`).
        self.stages = stages
        self.log = log
        #: Replaces the whole state with a catch-up's (its message and its values' array).
        self.install = install
        #: Catch-ups installed since the start.
        self.installed = 0
        self.writes = dict(writes)
        self._signatures = {name: inspect.signature(m) for name, m in self.writes.items()}
        #: Held while a batch is applied (and while a snapshot captures the state).
        self.lock = asyncio.Lock()
        #: Entries this replica refused although its primary had applied them.
        self.refused = 0
        #: Called once a catch-up replaced the whole state (leadership listens).
        self.replaced: Callable[[], None] = lambda: None

    async def apply(self, msg: Mapping[str, Any], body: wire.Buffer | None) -> int:
        """Apply batch ``msg`` (module docstring); the lsn applied up to (the epoch of the entry
        there is ``self.log.last_epoch``)."""
        epoch, primary, entries = msg.get("epoch"), msg.get("primary"), msg.get("entries")
        if type(epoch) is not int or epoch < 0:
            raise _bad(f"'epoch' must be an int >= 0, got {epoch!r}")
        if not isinstance(primary, str) or not primary:
            raise _bad("'primary' must be the sender's URL")
        if not isinstance(entries, list):
            raise _bad("'entries' must be a list")
        install = msg.get("install")
        if install is not None and (
            not isinstance(install, dict)
            or type(install.get("lsn")) is not int
            or install["lsn"] < 0
            or type(install.get("epoch", 0)) is not int
            or type(install.get("values")) is not dict
        ):
            raise _bad(
                "'install' must be a map with 'lsn', 'epoch', the snapshot's files and 'values'"
            )
        stable = msg.get("stable")
        if stable is not None and (type(stable) is not int or stable < 0):
            raise _bad(f"'stable' must be an int >= 0, got {str(stable)[:120]}")
        prev = msg.get("prev")
        if prev is None and entries:
            raise _bad("a batch of entries needs 'prev': [lsn, epoch] of the entry it follows")
        if prev is not None and (
            type(prev) is not list or len(prev) != 2 or any(type(x) is not int for x in prev)
        ):
            raise _bad(f"'prev' must be [lsn, epoch], got {str(prev)[:120]}")
        for raw in entries:
            if (
                type(raw) is not list
                or len(raw) != 5
                or type(raw[0]) is not int
                or type(raw[1]) is not int
                or raw[2] not in self.writes
                or type(raw[3]) is not list
                or type(raw[4]) is not dict
            ):
                raise _bad(
                    "each entry must be [lsn, epoch, method, args, kwargs] naming a journaled "
                    f"write, got {str(raw)[:120]}"
                )
        names = msg.get("stages")
        if names is not None and (
            type(names) is not list
            or not names
            or any(type(i) is not str for i in names)
            or self.stages is None
        ):
            raise _bad("'stages' must be a list of the ids of the stages the entries name")
        if entries:
            at, at_epoch = prev
            for raw in entries:
                if raw[0] != at + 1 or not at_epoch <= raw[1] <= epoch:
                    raise _bad(
                        f"entry {raw[0]} of epoch {raw[1]} does not follow lsn {at} of epoch "
                        f"{at_epoch} in a batch of epoch {epoch}"
                    )
                at, at_epoch = raw[0], raw[1]
        self.role.accept_forwarded(epoch, primary)
        staged = None
        if names:  # bytes the entries name, streamed while the primary received them
            staged = await self.stages.take(names, self.log.head, self.log.last_epoch)  # type: ignore[union-attr]
        async with self.lock:
            self.role.accept_forwarded(epoch, primary)  # again: another batch may have won
            log = self.log
            if install is not None and self.install is not None:
                values, _ = _decoded(install["values"], body, [0])
                await self.install(install, values)
                log.restart_at(install["lsn"], install.get("epoch", 0))
                self.installed += 1
                self.replaced()
            if entries and (log.head, log.last_epoch) != tuple(prev):
                raise ShardError(
                    "conflict",
                    f"replicate: the entries follow lsn {prev[0]} of epoch {prev[1]}, but this "
                    f"replica's newest is lsn {log.head} of epoch {log.last_epoch}: send from "
                    "there if this primary's log holds that entry, else this replica's whole "
                    "state",
                    {"applied_lsn": log.head, "lsn_epoch": log.last_epoch},
                )
            for lsn, entry_epoch, method, args, kwargs in entries:
                sizes = [ENTRY_OVERHEAD]
                call_args, kept_args = _decoded(args, body, sizes, staged)
                call_kwargs, kept_kwargs = _decoded(kwargs, body, sizes, staged)
                try:
                    self._signatures[method].bind(*call_args, **call_kwargs)
                except TypeError as exc:
                    raise _bad(f"entry {lsn}: the arguments do not fit {method}: {exc}") from None
                await self._call(lsn, method, call_args, call_kwargs)
                log.append(Entry(lsn, entry_epoch, method, kept_args, kept_kwargs, sizes[0]))
            if entries and stable is not None:  # its log agrees with the primary's up to head
                log.release(min(stable, log.head))
            return log.head

    async def _call(self, lsn: int, method: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        with replaying():
            try:
                result = self.writes[method](*args, **kwargs)
                if inspect.isawaitable(result):
                    await result
            except ShardError as exc:
                self.refused += 1
                logger.error(
                    "replica refused entry %d (%s) that its primary applied: %s %s; its state "
                    "differs from the primary's",
                    lsn,
                    method,
                    exc.code,
                    exc.message[:300],
                )
