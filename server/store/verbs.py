"""The shard's API to its routes: :class:`ParameterStore`, the variables one shard owns and the
verbs that read and change them. No HTTP in here.

:class:`ParameterStore` implements ``init``, ``pull``, ``push``, ``assign``, ``increment``,
``wait``, ``poll``, ``set_optimizer`` and ``delete`` (docs/PROTOCOL.md §3) as plain methods on
decoded arguments, plus what the shard around it needs: ``capture`` and ``restore``
(snapshots), ``readable`` and ``settled`` (the waits a route awaits before a read or a write
while a big push is applied off the loop). Refusals are :class:`~server.errors.ShardError` with
the protocol's codes.

The verbs live by group, each group a class over the shared state
(:class:`~server.store.state.StoreState`: the variables, their counts, name checks, dedup), and
:class:`ParameterStore` is their union, so a route's call is one method call, with no layer in
between:

* :mod:`server.store.reads`: ``pull``, ``wait``, ``poll``, and the waits around a big push;
* :mod:`server.store.writes`: ``init``, ``push``, ``assign``, ``increment``, and the close of
  timed-out sync rounds;
* :mod:`server.store.control`: ``set_optimizer`` and ``delete``;
* here: ``capture`` and ``restore``, the whole state at once.

A new group of verbs is a module of its own with a class over
:class:`~server.store.state.StoreState`, added to :class:`ParameterStore`'s bases.

The work of every verb is proportional to the request, never to the number of variables the
shard holds (``bytes`` and counts are kept up to date, not recomputed). Thread-safety: none;
call from one thread (the event loop's).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .control import Control
from .dedup import DedupTable
from .layouts import Layout
from .reads import MAX_WAIT_SECONDS, PullRows, Reads
from .slab import into_slabs
from .variable import Variable
from .writes import Writes

__all__ = ["MAX_WAIT_SECONDS", "Capture", "ParameterStore", "PullRows"]


@dataclass
class Capture:
    """A shard's whole state at one instant (:meth:`ParameterStore.capture`).

    ``variables`` maps name -> (bookkeeping, arrays); the arrays are read-only and no later
    update changes them, so a writer thread may read them while the shard goes on.
    """

    shard_index: int
    num_shards: int
    state_version: int
    mutations: int
    variables: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]]
    dedup: dict[str, Any]
    taken_at: float = field(default_factory=time.time)
    #: Embedding tables: name -> (bookkeeping, arrays: copies no later update touches).
    tables: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]] = field(default_factory=dict)
    #: The partitioned variables' layouts (name -> wire form), :mod:`server.store.layouts`.
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: On a replica of a group: where the capture is in its replication log (``{"lsn",
    #: "epoch"}``, :mod:`server.replication`), so a restart resumes the log from there.
    replication: dict[str, int] | None = None

    @property
    def nbytes(self) -> int:
        held = (*self.variables.values(), *self.tables.values())
        return sum(a.nbytes for _, arrays in held for a in arrays.values())


class ParameterStore(Reads, Writes, Control):
    """The variables of shard ``shard_index`` of a fleet of ``num_shards``, and every verb.

    All methods but the coroutines (:meth:`push_async`, :meth:`set_optimizer`, :meth:`delete`,
    :meth:`wait`, :meth:`poll`, :meth:`readable`, :meth:`settled`) are synchronous and must be
    called from the event-loop thread; the coroutines run on that same loop. None of them
    blocks on I/O.
    """

    def capture(self) -> Capture:
        """The whole state at this instant: read-only arrays no later update touches, and
        copies of the bookkeeping and the dedup table. Synchronous and cheap for variables (no
        array is copied); embedding tables' live rows are copied (their updates write in
        place). Call it on the event-loop thread while no update is being applied."""
        return Capture(
            shard_index=self.shard_index,
            num_shards=self.num_shards,
            state_version=self._state_version,
            mutations=self.mutations,
            variables={
                name: (var.meta(), var.snapshot_views()) for name, var in self._vars.items()
            },
            dedup=self.dedup.export(),
            tables={name: (t.meta(), t.arrays()) for name, t in self.embedding_tables.items()},
            layouts=self.layouts.export(),
        )

    def restore(
        self,
        variables: Iterable[Variable],
        dedup: DedupTable,
        partitioned: Iterable[Layout] = (),
    ) -> None:
        """Replace the whole state with restored ``variables`` and ``dedup`` table (at start,
        before any request is served), laid out in slabs as their init made them
        (:func:`~server.store.slab.into_slabs`). The state version becomes the sum of their
        versions; the table keeps this store's bounds (:meth:`DedupTable.bound`)."""
        self._vars.clear()
        self.restores += 1
        self.groups.clear()
        self.collector.released()
        self.layouts.replace(partitioned)
        self._nbytes = 0
        self._frozen = 0
        variables = list(variables)
        into_slabs(variables)
        self._moded = 0
        self.deadlines.clear()
        started = time.monotonic()
        for var in variables:
            self._add(var)
            if var.round is not None:  # its timeout starts again now
                var.round.opened = started
                self.deadlines.add(var.name, var.version, var.round.deadline)
        dedup.bound(self.dedup.max_workers, self.dedup.idle_seconds)
        self.dedup = dedup
        self._state_version = sum(v.version for v in self._vars.values())
        self.waiters.wake_all()
