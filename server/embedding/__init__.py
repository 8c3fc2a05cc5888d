"""Embedding tables: rows of float32 keyed by any int64 id, spread over the shards by
:func:`client_sdk.placement.row_shard`, each row updated by the table's optimizer with its own
slots and step count. No HTTP in here (the routes are :mod:`server.routes_tables`).

* ``tables``: :class:`EmbeddingTables`, a shard's tables and their verbs (create_table,
  pull_rows, push_rows), beside the store and sharing its name space and dedup table;
* ``operations``: those writes as operations, each checked whole and built before anything
  changes;
* ``table``: one table's rows on one shard: values, per-row slots, step and touch counts, and
  the update of a push's rows;
* ``index``: the id -> row map, an open-addressing hash table probed a batch at a time.

The spec (dim, dtype, initializer, optimizer, seed) and the initializer's rows are
:mod:`client_sdk.embedding`, shared with the SDK.
"""

from __future__ import annotations

from .table import EmbeddingTable
from .tables import DEFAULT_MAX_IDS, DEFAULT_MAX_ROWS, HOTTEST, EmbeddingTables

__all__ = ["DEFAULT_MAX_IDS", "DEFAULT_MAX_ROWS", "HOTTEST", "EmbeddingTable", "EmbeddingTables"]
