"""One embedding table's rows on one shard: ids, row values, per-row optimizer slots and step
counts, and the per-row counts inspection and eviction read.

An :class:`EmbeddingTable` keeps every array in row order (row ``i`` is the ``i``-th id added):
``rows`` [capacity, dim] float32, one array per optimizer slot shaped like it, ``steps`` (the
updates each row's optimizer applied: Adam's bias correction and Adagrad's ``lr_decay`` read
it), ``touches`` (pushes that updated the row: the hottest ids) and ``last_update`` (the table
update that last wrote it: what a ttl reads). Only the first ``len(table)`` rows are live; the
arrays grow by doubling (amortized O(1) per new row), up to the table's ``max_rows``.

A row exists once a push touched it. A pull of an id without a row answers the initializer's
row for it (:func:`client_sdk.embedding.initial_rows`, a pure function) and stores nothing, so
a pull never changes the table.

:meth:`EmbeddingTable.update` applies a push's summed gradients (distinct ids) with the
table's optimizer (:func:`server.optim.apply`, the math dense variables use, on the gathered
rows, with an int64 [n, 1] step array for per-row step counts), computing into fresh arrays
and writing them back only once the result is found finite: a refused update changes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from client_sdk.embedding import TableSpec, initial_rows, put_rows

from .. import optim
from ..errors import ShardError
from ..store.checks import all_finite
from . import admission
from .index import IdIndex

__all__ = ["EmbeddingTable"]

_MIN_ROWS = 1024


class EmbeddingTable:
    """The rows of table ``name`` (spec ``spec``) this shard holds; at most ``max_rows``."""

    def __init__(
        self,
        name: str,
        spec: TableSpec,
        max_rows: int,
        max_pending: int = admission.DEFAULT_MAX_PENDING,
    ) -> None:
        self.name = name
        self.spec = spec
        self.max_rows = max_rows
        #: push counts of ids not admitted yet (``spec.admission.min_count`` > 1)
        self.pending = admission.PendingCounts(max_pending)
        #: rows this shard made (admitted ids) and dropped (ttl, max_rows), since creation
        self.admitted = 0
        self.evicted = 0
        self.dim = spec.dim
        self.index = IdIndex()
        self.ids = np.zeros(0, np.int64)
        self.rows = np.zeros((0, spec.dim), np.float32)
        self.slots: dict[str, np.ndarray] = {}
        #: Each slot's first value in a new row (e.g. FTRL's accumulator starts at its
        #: initial_accumulator_value, its linear term at 0).
        first = optim.init_state(spec.optimizer, np.zeros((1, 1), np.float32))
        self._slot_start = {key: float(slot[0, 0]) for key, slot in first.items()}
        self._slot_names = tuple(first)
        for key in self._slot_names:
            self.slots[key] = np.zeros((0, spec.dim), np.float32)
        self.steps = np.zeros(0, np.int64)
        self.touches = np.zeros(0, np.int64)
        self.last_update = np.zeros(0, np.int64)
        #: Pushes applied (+1 each): the table's version on this shard.
        self.version = 0
        self.created_at = 0.0
        self.last_writer: str | None = None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        """Bytes held for the live rows: values, slots and the per-row counts."""
        n = len(self.index)
        per_row = 4 * self.dim * (1 + len(self.slots)) + 8 * 4
        return n * per_row + self.index.nbytes

    # -- reads ------------------------------------------------------------------------------

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (int64 [n], repeats allowed) as a new float32 [n, dim] array:
        stored rows as they are, the others as the initializer makes them."""
        where = self.index.lookup(ids)
        out = np.empty((len(ids), self.dim), np.float32)
        have = where >= 0
        if have.all():
            self.rows.take(where, axis=0, out=out, mode="clip")  # clip: no copy of out
            return out
        out[have] = self.rows[where[have]]
        missing = ~have
        out[missing] = initial_rows(self.spec, self.name, ids[missing])
        return out

    # -- the update -------------------------------------------------------------------------

    def update(self, ids: np.ndarray, grads: np.ndarray) -> tuple[int, int]:
        """Apply ``grads[i]`` to row ``ids[i]`` (ids distinct) with the table's optimizer, once
        each; rows not stored yet start from the initializer, if admitted
        (:mod:`server.embedding.admission`: the others are counted and their gradients
        dropped), and rows are evicted as the table's admission says. Returns how many rows it
        created and how many ids it only counted. 413 if the new rows would pass
        ``max_rows``, 422 if a result is not finite; either way nothing changes."""
        rules = self.spec.admission
        where = self.index.lookup(ids)
        new = where < 0
        fresh = int(np.count_nonzero(new))
        counting = None
        if fresh and rules.min_count > 1:
            unseen = ids[new]
            p_where, p_after = self.pending.counted(unseen)
            admit = p_after >= rules.min_count
            counting = (unseen, p_where, p_after, admit)
            if not admit.all():
                keep = ~new
                keep[np.flatnonzero(new)[admit]] = True
                ids, grads, where = ids[keep], grads[keep], where[keep]
                new = where < 0
                fresh = int(np.count_nonzero(new))
        counted = 0 if counting is None else int(np.count_nonzero(~counting[3]))
        room = self.max_rows if rules.max_rows is None else min(rules.max_rows, self.max_rows)
        victims = None
        if fresh and rules.max_rows is not None and len(self.index) + fresh > room:
            need = len(self.index) + fresh - room
            victims = admission.lru_victims(
                self.last_update[: len(self.index)], where[~new], need + room // 16
            )
            if len(victims) < need:
                victims = None  # not enough rows outside this push: refused below
        if fresh and victims is None and len(self.index) + fresh > room:
            raise ShardError(
                "too_large",
                f"table {self.name!r}: {fresh} new row(s) would take this shard past its "
                + (
                    f"{self.max_rows} rows per table (--max-table-rows)"
                    if room == self.max_rows
                    else f"{room} rows (the table's admission.max_rows), and only rows this "
                    "push does not update can be evicted"
                )
                + "; nothing was applied: raise the limit, add shards, or use fewer distinct "
                "ids per push",
                {"table": self.name, "limit": room, "rows": len(self.index)},
            )
        if fresh:
            old = ~new
            have = where[old]
        else:
            have = where
        value = np.empty((len(ids), self.dim), np.float32)
        state = {key: np.empty_like(value) for key in self._slot_names}
        step = np.empty((len(ids), 1), np.int64)
        if fresh:
            value[old] = self.rows[have]
            value[new] = initial_rows(self.spec, self.name, ids[new])
            for key, slot in state.items():
                slot[old] = self.slots[key][have]
                slot[new] = self._slot_start[key]
            step[old, 0] = self.steps[have]
            step[new, 0] = 0
        else:  # mode="clip": numpy takes into ``out`` itself (with "raise", into a copy)
            self.rows.take(have, axis=0, out=value, mode="clip")
            for key, slot in state.items():
                self.slots[key].take(have, axis=0, out=slot, mode="clip")
            self.steps.take(have, out=step[:, 0], mode="clip")
        step += 1
        # Only read (scratch=False): the operation's gradients stay as they came, and the
        # rule's temporaries cost what a copy of them to write into would.
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        with np.errstate(all="ignore"):
            optim.apply(self.spec.optimizer, value, grads, state, step=step, scratch=False)
            finite = all_finite(value) and all(all_finite(s) for s in state.values())
        if not finite:
            raise ShardError(
                "bad_tensor",
                f"table {self.name!r}: the update would make rows NaN or infinite (gradients "
                "too large for the optimizer's settings); nothing was applied",
                {"table": self.name},
            )
        # Checked: write it back.
        self.version += 1
        if counting is not None:
            self.pending.commit(*counting, tick=self.version)
        if victims is not None:
            remap = self._evict(victims)
            where = np.where(where >= 0, remap[np.maximum(where, 0)], -1)
            have = where[~new]
        if fresh:
            numbers = np.empty(len(ids), np.int64)
            numbers[old] = have
            numbers[new] = self._append(ids[new])
        else:
            numbers = have
        put_rows(self.rows, numbers, value)
        for key, slot in state.items():
            put_rows(self.slots[key], numbers, slot)
        self.steps[numbers] = step[:, 0]
        self.touches[numbers] += 1
        self.last_update[numbers] = self.version
        self.admitted += fresh
        if rules.ttl is not None and admission.sweeps_at(self.version, rules.ttl):
            n = len(self.index)
            stale = admission.stale_rows(self.last_update[:n], self.version, rules.ttl)
            if len(stale):
                self._evict(stale)
        return fresh, counted

    def _evict(self, victims: np.ndarray) -> np.ndarray:
        """Drop rows ``victims`` (row numbers); the others keep their order and get new
        numbers: returns old -> new (-1 for a dropped row)."""
        n = len(self.index)
        arrays = [self.ids, self.rows, *self.slots.values(), self.steps, self.touches]
        remap = admission.compact([*arrays, self.last_update], n, victims)
        self.index.rebuild(self.ids[: n - len(victims)])
        self.evicted += len(victims)
        return remap

    def _append(self, ids: np.ndarray) -> np.ndarray:
        """Add rows for ``ids`` (distinct, new); their values are written by the caller."""
        numbers = self.index.add(ids)
        end = len(self.index)
        if end > len(self.ids):
            self._reserve(end)
        self.ids[numbers] = ids
        self.touches[numbers] = 0
        return numbers

    def _reserve(self, needed: int) -> None:
        capacity = max(_MIN_ROWS, len(self.ids))
        while capacity < needed:
            capacity *= 2
        capacity = max(needed, min(capacity, self.max_rows))
        live = len(self.ids)

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty((capacity, *a.shape[1:]), a.dtype)
            out[:live] = a
            return out

        self.ids = grown(self.ids)
        self.rows = grown(self.rows)
        self.slots = {key: grown(slot) for key, slot in self.slots.items()}
        self.steps = grown(self.steps)
        self.touches = grown(self.touches)
        self.last_update = grown(self.last_update)

    # -- snapshots --------------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The live part of every array, as copies (a snapshot writer reads them while the
        table goes on): ``ids``, ``rows``, ``slot.<name>``, ``steps``, ``touches``,
        ``last_update``."""
        n = len(self.index)
        out = {"ids": self.ids[:n].copy(), "rows": self.rows[:n].copy()}
        for key, slot in self.slots.items():
            out[f"slot.{key}"] = slot[:n].copy()
        out["steps"] = self.steps[:n].copy()
        out["touches"] = self.touches[:n].copy()
        out["last_update"] = self.last_update[:n].copy()
        out.update(self.pending.arrays())
        return out

    def meta(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_wire(),
            "version": self.version,
            "rows": len(self.index),
            "created_at": self.created_at,
            "last_writer": self.last_writer,
            "admitted": self.admitted,
            "evicted": self.evicted,
            "forgotten": self.pending.forgotten,
        }

    @classmethod
    def restored(
        cls,
        name: str,
        spec: TableSpec,
        max_rows: int,
        meta: dict[str, Any],
        arrays: dict[str, np.ndarray],
        max_pending: int = admission.DEFAULT_MAX_PENDING,
    ) -> EmbeddingTable:
        """A table holding the rows of a snapshot (:meth:`arrays`, :meth:`meta`); ValueError
        for arrays that do not fit together or the spec."""
        table = cls(name, spec, max_rows, max_pending)
        ids = np.ascontiguousarray(arrays["ids"], dtype=np.int64)
        n = len(ids)
        expect = {"rows": (n, spec.dim), "steps": (n,), "touches": (n,), "last_update": (n,)}
        for key in table._slot_names:
            expect[f"slot.{key}"] = (n, spec.dim)
        for key, shape in expect.items():
            if key not in arrays or tuple(arrays[key].shape) != shape:
                raise ValueError(f"table {name!r}: snapshot array {key!r} missing or not {shape}")
        if len(np.unique(ids)) != n:
            raise ValueError(f"table {name!r}: snapshot holds an id twice")
        table._reserve(n) if n else None
        table.index.rebuild(ids)
        table.ids[:n] = ids
        table.rows[:n] = arrays["rows"]
        for key in table._slot_names:
            table.slots[key][:n] = arrays[f"slot.{key}"]
        table.steps[:n] = arrays["steps"]
        table.touches[:n] = arrays["touches"]
        table.last_update[:n] = arrays["last_update"]
        table.version = int(meta.get("version", 0))
        table.created_at = float(meta.get("created_at", 0.0))
        writer = meta.get("last_writer")
        table.last_writer = writer if isinstance(writer, str) else None
        table.pending.restore(arrays)
        table.admitted = int(meta.get("admitted", n))
        table.evicted = int(meta.get("evicted", 0))
        table.pending.forgotten = int(meta.get("forgotten", 0))
        return table
