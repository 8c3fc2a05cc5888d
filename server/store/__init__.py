"""The store: the variables one shard owns, and the verbs that read and change them.

The routes hold one :class:`ParameterStore` and call its verbs on decoded arguments; refusals are
:class:`~server.errors.ShardError` with the protocol's codes. Nothing in this package imports
the web stack (tests/test_import_contracts.py): it is the shard's state, usable without HTTP.

Where each concept lives:

* ``verbs``: :class:`ParameterStore`, the API the routes call: the union of the verb groups
  below, and snapshots' capture and restore.
* ``state``: what the verbs share: the variables and their counts, names and ownership, the
  dedup check, the bookkeeping of a variable made or changed.
* ``reads``: pull, wait, poll, and the waits a route awaits while a big push is applied.
* ``writes``: init, push, assign, increment, each run through its steps (check, dedup, build,
  apply, count); the close of timed-out sync rounds.
* ``journal``: the one point every write passes (``@journaled``): a shard that replicates is
  told of each write there, in the order the writes take effect.
* ``control``: set_optimizer and delete, by names or prefix, around their operations.
* ``operations``: the writes as operations (init, push, assign, increment), each checked whole
  and built before anything changes; why the steps run in their order.
* ``optimizer_change``: set_optimizer, a variable's optimizer changed or the variable frozen,
  as one operation: what becomes of its slots.
* ``deletion``: delete, variables removed as one operation; what a deleted one lets go of.
* ``apply``: how an operation is written into the live arrays: in place or into fresh memory,
  a whole slab at once, on the event loop or off it for a big push, with readers and other
  writers kept away meanwhile.
* ``checks``: what a gradient or value must be to be applied (dtype, shape, finite), checked
  by the store, over a table's block at once, or while a push's body arrives.
* ``bounds``: what an update provably keeps finite, per optimizer.
* ``variable``: one variable's value and bookkeeping, and whether a reader still holds it.
* ``slab``: one block of memory for the same-shaped variables of one init.
* ``heap``: the process's big buffers, reused from the heap.
* ``dedup``: which writes of each worker were applied, so a retry is applied once.
* ``waiters``: the polls waiting for variables' versions (``POST /v1/poll``), woken by the
  writes that change them.
* ``modes``: what a push's gradients become by their variable's training mode (applied,
  scaled, joined to a sync round, dropped), and the close of a round that timed out.
* ``rounds``: sync rounds: a variable's open round (its sum, contributors, timeout), its
  closed rounds, and the task that closes the rounds due.
* ``staleness``: the latest stalenesses per variable and per worker, for their percentiles.

The optimizers' math is :mod:`server.optim`; snapshot files are :mod:`server.persistence`.
"""

from __future__ import annotations

from .checks import SCAN_FROM, FiniteScan, finite_rows
from .dedup import MAX_SEQ, DedupTable
from .operations import COUNTER_KINDS, DEFAULT_OPTIMIZER
from .reads import MAX_WAIT_SECONDS, PullRows
from .variable import Variable
from .verbs import Capture, ParameterStore
from .waiters import MAX_POLL_SECONDS

__all__ = [
    "COUNTER_KINDS",
    "DEFAULT_OPTIMIZER",
    "MAX_POLL_SECONDS",
    "MAX_SEQ",
    "MAX_WAIT_SECONDS",
    "SCAN_FROM",
    "Capture",
    "DedupTable",
    "FiniteScan",
    "ParameterStore",
    "PullRows",
    "Variable",
    "finite_rows",
]
