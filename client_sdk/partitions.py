"""Partitioned variables: how a variable split along axis 0 is laid out. Pure functions, the
same on the worker and on the shard.

A variable ``name`` of shape ``(n, ...)`` in ``k`` partitions is ``k`` variables
``name/part-0`` .. ``name/part-{k-1}``, each placed by its own name (:mod:`placement`). Part
``i`` holds rows ``[start_i, start_i + rows_i)`` with ``rows_i = n // k + (1 if i < n % k else
0)`` (the first ``n % k`` parts one row more, as ``numpy.array_split``), its shape ``(rows_i,
...)``. The layout (dtype, full shape, ``k``) is kept by the shard that owns ``name`` and never
changes; docs/PROTOCOL.md §3 (Partitioned variables) says how a client learns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .placement import validate_name

__all__ = ["PART_INFIX", "Layout", "auto_partitions", "part_name", "part_rows"]

#: A part's name is the variable's name, this, and the part's index.
PART_INFIX = "/part-"


def part_name(name: str, index: int) -> str:
    return f"{name}{PART_INFIX}{index}"


def part_rows(rows: int, parts: int) -> list[int]:
    """The rows of each of ``parts`` parts of a variable of ``rows`` rows."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def auto_partitions(shape: tuple[int, ...], itemsize: int, partition_bytes: int) -> int:
    """How many parts a variable gets when no one says (the fleet's ``--partition-bytes``,
    0: never split): the fewest parts of at most ``partition_bytes`` each, at most one per
    row; 1 for a variable within the bound, a scalar, or a variable of one row."""
    if partition_bytes <= 0 or not shape or shape[0] < 2:
        return 1
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    if nbytes <= partition_bytes:
        return 1
    return min(shape[0], -(-nbytes // partition_bytes))


class LayoutError(ValueError):
    """A layout that cannot be; ``field`` names the wire field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Layout:
    """A partitioned variable: its name, dtype (type string, e.g. ``"<f4"``), full shape and
    number of ``parts`` (at least 2)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: int

    @classmethod
    def make(cls, name: str, dtype: np.dtype, shape: tuple[int, ...], parts: Any) -> Layout:
        """Check a requested layout (:class:`LayoutError` saying what to do)."""
        if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)):
            raise LayoutError(f"partitions must be an int, got {parts!r}", "partitions")
        parts = int(parts)
        if parts < 1:
            raise LayoutError(f"partitions must be >= 1, got {parts}", "partitions")
        if not shape:
            raise LayoutError(
                f"a scalar cannot be partitioned (partitions={parts}): partitions split axis 0",
                "partitions",
            )
        if parts > shape[0]:
            raise LayoutError(
                f"partitions={parts} is more than the {shape[0]} row(s) of axis 0 (shape "
                f"{list(shape)}): use at most {shape[0]}",
                "partitions",
            )
        return cls(name, np.dtype(dtype).str, tuple(int(d) for d in shape), parts)

    @classmethod
    def from_wire(cls, name: str, entry: Any) -> Layout:
        """A layout from its wire form ``{"partitions", "dtype", "shape"}``."""
        if not isinstance(entry, dict):
            raise LayoutError("a layout is a map with partitions, dtype and shape", "partitions")
        try:
            validate_name(name)
            dtype = wire.parse_dtype(entry.get("dtype"))
        except ValueError as exc:
            raise LayoutError(str(exc), "dtype") from None
        except wire.WireError as exc:
            raise LayoutError(exc.message, "dtype") from None
        shape = entry.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > wire.MAX_NDIM
            or not all(type(d) is int and 0 <= d < 2**62 for d in shape)
        ):
            raise LayoutError(
                f"shape must be a list of at most {wire.MAX_NDIM} ints >= 0, got {shape!r}",
                "shape",
            )
        layout = cls.make(name, dtype, tuple(shape), entry.get("partitions"))
        if layout.parts < 2:
            raise LayoutError(
                "partitions=1 is a variable that is not partitioned: send its value instead",
                "partitions",
            )
        return layout

    def to_wire(self) -> dict[str, Any]:
        return {"partitions": self.parts, "dtype": self.dtype, "shape": list(self.shape)}

    def part_name(self, index: int) -> str:
        return part_name(self.name, index)

    def part_names(self) -> list[str]:
        return [part_name(self.name, i) for i in range(self.parts)]

    def rows(self) -> list[int]:
        return part_rows(self.shape[0], self.parts)

    def part_shapes(self) -> list[tuple[int, ...]]:
        rest = self.shape[1:]
        return [(r, *rest) for r in self.rows()]

    def split(self, array: np.ndarray) -> list[np.ndarray]:
        """Views of ``array`` (the full shape) as the parts, no copy."""
        out, start = [], 0
        for r in self.rows():
            out.append(array[start : start + r])
            start += r
        return out
