"""Keeping Python's cycle collector off the variables a shard holds.

CPython's collector finds reference cycles by walking every container object it tracks; its
oldest generation holds everything long-lived, and a full collection walks all of it. A
variable is a few such objects (the :class:`~server.store.variable.Variable`, its instance
dict, its :class:`~server.store.variable.Training`, its slots' dict), so a shard that holds
10^6 variables makes every full collection walk millions of objects: seconds during which
the event loop answers nothing. Full collections come whenever the long-lived objects have
grown by a quarter since the last one: over and over while an init fills the table (about
half of a large fill's time), and after anything that builds many objects at once (a
``GET /v1/variables`` of every variable).

:class:`Freezer` moves what the shard holds into the collector's permanent generation
(``gc.freeze``), which no collection walks: each time the store has made :data:`EVERY`
variables since the last time, it collects what is not frozen (the objects made since, a
bounded amount) and freezes what survives. A full collection then walks only the objects
made since the last freeze, whatever the shard holds. Reference counting still frees frozen
objects; only garbage in reference cycles among them would stay. So when the store lets go
of variables (a delete, a restore that replaces the table), :meth:`Freezer.released` gives
everything back to the collector (``gc.unfreeze``): a variable let go and caught in a cycle is
collected, never kept for good. The next freeze's collection then walks every object once.

The collector's state is the process's: a shard process has one store. Not thread-safe: the
event-loop thread only.
"""

from __future__ import annotations

import gc

__all__ = ["EVERY", "Freezer"]

#: Variables made between two freezes. Each freeze first collects the objects made since the
#: last one (a few per variable, plus the requests' leftovers): milliseconds.
EVERY = 4096


class Freezer:
    """Freezes the long-lived objects after every :data:`EVERY` variables made (see the module
    docstring). ``every`` can be set lower for tests."""

    def __init__(self, every: int = EVERY) -> None:
        self.every = every
        self._made = 0
        #: Freezes so far.
        self.freezes = 0

    def made(self, count: int = 1) -> None:
        """``count`` variables were made; freeze when :attr:`every` have been since the last
        freeze."""
        self._made += count
        if self._made >= self.every:
            self._made = 0
            self.freeze()

    def freeze(self) -> None:
        """Collect what is not frozen yet, then freeze what survives. After :meth:`released`
        the first collection walks every object (the table included), once."""
        gc.collect()
        gc.freeze()
        self.freezes += 1

    def released(self) -> None:
        """Variables were let go: hand every frozen object back to the collector, so that
        the ones caught in a reference cycle are collected."""
        if gc.get_freeze_count():
            gc.unfreeze()
