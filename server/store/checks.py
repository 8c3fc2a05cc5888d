"""Checking a push's gradients for NaN and infinities while its body is still arriving.

A push is validated whole before any of it is applied, so a finiteness check (one pass over
every gradient byte) run after the last byte arrived would sit in series with the update, a
noticeable part of a big push. But the body of a big push is written by the socket straight into one
buffer (:class:`server.httptools_protocol.BodyInto`), piece by piece, and between pieces the shard
waits for the network. :class:`FiniteScan` uses those waits: it is called with the count of bytes
received after each piece, reads the frame's header as soon as it is complete, and checks
each float gradient's bytes as they land, while they are still in the CPU's caches. When the
body is complete, :attr:`FiniteScan.finite` maps the gradients found finite to their sum of
squares (which bounds what the update can do: ``server.store._bounds_after``); the store skips
its own check for those (``ParameterStore.push(..., finite=...)``) and checks the rest
itself.

It only ever shortens the work: anything it does not understand (not a framed push, a header
that does not parse, a dtype it does not scan, an overflow it cannot tell from an infinity)
leaves those gradients out of :attr:`~FiniteScan.finite`, and the store's exact check decides.
The handler decodes the same header from the same bytes afterwards, so the names refer to
the same tensors. Event-loop thread only.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from numpy.lib.stride_tricks import as_strided

from client_sdk import wire

__all__ = ["MIN_SCAN_BYTES", "SCAN_FROM", "FiniteScan", "finite_rows"]

#: Push bodies from this size on are scanned as they arrive. Around 4 MB the scan is about
#: even in time and saves shard CPU; from tens of MB up it shortens the push clearly. Below
#: ~1 MB the whole body tends to arrive in one or two reads: nothing to overlap.
SCAN_FROM = 1 << 20

#: A gradient's arrived bytes are checked once at least this many are waiting (or the
#: gradient is complete): fewer, bigger reductions.
MIN_SCAN_BYTES = 256 * 1024
_PREFIX = wire.FRAME_PREFIX


class _Row:
    __slots__ = ("name", "flat", "start", "itemsize", "next", "finite", "squares")

    def __init__(self, name: str, flat: np.ndarray, start: int) -> None:
        self.name = name
        self.flat = flat
        self.start = start  # byte offset of the tensor in the body
        self.itemsize = flat.dtype.itemsize
        self.next = 0  # elements checked so far
        self.finite = True
        self.squares = 0.0  # of the elements checked so far


class FiniteScan:
    """Call with the body's received byte count after each piece lands in ``buffer`` (the
    body's whole buffer, ``Content-Length`` bytes). :attr:`finite` maps the names of the
    gradients (``grads``, map or table layout) checked whole and found finite to their sum
    of squares."""

    def __init__(self, buffer: memoryview) -> None:
        self._buffer = buffer
        self._rows: list[_Row] | None = None
        self._base = np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]
        #: Gradients checked in full and finite in their own dtype: name -> sum of squares.
        self.finite: dict[str, float] = {}

    def __call__(self, received: int) -> None:
        rows = self._rows
        if rows is None:
            try:
                rows = self._rows = self._layout(received)
            except (wire.WireError, ValueError, TypeError, KeyError, struct.error):
                rows = self._rows = []  # not a push this understands: the store checks all
            if rows is None:
                return
        for row in rows:
            size = row.flat.size
            if row.next == size:
                continue
            upto = min(size, max(0, received - row.start) // row.itemsize)
            if upto < size and (upto - row.next) * row.itemsize < MIN_SCAN_BYTES:
                continue
            segment = row.flat[row.next : upto]
            with np.errstate(all="ignore"):
                squares = float(np.dot(segment, segment))
            if math.isfinite(squares):
                row.squares += squares
            else:
                row.finite = False  # non-finite, or an overflow: the store decides
            row.next = upto
            if upto == size and row.finite:
                self.finite[row.name] = row.squares

    def _layout(self, received: int) -> list[_Row] | None:
        """The float gradients and where they lie, once the header has arrived (else None)."""
        buffer = self._buffer
        if received < _PREFIX.size:
            return None
        magic, hlen = _PREFIX.unpack_from(buffer, 0)
        if magic != wire.FRAME_MAGIC:
            return []
        if received < _PREFIX.size + hlen:
            return None
        msg = wire.unpack(buffer[: _PREFIX.size + hlen], wire.FRAME)
        grads = msg.get("grads")
        if msg.get("layout") == "table":
            names, arrays = wire.table_rows(grads, buffer, "grads")
            pairs = list(zip(names, arrays))
        elif isinstance(grads, dict):
            pairs = list(wire.tensors_of(grads, buffer, "grads").items())
        else:
            return []
        rows = []
        for name, array in pairs:
            if (
                array is None
                or array.dtype.kind != "f"
                or array.dtype.itemsize < 4
                or not array.dtype.isnative
                or not array.size
            ):
                continue
            start = array.__array_interface__["data"][0] - self._base
            rows.append(_Row(name, array.reshape(-1), start))
        return rows


def finite_rows(names: list[str], block: np.ndarray | None) -> dict[str, float]:
    """The names whose gradient is finite, each with at least its sum of squares, checked in
    one pass over ``block``, the gradients
    of a tensor table whose rows all have one float dtype and one shape as one view
    (``client_sdk.wire.table_rows(..., with_block=True)``; ``block[i]`` is ``names[i]``'s).
    A step's many small gradients are typically that; one reduction over the block costs a fraction
    of one per gradient.

    ``None`` or any other block gives an empty map, and a row whose reduction is not finite
    (a NaN or an infinity, or an overflow of finite values) is left out: the store's exact
    check decides for whatever is not named here."""
    n = len(names)
    if (
        block is None
        or n < 2
        or block.ndim < 2
        or len(block) != n
        or block.dtype.kind != "f"
        or block.dtype.itemsize < 4
        or not block.dtype.isnative
        or not block[0].size
    ):
        return {}
    rows = block.reshape(n, -1)  # each row is contiguous: a view
    with np.errstate(all="ignore"):
        # The usual case first: all finite, told by one reduction over the memory from the
        # first row's start to the last one's end, the padding between rows included (as
        # one flat view, about half the cost of a reduction per row). Padding that
        # is not finite, or an overflow, only sends the rows to the row-by-row check.
        item, stride, width = rows.itemsize, rows.strides[0], rows.shape[1]
        if stride % item == 0 and stride >= width * item:
            span = as_strided(rows, ((n - 1) * (stride // item) + width,), (item,))
            total = float(np.dot(span, span))  # at least each row's sum of squares
            if math.isfinite(total):
                return dict.fromkeys(names, total)
        squares = np.einsum("ij,ij->i", rows, rows).tolist()
    return {name: s for name, s in zip(names, squares) if math.isfinite(s)}
