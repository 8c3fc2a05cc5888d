"""What a gradient or a value must be before the store applies it, and the checks that say so.

A write is checked whole before any of it is applied (:mod:`server.store.operations`); these
are the checks of its tensors, and the refusals (422 ``bad_tensor``) they raise:

* **Fit.** A gradient applies to a float variable only, in a float dtype and the variable's
  shape (:func:`check_dtypes_and_shapes`); it is cast to the variable's dtype
  (:func:`grad_to_apply`). An assigned value has the variable's shape and survives the cast to
  its dtype (:func:`cast_checked`).
* **Finite.** No NaN and no infinity, in the dtype the value is applied in. One streaming pass,
  no array-sized temporary (:func:`all_finite`), which also yields at least the sum of squares
  (:func:`finite_squares`): what bounds an update (:mod:`server.store.bounds`).
* **Finite, sooner.** The same check done before the store sees the push: over a tensor table's
  same-shaped gradients as one block (:func:`finite_rows`), or over a big push's gradients while
  its body is still arriving (:class:`FiniteScan`). The route passes what they found to the
  store (``ParameterStore.push(..., finite=...)``), which skips its own check for those.

**Checking while the body arrives.** A finiteness check (one pass over every gradient byte) run
after the last byte arrived would sit in series with the update, a noticeable part of a big
push. But the body of a big push is written by the socket straight into one buffer
(:class:`server.httptools_protocol.BodyInto`), piece by piece, and between pieces the shard
waits for the network. :class:`FiniteScan` uses those waits: it is called with the count of
bytes received after each piece, reads the frame's header as soon as it is complete, and checks
each float gradient's bytes as they land, while they are still in the CPU's caches. When the
body is complete, :attr:`FiniteScan.finite` maps the gradients found finite to their sum of
squares.
It only ever shortens the work: anything it does not understand (not a framed push, a header
that does not parse, a dtype it does not scan, an overflow it cannot tell from an infinity)
leaves those gradients out of :attr:`~FiniteScan.finite`, and the store's exact check decides.
The handler decodes the same header from the same bytes afterwards, so the names refer to
the same tensors.

Nothing here changes a variable. The BLAS dot products here may warn when they overflow: the
callers run them under ``np.errstate(all="ignore")``, once per request. Thread-safe functions;
:class:`FiniteScan` on the event-loop thread only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from client_sdk import wire
from client_sdk.wire import halves

from ..errors import ShardError

if TYPE_CHECKING:
    from .variable import Variable

__all__ = [
    "MIN_SCAN_BYTES",
    "SCAN_FROM",
    "SMALL_CHECK",
    "FiniteScan",
    "OneBound",
    "all_finite",
    "cast_checked",
    "check_dtypes_and_shapes",
    "finite_rows",
    "finite_squares",
    "grad_to_apply",
    "native",
    "tensor_error",
]

_F4, _F2 = np.dtype("<f4"), np.dtype("<f2")
#: f2 arrays up to this many elements are checked with a temporary (cheaper per call than the
#: sum).
SMALL_CHECK = 1 << 16


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (``>f4`` -> ``<f4`` on x86): the order the store
    keeps values in."""
    return dtype.newbyteorder("=")


def tensor_error(name: str, message: str, **details: Any) -> ShardError:
    """422 ``bad_tensor`` for variable ``name``."""
    return ShardError("bad_tensor", f"{name}: {message}", {"variable": name, **details})


# -- finite ---------------------------------------------------------------------------------


def all_finite(a: np.ndarray) -> bool:
    """True if ``a`` has no NaN or infinity. One streaming pass, no array-sized temporary in
    the common case: a reduction that any NaN or infinity carries through is finite exactly
    when no element is non-finite, unless it overflowed, which the exact fallback settles.
    For f4 and f8 the reduction is the dot product of ``a`` with itself (BLAS, one thread in a
    shard: quicker than ``isfinite().all()`` for small arrays and than numpy's pairwise sum
    for big ones); for f2 (no BLAS) the sum,
    or for small arrays ``isfinite().all()``. The dot may warn when it overflows: call it
    under ``np.errstate(all="ignore")`` (the store does, once per request)."""
    dtype = a.dtype
    if dtype.kind != "f" or a.size == 0:
        return True
    if dtype.itemsize >= 4:  # may warn of an overflow: under the caller's errstate
        flat = a if a.ndim == 1 else a.reshape(-1)
        total = float(np.dot(flat, flat))
    elif a.size <= SMALL_CHECK:
        return bool(np.isfinite(a).all())
    else:
        with np.errstate(all="ignore"):
            total = float(np.add.reduce(a, axis=None))
    if math.isfinite(total):
        return True
    return bool(np.isfinite(a).all())


def finite_squares(a: np.ndarray) -> float | None:
    """None if ``a`` has a NaN or an infinity; else at least its sum of squares (exact for f4
    and f8 up to rounding, the same pass as :func:`all_finite`'s; ``inf`` where it is not
    known: f2, integers, or an overflow). The dot may warn when it overflows: call it under
    ``np.errstate(all="ignore")``."""
    dtype = a.dtype
    if dtype.kind != "f":
        return math.inf
    if a.size == 0:
        return 0.0
    if dtype.itemsize >= 4:
        flat = a if a.ndim == 1 else a.reshape(-1)
        total = float(np.dot(flat, flat))
        if math.isfinite(total):
            return total
    return math.inf if all_finite(a) else None


