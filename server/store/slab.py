"""Values made together live together: one block of memory for the same-shaped variables of one
init.

The same-shaped variables of one init (a model's layers of one shape, a step's many small
tensors) share one :class:`Slab`, side by side in the order named, as a packed table lays out
its rows (docs/PROTOCOL.md §2); so do they after a restore (:func:`into_slabs`). A pull of all of
them in that order writes the block as one buffer (the kernel's send costs per buffer), and a
push to all of them is one update of the block (:func:`server.store.apply.one_update`).

A variable's home is its row. A value a reader holds while it must change moves to fresh memory
(:meth:`server.store.variable.Variable.target`) and comes back to its row at the first update
after the reader let go; meanwhile both are kept (at most twice the slab's bytes). The block
goes out whole only while every member is home.

Not thread-safe: the event-loop thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from client_sdk.optimizers import Optimizer

from .checks import native

if TYPE_CHECKING:
    from .variable import Variable

__all__ = ["SLAB_ROW_BYTES", "Slab", "homes", "into_slabs"]

#: Same-shaped variables of one init share a slab when each holds at most this many bytes.
#: What a slab saves is per variable (a buffer in a reply's write, a numpy call in a push),
#: nothing next to moving a bigger value; and a value that moves away from
#: its row while a reader holds it keeps both until it comes back (:class:`Slab`).
SLAB_ROW_BYTES = 1 << 20


class _Mem:
    """Memory that arrays are made over (numpy's array interface), kept alive by ``owner``.
    An array made over it has this object as its ``base``, so the arrays made from that array
    point at *it* (numpy collapses a view's base only through arrays): its reference count
    still tells whether a reader holds it (:meth:`Variable.held`), as for an array that owns
    its memory."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(
        self, address: int, shape: tuple[int, ...], typestr: str, readonly: bool, owner: object
    ) -> None:
        self.__array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (address, readonly),
            "version": 3,
        }
        self.owner = owner


class Slab:
    """One block of memory for the values of the same-shaped variables one init made, in the
    order it named them, one right after another.

    A variable's home is its row. An update that must not write in place (a reader holds the
    value, or a big push computes it off the loop into new memory while readers go on reading
    the old value: Adagrad's) moves the value to fresh memory and the variable is *away*; the
    first update after every reader of the row has let go of it brings the value home again
    (:meth:`Variable.target`). The block goes out whole only while every member is home.

    A deleted member leaves its row empty (``None`` in ``members``, :meth:`leave`): the block
    is then never again sent or updated whole, and its memory is freed with its last member."""

    __slots__ = ("memory", "address", "stride", "members", "away", "_rows")

    def __init__(self, count: int, stride: int) -> None:
        self.memory = np.empty(count * stride, np.uint8)
        self.address = self.memory.ctypes.data
        self.stride = stride
        self.members: list[Variable | None] = []
        self.away = 0
        self._rows: np.ndarray | None = None

    def rows(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Every row at once, writable, as one ``(members, *shape)`` array (for an update of
        all the members together; it holds no member's value, so it never counts as a
        reader)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = self.memory.view(dtype).reshape(len(self.members), *shape)
        return rows

    def row(self, i: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The writable array over row ``i``."""
        return np.asarray(_Mem(self.address + i * self.stride, shape, dtype.str, False, self))

    def leave(self, var: Variable) -> None:
        """``var``, a member, is deleted: its row stays empty."""
        self.members[var._row] = None

    def owns(self, array: np.ndarray) -> bool:
        """Whether ``array`` is one of this slab's rows (made by :meth:`row`)."""
        base = array.base
        return type(base) is _Mem and base.owner is self

    def whole(self, views: tuple[np.ndarray, ...]) -> np.ndarray:
        """The block, read-only bytes, holding ``views`` (the members' exported values, in
        order) for as long as it lives: while a reply writes it, every member counts as held
        and no update writes its row."""
        return np.asarray(_Mem(self.address, (len(views) * self.stride,), "|u1", True, views))


def homes(plans: list[tuple[str, np.ndarray, Optimizer]]) -> list[tuple[Slab, int] | None]:
    """Per new variable of an init (``(name, value, optimizer)``, in the order named), its slab
    and row, or None: each run of two or more variables in a row with one dtype and one shape
    (at least one dimension, some bytes, at most :data:`SLAB_ROW_BYTES` each) gets a slab of
    its own."""
    out: list[tuple[Slab, int] | None] = [None] * len(plans)
    start = 0
    while start < len(plans):
        first = plans[start][1]
        key = (native(first.dtype), first.shape)
        end = start + 1
        while end < len(plans) and (native(plans[end][1].dtype), plans[end][1].shape) == key:
            end += 1
        if end - start >= 2 and first.ndim and 0 < first.nbytes <= SLAB_ROW_BYTES:
            slab = Slab(end - start, first.nbytes)
            for i in range(start, end):
                out[i] = (slab, i - start)
        start = end
    return out


def into_slabs(variables: list[Variable]) -> None:
    """Restored variables laid out as their init made them: each run of two or more tensors in
    a row with one dtype and shape in a slab of its own (their values copied there), and one
    object per distinct optimizer, so pulls and pushes of them take the same ways as before a
    restart."""
    optimizers: dict[Optimizer, Optimizer] = {}
    for var in variables:
        var.optimizer = optimizers.setdefault(var.optimizer, var.optimizer)
    for var, home in zip(variables, homes([(v.name, v.value, v.optimizer) for v in variables])):
        if home is None:
            continue
        slab, i = home
        row = slab.row(i, var.value.dtype, var.value.shape)
        np.copyto(row, var.value)
        var.value, var._view, var._slab, var._row = row, None, slab, i
        slab.members.append(var)
