"""The embedding tables of one shard and their verbs: ``create_table``, ``pull_rows``,
``push_rows`` (docs/PROTOCOL.md §3), as plain methods on decoded arguments, plus what
inspection and snapshots read. No HTTP in here.

:class:`EmbeddingTables` sits beside the shard's :class:`~server.store.ParameterStore` and
shares its name space and its dedup table: a name is a dense variable or an embedding table,
never both (a table verb on a variable's name, and a variable verb on a table's, is 409 naming
what the name is), and a worker's ``seq`` numbers its writes of either kind. Every write runs
the store's steps: check the request whole (:mod:`server.embedding.operations`), ask the dedup
table whether its ``(worker_id, seq)`` was applied (a retry is answered ``"duplicate"``),
apply the operation (:meth:`EmbeddingTable.update
<server.embedding.table.EmbeddingTable.update>`, which writes nothing until it has checked its
result), then count it: the table's version, the store's state version and mutations, the seq.

Thread-safety: none; call from the event-loop thread, like the store. The work of each verb is
proportional to its ids, never to the rows a table holds.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from client_sdk.placement import validate_name

from ..errors import ShardError
from ..store import ParameterStore
from ..store.journal import Journal, journaled
from . import admission, operations
from .table import EmbeddingTable

__all__ = ["DEFAULT_MAX_IDS", "DEFAULT_MAX_ROWS", "HOTTEST", "EmbeddingTables"]

#: Ids one pull_rows or push_rows may carry (``--max-table-ids``).
DEFAULT_MAX_IDS = 1 << 18
#: Rows one table may hold on one shard (``--max-table-rows``).
DEFAULT_MAX_ROWS = 1 << 27
#: The hottest ids inspection lists per table.
HOTTEST = 10


class EmbeddingTables:
    """The embedding tables of the shard whose variables ``store`` holds."""

    def __init__(
        self,
        store: ParameterStore,
        max_ids: int = DEFAULT_MAX_IDS,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_pending: int = admission.DEFAULT_MAX_PENDING,
    ) -> None:
        self.store = store
        self.max_ids = max_ids
        self.max_rows = max_rows
        self.max_pending = max_pending
        self.tables: dict[str, EmbeddingTable] = {}
        store.embedding_tables = self.tables  # the store refuses these names as variables

    def __len__(self) -> int:
        return len(self.tables)

    def __contains__(self, name: object) -> bool:
        return name in self.tables

    # -- names ------------------------------------------------------------------------------

    def _valid(self, name: Any) -> str:
        if type(name) is str and name in self.tables:
            return name
        try:
            return validate_name(name)
        except ValueError as exc:
            raise ShardError(
                "bad_request",
                f"{exc} (an embedding table's name follows the rules of variable names)",
                {"field": "name"},
            ) from None

    def _not_a_variable(self, name: str, verb: str) -> None:
        if name in self.store:
            raise ShardError(
                "conflict",
                f"{name!r} is a dense variable, not an embedding table: {verb} works on "
                "tables; use pull/push for a variable (or another name for the table)",
                {"name": name, "kind": "variable"},
            )

    def get(self, name: Any, verb: str = "pull_rows") -> EmbeddingTable:
        """Table ``name``: 400 for a bad name, 409 for a dense variable's, 404 for none."""
        table = self.tables.get(name) if type(name) is str else None
        if table is not None:
            return table
        name = self._valid(name)
        self._not_a_variable(name, verb)
        raise ShardError(
            "not_found",
            f"unknown embedding table {name!r} on shard {self.store.shard_index}: create it "
            "first (ps.create_table)",
            {"table": name},
        )

    # -- verbs ------------------------------------------------------------------------------

    @property
    def journal(self) -> Journal | None:
        """The store's journal: a table's writes are the shard's (:mod:`server.store.journal`)."""
        return self.store.journal

    @journaled
    def create(self, name: Any, spec: Any) -> dict[str, Any]:
        """Create table ``name`` unless it exists (create-if-absent): ``{"created",
        "version"}``. 400 for a bad name or spec, 409 for a variable of that name or a table
        with another spec (naming the first field that differs)."""
        name = self._valid(name)
        self._not_a_variable(name, "create_table")
        op = operations.create_table(name, spec, self.tables.get(name))
        if op is None:
            return {"created": False, "version": self.tables[name].version}
        table = EmbeddingTable(op.name, op.spec, self.max_rows, self.max_pending)
        table.created_at = time.time()
        self.tables[op.name] = table
        self.store.mutations += 1
        return {"created": True, "version": 0}

    def pull(self, name: Any, ids: Any) -> tuple[EmbeddingTable, np.ndarray]:
        """The table and the rows of ``ids`` (float32 [len(ids), dim], repeats allowed; an id
        without a row gets the initializer's). Changes nothing."""
        table = self.get(name, "pull_rows")
        checked = operations.check_ids(
            table.name, ids, self.max_ids, self.store.shard_index, self.store.num_shards
        )
        return table, table.gather(checked)

    @journaled
    def push(self, name: Any, worker_id: str, seq: int, ids: Any, grads: Any) -> dict[str, Any]:
        """Apply ``grads`` to rows ``ids`` once per ``(worker_id, seq)``: ``{"status",
        "version", "rows", "created"}`` (``rows``: distinct ids updated; ``created``: rows
        made by it). 400/404/409 for the name, 413 past a limit, 421 for a row of another
        shard, 422 for bad ids or gradients or an update that would not be finite: nothing
        applied."""
        table = self.get(name, "push_rows")
        checked = operations.check_ids(
            table.name, ids, self.max_ids, self.store.shard_index, self.store.num_shards
        )
        op = operations.push_rows(table, worker_id, seq, checked, grads)
        if self.store.seen("push_rows", worker_id, seq):
            return {
                "status": "duplicate",
                "version": table.version,
                "rows": 0,
                "created": 0,
                "counted": 0,
            }
        created, counted = self.apply(op)
        return {
            "status": "applied",
            "version": table.version,
            "rows": len(op.ids) - counted,
            "created": created,
            "counted": counted,
        }

    def apply(self, op: operations.PushRows) -> tuple[int, int]:
        """Apply a push built already (checked, not a duplicate) and count it; how many rows
        it created and how many ids it only counted (not admitted yet)."""
        table = self.tables[op.table]
        created, counted = table.update(op.ids, op.grads)
        table.last_writer = op.worker_id
        self.store.counted(1, op.worker_id, op.seq)
        return created, counted

    # -- snapshots --------------------------------------------------------------------------

    def restore(self, tables: list[EmbeddingTable]) -> None:
        """Replace every table with restored ``tables`` (at start, right after the store's
        restore, before any request): their versions count in the store's state version."""
        self.tables.clear()
        for table in tables:
            table.pending.capacity = self.max_pending  # this start's --max-pending-ids
            self.tables[table.name] = table
        self.store.counted(sum(t.version for t in tables), None, None)

    # -- inspection -------------------------------------------------------------------------

    def describe(self, table: EmbeddingTable) -> dict[str, Any]:
        """What ``GET /v1/tables/{name}`` shows of a table: its spec, rows, bytes, version,
        and the ids updated most (bounded work: one argpartition over the touch counts)."""
        n = len(table)
        hottest: list[dict[str, int]] = []
        if n:
            touches = table.touches[:n]
            k = min(HOTTEST, n)
            top = np.argpartition(touches, n - k)[n - k :]
            top = top[np.lexsort((table.ids[top], -touches[top]))]  # most first, then by id
            hottest = [{"id": int(table.ids[i]), "updates": int(touches[i])} for i in top]
        spec = table.spec
        return {
            "name": table.name,
            "dim": spec.dim,
            "dtype": spec.dtype,
            "rows": n,
            "bytes": table.nbytes,
            "version": table.version,
            "initializer": spec.initializer.to_wire(),
            "optimizer": spec.optimizer.to_wire(),
            "seed": spec.seed,
            "max_rows": table.max_rows,
            "admission": {
                **spec.admission.to_wire(),
                "admitted": table.admitted,
                "evicted": table.evicted,
                "pending": len(table.pending),
                "forgotten": table.pending.forgotten,
                "max_pending": table.pending.capacity,
            },
            "created_at": table.created_at,
            "last_writer": table.last_writer,
            "hottest": hottest,
        }
