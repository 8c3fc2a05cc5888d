"""Partitioned variables on a shard: the descriptor of each one this shard owns the name of.

A partitioned variable ``name`` is split along axis 0 into ``name/part-0`` .. ``name/part-{k-1}``,
each an ordinary variable placed by its own name (docs/PROTOCOL.md §3, Partitioned variables).
The shard that owns ``name`` keeps its :class:`Layout`: dtype, full shape and ``k``, from which
every part's rows follow (:func:`client_sdk.partitions.part_rows`). The layout never changes
after init; a delete removes it with the parts (which the client deletes on their shards).

This module owns the layouts' table (:class:`Layouts`), the operation that creates them
(:class:`CreateLayouts`, built whole by :func:`create` before anything changes) and the refusal
of a verb that names a partitioned variable as if it were a plain one (409 ``partitioned``,
whose details carry the layout so the client can address the parts). No HTTP in here; it must
not import the rest of the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from client_sdk import partitions

from ..errors import ShardError

__all__ = ["CreateLayouts", "Layout", "Layouts", "create", "from_wire"]

Layout = partitions.Layout


def from_wire(name: str, entry: Any) -> Layout:
    """The layout an init entry or a snapshot states: 400 naming the field."""
    try:
        return partitions.Layout.from_wire(name, entry)
    except ValueError as exc:
        field = getattr(exc, "field", "partitions")
        raise ShardError(
            "bad_request", f"init: {name}: {exc}", {"variable": name, "field": field}
        ) from None


@dataclass(frozen=True, slots=True)
class CreateLayouts:
    """Record the layouts of ``new`` (those of the request not held yet); ``names`` is every
    partitioned name of the request, in its order."""

    names: tuple[str, ...]
    new: tuple[Layout, ...]


class Layouts:
    """The layouts of the partitioned variables whose names this shard owns."""

    def __init__(self) -> None:
        self._by_name: dict[str, Layout] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterable[Layout]:
        return iter(list(self._by_name.values()))

    def get(self, name: str) -> Layout | None:
        return self._by_name.get(name)

    def apply(self, op: CreateLayouts) -> None:
        for layout in op.new:
            self._by_name[layout.name] = layout

    def remove(self, names: Iterable[str]) -> list[Layout]:
        """Forget the layouts of ``names`` held here; return them."""
        return [self._by_name.pop(n) for n in names if n in self._by_name]

    def matching(self, prefix: str) -> list[str]:
        return [n for n in self._by_name if n.startswith(prefix)]

    def replace(self, layouts: Iterable[Layout]) -> None:
        self._by_name = {layout.name: layout for layout in layouts}

    def export(self) -> dict[str, dict[str, Any]]:
        """Name -> wire form, for a snapshot's manifest (``"layouts"``)."""
        return {name: layout.to_wire() for name, layout in self._by_name.items()}

    def refuse(self, names: Iterable[str]) -> None:
        """409 ``partitioned`` if one of ``names`` is a partitioned variable held here: a verb
        for plain variables named it. ``details.layouts`` maps each such name to its layout."""
        found = {n: self._by_name[n] for n in names if n in self._by_name}
        if not found:
            return
        first = next(iter(found.values()))
        raise ShardError(
            "partitioned",
            f"{first.name!r} is a partitioned variable of {first.parts} parts "
            f"({first.part_name(0)!r} .. {first.part_name(first.parts - 1)!r}): address its "
            "parts, each on the shard that owns its name (the SDK does this for you)",
            {"layouts": {n: layout.to_wire() for n, layout in found.items()}},
        )


def create(entries: Mapping[str, Any], layouts: Layouts, plain: Mapping[str, Any]) -> CreateLayouts:
    """The operation creating the layouts of ``entries`` (name -> init entry with
    ``partitions``, names checked already): 400 for a bad entry, 409 (``field``:
    ``partitions``, ``dtype`` or ``shape``) for a name held with another layout or as a plain
    variable (``plain``)."""
    new = []
    for name, entry in entries.items():
        layout = from_wire(name, entry)
        if name in plain:
            raise ShardError(
                "conflict",
                f"{name!r} already exists as a variable that is not partitioned: it cannot "
                f"become one of {layout.parts} parts. Use another name, delete it first, or "
                "init it with partitions=1",
                {"variable": name, "field": "partitions", "existing": 1, "requested": layout.parts},
            )
        have = layouts.get(name)
        if have is None:
            new.append(layout)
            continue
        for field in ("parts", "dtype", "shape"):
            if getattr(have, field) != getattr(layout, field):
                wire_field = "partitions" if field == "parts" else field
                raise ShardError(
                    "conflict",
                    f"{name!r} already exists as a partitioned variable with {wire_field} "
                    f"{_shown(getattr(have, field))}, not {_shown(getattr(layout, field))}: "
                    "a partitioned variable's layout is fixed when it is made; use another "
                    "name, delete it first, or init it as it is",
                    {
                        "variable": name,
                        "field": wire_field,
                        "existing": have.to_wire(),
                        "requested": layout.to_wire(),
                    },
                )
    return CreateLayouts(tuple(entries), tuple(new))


def refuse_plain(names: Iterable[str], layouts: Layouts) -> None:
    """409 (``field``: ``partitions``) if an init of plain values names a partitioned
    variable."""
    for name in names:
        have = layouts.get(name)
        if have is not None:
            raise ShardError(
                "conflict",
                f"{name!r} already exists as a partitioned variable of {have.parts} parts: "
                "init it with the same partitions (the SDK does, from the layout it learns), "
                "or delete it first",
                {
                    "variable": name,
                    "field": "partitions",
                    "existing": have.to_wire(),
                    "requested": 1,
                },
            )


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)