def _finite_quiet(a: np.ndarray) -> bool:
    """:func:`all_finite` without its overflow warning, for callers outside a loop that
    silences floating-point errors once for many arrays (as push does)."""
    with np.errstate(all="ignore"):
        return all_finite(a)


# -- fit ------------------------------------------------------------------------------------


def check_dtypes_and_shapes(variables: Sequence[Variable], grads: Sequence[np.ndarray]) -> None:
    """Refuse a push (422) unless every variable is a float one and its gradient (``grads``,
    in order) is of a float dtype (bfloat16 included: :mod:`client_sdk.wire.halves`) and the
    variable's shape."""
    for var, grad in zip(variables, grads):
        if (
            var.value.dtype.kind != "f"
            or (grad.dtype.kind != "f" and grad.dtype.name != "bfloat16")
            or grad.shape != var.value.shape
        ):
            raise _grad_error(var, grad)


def _grad_error(var: Variable, grad: np.ndarray) -> ShardError:
    """Why ``grad`` cannot be applied to ``var`` (dtype kinds, then shape); call only when one
    of them is wrong."""
    if var.value.dtype.kind != "f":
        return tensor_error(
            var.name,
            f"variable has integer dtype {var.value.dtype.str}; gradients apply "
            "to float variables only (use increment or assign to change it)",
        )
    if grad.dtype.kind != "f" and grad.dtype.name != "bfloat16":
        return tensor_error(
            var.name,
            f"gradient dtype {grad.dtype.str} is not a float type: send f2, f4, f8 or bf2",
        )
    return tensor_error(
        var.name,
        f"gradient shape {list(grad.shape)} differs from the variable's {list(var.value.shape)}",
        shape=list(var.value.shape),
    )


def grad_to_apply(
    var: Variable,
    grad: np.ndarray,
    checked: float | None,
    squares: list[float],
    widened: np.ndarray | None = None,
) -> np.ndarray:
    """``grad`` as it is applied to ``var``: cast to its dtype if need be (a fresh, writable
    copy) and found finite, unless ``checked`` (at least its sum of squares) says it was
    already and it needed no cast (a cast can overflow: what is applied is checked). At
    least its sum of squares goes to ``squares``. 422 if it is not finite. Call under
    ``np.errstate``; after :func:`check_dtypes_and_shapes`. A half-precision gradient of a
    float32 variable (``wire_dtype``) is widened by :func:`client_sdk.wire.halves.widen`
    (vectorized), not numpy's element-by-element cast, into ``widened`` when given (float32 of
    its shape: a worker thread is handed memory the loop's thread allocated, see
    server/store/heap.py)."""
    if grad.dtype != var.value.dtype:
        if var.value.dtype == _F4 and (grad.dtype == _F2 or grad.dtype.name == "bfloat16"):
            if widened is None or widened.shape != grad.shape or widened.dtype != _F4:
                widened = np.empty(grad.shape, _F4)
            grad = halves.widen(grad, widened)
        else:
            grad = grad.astype(var.value.dtype)
        checked = None
    if checked is None:
        checked = finite_squares(grad)
        if checked is None:
            raise tensor_error(
                var.name,
                f"gradient has NaN or infinite entries (in {var.value.dtype.str}): skip or "
                "clip this step",
            )
    squares.append(checked)
    return grad


def cast_checked(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` as ``dtype``, refusing what would not survive the cast (NaN, inf, overflow)."""
    if value.dtype == dtype:
        if not _finite_quiet(value):
            raise tensor_error(name, "value has NaN or infinite entries")
        return value
    if dtype.kind == "f":
        with np.errstate(all="ignore"):
            cast = value.astype(dtype)
        if not _finite_quiet(cast):
            raise tensor_error(name, f"value has NaN or infinite entries once cast to {dtype.str}")
        return cast
    if not _finite_quiet(value):
        raise tensor_error(name, "value has NaN or infinite entries")
    if value.size:
        info = np.iinfo(dtype)
        lo, hi = value.min(), value.max()
        if lo < info.min or hi > info.max:
            raise tensor_error(
                name,
                f"values in [{lo}, {hi}] do not fit dtype {dtype.str} "
                f"(range {info.min}..{info.max})",
            )
    return value.astype(dtype)


# -- finite, sooner: a table's block in one pass, a big body while it arrives -----------------

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


class OneBound(dict[str, float]):
    """Gradients found finite by one reduction over all of them: name -> ``total``, their
    sum of squares together (at least each one's). ``total`` is there as one figure, so a
    caller needing it per gradient repeats it instead of reading the map name by name."""

    __slots__ = ("total",)

    total: float

    @classmethod
    def of(cls, names: Sequence[str], total: float) -> OneBound:
        """``names`` each found finite, their sum of squares together ``total``."""
        found = cls.fromkeys(names, total)
        found.total = total
        return found


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
                return OneBound.of(names, total)
        squares = np.einsum("ij,ij->i", rows, rows).tolist()
    return {name: s for name, s in zip(names, squares) if math.isfinite(s)}
