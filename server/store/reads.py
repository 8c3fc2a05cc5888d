"""The store's reads: ``pull``, ``wait`` and ``poll`` (docs/PROTOCOL.md §3), and the waits a
route awaits before a read or a write while a big push is applied off the loop (``readable``,
``settled``).

Reads hand out read-only views of the live values, no copy (:meth:`Variable.export
<server.store.variable.Variable.export>`): :meth:`Reads.pull_rows` answers a pull as columns of
a tensor table (:class:`PullRows`; all of a slab's values as one buffer when it can). A poll
waits in :mod:`server.store.waiters`; a wait for names to exist waits here, woken by
:meth:`StoreState._add <server.store.state.StoreState._add>`.

Thread-safety: none; call from one thread (the event loop's).
"""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

import numpy as np

from . import waiters
from .state import StoreState

__all__ = ["MAX_WAIT_SECONDS", "PullRows", "Reads"]

MAX_WAIT_SECONDS = 30.0


class PullRows:
    """A pull as parallel lists, one row per name: the checked ``names``, their current
    ``versions``, and per row the read-only value with its ``dtypes`` type string and
    ``shapes`` list, or ``None`` in all three where the puller holds the current version."""

    __slots__ = ("names", "versions", "values", "dtypes", "shapes", "whole")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        #: When the rows are every member of one slab, in its order, all home and all sent:
        #: their bytes as one buffer, laid out as a packed table's rows (:meth:`Slab.whole
        #: <server.store.slab.Slab.whole>`).
        self.whole: np.ndarray | None = None
        self.versions: list[int] = []
        self.values: list[np.ndarray | None] = []
        self.dtypes: list[str | None] = []
        self.shapes: list[list[int] | None] = []


