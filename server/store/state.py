"""What every verb of the store shares: the variables one shard owns, the counts kept of them,
and the checks and bookkeeping every verb runs.

:class:`StoreState` holds the name -> :class:`~server.store.variable.Variable` table, the
counts that stay current as variables come and go (bytes, state version, mutations, how many
are moded or frozen), the dedup table, and the waiters. It checks a request's names (400),
ownership (421) and existence (404), records a variable made (:meth:`StoreState._add`) or
changed (:meth:`StoreState._touch`), and asks the dedup table whether a write's
``(worker_id, seq)`` was applied already (:meth:`StoreState._seen`). It also knows the names of
the shard's embedding tables (:mod:`server.embedding`, which holds them and counts its writes
here through :meth:`StoreState.seen` and :meth:`StoreState.counted`). The verbs are built on it
by group, one module each: :mod:`server.store.reads`, :mod:`server.store.writes`,
:mod:`server.store.control`; :class:`~server.store.verbs.ParameterStore` joins them.

Thread-safety: none; call from one thread (the event loop's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from client_sdk.modes import ASYNC
from client_sdk.placement import shard_for, validate_name

from ..errors import ShardError
from . import apply, layouts
from .collector import Freezer
from .dedup import DedupTable
from .groups import Groups
from .journal import Journal
from .rounds import Deadlines
from .variable import Variable
from .waiters import VersionWaiters

__all__ = ["StoreState", "seq_expired"]


class StoreState:
    """The variables of shard ``shard_index`` of a fleet of ``num_shards``, their counts, and
    the checks and bookkeeping the verbs share (:class:`~server.store.verbs.ParameterStore`
    has the verbs)."""

    def __init__(self, shard_index: int, num_shards: int, dedup: DedupTable | None = None) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in 0..{num_shards - 1}, got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        #: Name -> variable; this one dict for good (:class:`~server.store.apply.OffLoop`
        #: reads it too).
        self._vars: dict[str, Variable] = {}
        #: The layouts of the partitioned variables whose names this shard owns.
        self.layouts = layouts.Layouts()
        self._nbytes = 0
        self._waiters: dict[str, set[asyncio.Event]] = {}
        #: Polls waiting for versions (POST /v1/poll): woken by every change of a version.
        self.waiters = VersionWaiters()
        self.dedup = DedupTable() if dedup is None else dedup
        self._state_version = 0
        self._off_loop = apply.OffLoop(self._vars)
        #: Changes of any kind (init included); a snapshot is due when it moved.
        self.mutations = 0
        #: How many variables are sync or bounded (a push to none of them costs one int
        #: check here), and when each open sync round times out (:meth:`close_due_rounds`).
        self._moded = 0
        self.deadlines = Deadlines()
        #: How many variables are frozen: while none is, a push looks at no variable's flag.
        self._frozen = 0
        #: Deletes that removed something so far: a push that waited for another to finish
        #: looks its names up again when this moved meanwhile, and a reply says it (a client
        #: keys the values it caches by it: :attr:`deletions`).
        self._deletions = 0
        #: The shard's embedding tables by name (:mod:`server.embedding` fills it): a name is
        #: a variable or a table, never both (init and the variable verbs refuse a table's).
        self.embedding_tables: Mapping[str, Any] = MappingProxyType({})
        #: Keeps the cycle collector's full collections off the variables held
        #: (:mod:`server.store.collector`): told of every variable made and let go.
        self.collector = Freezer()
        #: The names of the variables and partitioned variables, sorted, and what they were
        #: sorted at (:meth:`sorted_names`).
        self._sorted: tuple[tuple[int, int, int], list[str]] | None = None
        #: Told of every write (:mod:`server.store.journal`): a shard that replicates has one.
        self.journal: Journal | None = None
        #: Times the whole state was replaced (:meth:`ParameterStore.restore`): with
        #: :attr:`deletions`, what tells a step group to check its variables again.
        self.restores = 0
        #: The step groups registered here (:mod:`server.store.groups`).
        self.groups = Groups()

    # -- names ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._vars)

    def __contains__(self, name: object) -> bool:
        return name in self._vars or name in self.layouts  # a partitioned one too

    def __iter__(self) -> Iterator[Variable]:
        return iter(list(self._vars.values()))

    @property
    def nbytes(self) -> int:
        """Bytes held in values and optimizer slots, kept current (O(1))."""
        return self._nbytes

    @property
    def state_version(self) -> int:
        """The sum of every variable's version: +1 per applied change anywhere on the shard.
        It survives restarts (a restored shard comes back at its snapshot's state version)."""
        return self._state_version

    def owner(self, name: str) -> int:
        return shard_for(name, self.num_shards)

    def check_names(self, names: Iterable[Any]) -> list[str]:
        """Validate names (400) and ownership (421 with ``details.owners``) of a whole request."""
        names = list(names)
        known = self._vars
        for name in names:
            if type(name) is str and name in known:
                continue  # valid and ours: it was checked when it was created
            try:
                validate_name(name)
            except ValueError as exc:
                raise ShardError(
                    "bad_request", str(exc), {"name": name if isinstance(name, str) else repr(name)}
                ) from None
        owners = {}
        for name in names:
            if name in known:
                continue
            owner = self.owner(name)
            if owner != self.shard_index:
                owners[name] = owner
        if owners:
            first = next(iter(owners))
            raise ShardError(
                "not_owner",
                f"this is shard {self.shard_index} of {self.num_shards}; variable {first!r} "
                f"belongs to shard {owners[first]}"
                + (f" (and {len(owners) - 1} more are not ours)" if len(owners) > 1 else "")
                + ": send each variable to its owner, and check that your shard list is in "
                "fleet order",
                {"owners": owners, "shard_index": self.shard_index, "num_shards": self.num_shards},
            )
        return names

    def _checked(self, names: Iterable[Any]) -> list[Variable]:
        """The variables of ``names``, each checked as :meth:`check_names` and
        :meth:`_existing` check it (400, 421, 404), in one pass when every name is one of
        ours (the common case: a name that exists was checked when it was created)."""
        known = self._vars
        try:
            return [known[name] for name in names]
        except (KeyError, TypeError):
            return self._existing(self.check_names(names))

    def _existing(self, names: Iterable[str]) -> list[Variable]:
        found, missing = [], []
        for name in names:
            var = self._vars.get(name)
            if var is None:
                missing.append(name)
            else:
                found.append(var)
        if missing:
            tables = [n for n in missing if n in self.embedding_tables]
            if tables:
                raise ShardError(
                    "conflict",
                    f"{tables[0]!r} is an embedding table, not a dense variable: use "
                    "pull_rows/push_rows for its rows (ps.pull_rows, ps.push_rows)",
                    {"name": tables[0], "kind": "embedding_table"},
                )
            self.layouts.refuse(missing)
            raise ShardError(
                "not_found",
                f"unknown variable(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} on shard "
                f"{self.shard_index}: init them first, or wait for them (/v1/wait)",
                {"missing": missing},
            )
        return found

    def sorted_names(self) -> list[str]:
        """Every variable's and partitioned variable's name, sorted; sorted again only after
        names came or went (do not modify the list)."""
        key = (len(self._vars), len(self.layouts), self._deletions)
        if self._sorted is None or self._sorted[0] != key:
            self._sorted = key, sorted([*self._vars, *(layout.name for layout in self.layouts)])
        return self._sorted[1]

    @property
    def deletions(self) -> int:
        """How many deletes removed a variable or a partitioned variable since the shard
        started. A name deleted and made again may reach the version a client cached of the old
        variable; a value pulled while this count was ``d`` is of the variable that holds the
        name now only if the count is still ``d``, so clients key cached values by it
        (``x-paramshard-deletions``, docs/PROTOCOL.md §2)."""
        return self._deletions

    def lookup(self, name: str) -> Variable | None:
        """The variable ``name``, or ``None`` (no checks: for inspection)."""
        return self._vars.get(name)

    def get(self, name: str) -> Variable:
        """The variable ``name``; 400/421/404 as for any verb."""
        self.check_names([name])
        return self._existing([name])[0]

    # -- bookkeeping ------------------------------------------------------------------------

    def _add(self, var: Variable) -> None:
        self._vars[var.name] = var
        self._nbytes += var.nbytes
        self._frozen += var.frozen
        self.mutations += 1
        if var.mode is not ASYNC:
            self._moded += 1
        for event in self._waiters.pop(var.name, ()):
            event.set()
        self.collector.made()

    def _touch(self, var: Variable, writer: str | None) -> None:
        var.touch(writer)
        self._state_version += 1
        self.mutations += 1
        if self.waiters.waiting:
            self.waiters.wake([var.name])

    def seen(self, verb: str, worker_id: str, seq: int) -> bool:
        """Whether ``(worker_id, seq)`` of a write was applied already (counted as a
        duplicate); 409 ``seq_expired`` when it is too old to tell. For the writes of
        embedding tables (:mod:`server.embedding`), which share this dedup table."""
        return self._seen(verb, worker_id, seq)

    def counted(self, changes: int, worker_id: str | None, seq: int | None) -> None:
        """Count ``changes`` applied outside the variables (an embedding table's write) in
        the state version and mutations, and record its ``seq``."""
        self._state_version += changes
        self.mutations += changes
        if worker_id is not None and seq is not None:
            self.dedup.record(worker_id, seq)

    def _seen(self, verb: str, worker_id: str, seq: int) -> bool:
        """True if ``seq`` was applied already (counted as a duplicate); raises
        ``seq_expired`` when it is too old to tell."""
        outcome = self.dedup.check(worker_id, seq)
        if outcome == "new":
            return False
        self.dedup.count(worker_id, outcome)
        if outcome == "duplicate":
            return True
        record = self.dedup.get(worker_id)
        raise seq_expired(verb, worker_id, seq, record.high if record else -1)


def seq_expired(verb: str, worker_id: str, seq: int, high: int) -> ShardError:
    """409 ``seq_expired``: ``seq`` is too far below ``high`` to tell whether it was applied."""
    return ShardError(
        "seq_expired",
        f"{verb} seq {seq} of worker {worker_id!r} is too far below the highest seq this shard "
        f"applied for it ({high}) to tell whether it was applied already, so it was not applied. "
        "Two processes sharing one worker_id, or a worker restarted with its clock set back, "
        "cause this: give every worker process its own worker_id",
        {"worker_id": worker_id, "seq": seq, "high_seq": high},
    )
