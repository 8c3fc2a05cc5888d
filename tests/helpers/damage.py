"""Damage to a decoded msgpack message or to a body's bytes, drawn as a plan before the thing to
damage is seen.

A plan's shape (what Hypothesis draws for it) never depends on what it is applied to: every
choice is drawn up front (a place as a number taken modulo the number of places, a near miss as
an index into the candidates for whatever value sits there, a position in the bytes as a
fraction of their length) and the plan picks among them when applied. A test whose input varies
between runs of one example, a shard's reply whose state moved on, replays the same draws, so
Hypothesis sees one strategy (it raises ``FlakyStrategyDefinition`` when draws follow the input).

    plan = data.draw(header_damages())
    damaged = plan.apply(header)          # a copy with one thing replaced or dropped
    body = data.draw(bytes_damages()).apply(body)    # cut, overwritten or extended

Used by tests/shard/test_fuzz_requests.py (damaged requests) and tests/sdk/test_fuzz_replies.py
(damaged replies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
from hypothesis import strategies as st

__all__ = [
    "ANYTHING",
    "DTYPE_STRINGS",
    "EDGE_INTS",
    "BytesDamage",
    "HeaderDamage",
    "bytes_damages",
    "header_damages",
    "paths",
]

#: Any value msgpack carries, nested a little.
ANYTHING = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.binary(max_size=16),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
#: Dtype strings: valid ones of other sizes and byte orders, and ones a shard must refuse.
DTYPE_STRINGS = [
    "<f4",
    ">f4",
    "<f8",
    ">f8",
    "<f2",
    "|u1",
    "<i4",
    ">i8",
    "<u8",
    "<c8",
    "|b1",
    "f4",
    "<f3",
    "<f16",
    "|f4",
    "",
    "<",
]
#: Ints at the edges: of sizes, offsets, counts and seqs.
EDGE_INTS = [
    -(2**63),
    -1,
    0,
    1,
    3,
    63,
    64,
    65,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**64 - 1,
]
_FRACTION = 1 << 16  # positions and picks are drawn in [0, _FRACTION]


def paths(obj: Any, here: tuple = ()) -> list[tuple]:
    """Every place in a decoded message: map keys and list indices, nested."""
    out = [here]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*here, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*here, i))
    return out


@dataclass(frozen=True)
class HeaderDamage:
    """One thing in a message replaced (by a near miss of its own type, or by ``anything``
    now and then) or dropped."""

    place: int  # which place, modulo the number of places
    drop: bool  # drop it (a map key or a list item) rather than replace it
    wild: bool  # replace it with ``anything`` rather than a near miss
    pick: int  # which near miss, modulo the number of candidates
    text: str  # the near miss of a string that is not one of the listed strings
    number: float  # the near miss of an int that is a float
    small: int  # the near miss of a float that is an int
    edges: list[int]  # the near miss of a list that is a list of edge ints
    anything: Any

    def near(self, value: Any) -> Any:
        """A value a careless or hostile sender might put in place of ``value``."""
        if self.wild:
            return self.anything
        if isinstance(value, bool):
            options: list[Any] = [not value, 0, 1, None, "true"]
        elif isinstance(value, int):
            options = [value - 1, value + 1, -value, *EDGE_INTS, self.number]
        elif isinstance(value, float):
            options = [-value, 0.0, float("nan"), float("inf"), 1e308, self.small]
        elif isinstance(value, str):
            options = [*DTYPE_STRINGS, value + "x", value[:-1], value.upper(), "table", "uniform"]
            options.append(self.text)
        elif isinstance(value, bytes):
            options = [value[:-1], value + b"\0", b"", value * 2]
        elif isinstance(value, list):
            options = [value[:-1], value + value[:1], [], [value], value[::-1], [*value, *value]]
            options.append(list(self.edges))
        elif isinstance(value, dict):
            options = [{}, dict(list(value.items())[:1]), [value]]
        else:
            return self.anything
        return options[self.pick % len(options)]

    def apply(self, message: Any) -> Any:
        """A copy of ``message`` (anything msgpack carries) with one thing changed."""
        message = msgpack.unpackb(
            msgpack.packb(message, use_bin_type=True), raw=False, strict_map_key=False
        )
        places = paths(message)
        where = places[self.place % len(places)]
        if not where:
            return self.near(message)
        parent = message
        for key in where[:-1]:
            parent = parent[key]
        key = where[-1]
        if self.drop:
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        else:
            parent[key] = self.near(parent[key])
        return message


def header_damages() -> st.SearchStrategy[HeaderDamage]:
    """Plans for :meth:`HeaderDamage.apply`: three replacements to a drop, one replacement in
    four by anything at all."""
    return st.builds(
        HeaderDamage,
        place=st.integers(0, _FRACTION),
        drop=st.sampled_from([False, False, False, True]),
        wild=st.sampled_from([False, False, False, True]),
        pick=st.integers(0, _FRACTION),
        text=st.text(max_size=6),
        number=st.floats(allow_nan=True, allow_infinity=True),
        small=st.integers(-2, 2),
        edges=st.lists(st.sampled_from(EDGE_INTS), max_size=4),
        anything=ANYTHING,
    )


@dataclass(frozen=True)
class BytesDamage:
    """Bytes cut short, overwritten somewhere or extended; an empty body replaced by ``fill``.
    ``at`` is a fraction of the length (of ``_FRACTION``), so that bodies of any length take
    the same plan."""

    what: str  # "cut", "overwrite" or "extend"
    at: int
    junk: bytes  # what overwrites
    tail: bytes  # what extends
    fill: bytes  # what an empty body becomes

    def apply(self, body: bytes) -> bytes:
        if not body:
            return self.fill
        at = min(self.at * len(body) // _FRACTION, len(body) - 1)
        if self.what == "cut":
            return body[:at]
        if self.what == "overwrite":
            return body[:at] + self.junk + body[at + len(self.junk) :]
        return body + self.tail


def bytes_damages() -> st.SearchStrategy[BytesDamage]:
    """Plans for :meth:`BytesDamage.apply`."""
    return st.builds(
        BytesDamage,
        what=st.sampled_from(["cut", "overwrite", "extend"]),
        at=st.integers(0, _FRACTION),
        junk=st.binary(min_size=1, max_size=8),
        tail=st.binary(min_size=1, max_size=100),
        fill=st.binary(min_size=1, max_size=16),
    )