class Reads(StoreState):
    """The reads of :class:`~server.store.verbs.ParameterStore`."""

    def pull(
        self, names: Iterable[str], versions: Mapping[str, int] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Current versions and (read-only) values; a value equal to ``versions[name]`` is left
        out."""
        names = self.check_names(names)
        held = versions or {}
        out: dict[str, dict[str, Any]] = {}
        for var in self._existing(names):
            entry: dict[str, Any] = {"version": var.version}
            if held.get(var.name) != var.version:
                entry["value"] = var.export()
            out[var.name] = entry
        return out

    def pull_rows(
        self, names: Iterable[str], versions: Mapping[str, int] | list[int | None] | None = None
    ) -> PullRows:
        """:meth:`pull` as the columns of a tensor table (docs/PROTOCOL.md, pull).
        ``versions`` is a map name -> version held, or a list of them parallel to ``names``
        (``None`` where none is held)."""
        names = list(names)
        variables = self._checked(names)
        rows = PullRows(names)
        current = rows.versions = [var.version for var in variables]
        if versions is None:
            held = None
        elif isinstance(versions, list):
            held = versions
        else:
            held = [versions.get(var.name) for var in variables]
        if held is None or True not in map(operator.eq, held, current):
            # Every row gets its value (a first pull, or every one changed since): the same
            # as below, in comprehensions.
            rows.values = [var.export() for var in variables]
            metas = [var._wire or var.wire_meta() for var in variables]
            rows.dtypes = [m[0] for m in metas]
            rows.shapes = [m[1] for m in metas]
            slab = variables[0]._slab if variables else None
            if slab is not None and not slab.away and variables == slab.members:
                rows.whole = slab.whole(tuple(rows.values))
            return rows
        add_value = rows.values.append
        add_dtype, add_shape = rows.dtypes.append, rows.shapes.append
        for var, seen, version in zip(variables, held, current):
            if seen == version:
                add_value(None)
                add_dtype(None)
                add_shape(None)
            else:
                add_value(var.export())
                dtype, shape = var._wire or var.wire_meta()
                add_dtype(dtype)
                add_shape(shape)
        return rows

    def pull_row_now(
        self, name: str, held: int | None
    ) -> tuple[int, np.ndarray | None, tuple[str, list[int]] | None] | None:
        """:meth:`pull_rows` of the one name ``name`` (``held``: the version the puller holds,
        or ``None``) when it is one of ours and :meth:`readable` would return at once for it:
        ``(version, value, (dtype, shape))``, the last two ``None`` where ``held`` is
        current. ``None`` otherwise (an unknown name, or one a push writes in place off the
        loop), for :meth:`pull_rows` to answer or refuse after the wait."""
        var = self._vars.get(name)
        if var is None or (var.in_place and var.writing is not None):
            return None
        version = var.version
        if held == version:
            return version, None, None
        return version, var.export(), var._wire or var.wire_meta()

    def bound(self, name: str) -> float:
        """At least the largest magnitude in ``name``'s current value, as the store keeps it
        for its updates (:attr:`Variable.bound <server.store.variable.Variable.bound>`);
        ``inf`` where it is not known (or there is no such variable)."""
        var = self._vars.get(name)
        return math.inf if var is None else var.bound

    async def wait(self, names: Iterable[str], timeout: float) -> dict[str, Any]:
        """Wait until every name exists or ``timeout`` seconds (at most 30) pass; the reply
        gives the layout of each partitioned one (``partitioned``).

        Coroutine; waiters are woken only by the creation of a name they wait for.
        """
        names = self.check_names(names)
        timeout = min(max(float(timeout), 0.0), MAX_WAIT_SECONDS)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        missing = {n for n in names if n not in self._vars and n not in self.layouts}
        while missing:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            event = asyncio.Event()
            for n in missing:
                self._waiters.setdefault(n, set()).add(event)
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                for n in missing:
                    waiting = self._waiters.get(n)
                    if waiting is not None:
                        waiting.discard(event)
                        if not waiting:
                            del self._waiters[n]
            missing = {n for n in missing if n not in self._vars and n not in self.layouts}
        ordered = list(dict.fromkeys(names))
        out: dict[str, Any] = {
            "ready": [n for n in ordered if n not in missing],
            "missing": [n for n in ordered if n in missing],
        }
        if self.layouts:
            found = {n: self.layouts.get(n) for n in ordered if n in self.layouts}
            if found:
                out["partitioned"] = {n: layout.to_wire() for n, layout in found.items() if layout}
        return out

    async def poll(
        self,
        names: list[str],
        versions: Mapping[str, int] | list[int | None] | None,
        min_version: int | None,
        timeout: float,
        gone: Awaitable[Any] | None = None,
    ) -> bool:
        """Wait until a poll's condition holds (:func:`server.store.waiters.poll`): one of
        ``names``' versions differs from ``versions``, or (with ``min_version``) all reached
        it. Returns whether it did; coroutine."""
        return await waiters.poll(self, names, versions, min_version, timeout, gone)

    # -- waits around a big push applied off the loop ---------------------------------------

    async def settled(self, names: Iterable[str]) -> None:
        """Return once no push computing off the loop writes a variable in ``names`` (unknown
        names are ignored). The loop awaits this before a synchronous :meth:`assign` or
        :meth:`increment`, with no ``await`` in between."""
        known = self._vars
        await self._off_loop.settled([known[n] for n in names if type(n) is str and n in known])

    def settling(self, names: Iterable[str]) -> bool:
        """Whether :meth:`settled` would wait for ``names`` now: a push computing off the loop
        writes one of them."""
        if not self._off_loop.writing:
            return False
        known = self._vars
        return any(
            v.writing is not None
            for n in names
            if type(n) is str and (v := known.get(n)) is not None
        )

    async def readable(self, names: Iterable[str]) -> None:
        """Return once no push is writing the live arrays of a variable in ``names`` in place
        off the loop (unknown names are ignored). The loop awaits this before reading values
        (pull, inspection), with no ``await`` between it and the read; it costs one int check
        while no such write runs (:meth:`OffLoop.readable
        <server.store.apply.OffLoop.readable>`)."""
        if self._off_loop.in_place:
            await self._off_loop.readable(names)

    def settled_now(self, names: Iterable[str]) -> bool:
        """Whether :meth:`readable` would return at once for ``names``: no push is writing one
        of them in place off the loop."""
        return self._off_loop.settled_now(names)
