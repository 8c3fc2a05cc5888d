"""Half precision on the wire: float32 values and gradients sent as float16 or bfloat16.

A client that asks for it (a pull's ``wire_dtype``, docs/PROTOCOL.md §3) gets the float32
values it pulls narrowed to that dtype by the shard, and narrows the float32 gradients it
pushes itself; the receiver widens them back to float32. The shard keeps values and slots in
float32: only the bytes on the wire are halved. Tensors of any other dtype travel as they are.

* float16 (``<f2``): IEEE 754 half precision, 11 significant bits, finite up to 65504.
  :mod:`client_sdk.wire.casts` converts it (vectorized with NumKong where installed, else
  numpy), rounding to nearest, ties to even.
* bfloat16 (``<bf2``): float32's exponent with 8 significant bits, so float32's range. It comes
  from ml_dtypes (the SDK's optional extra ``paramshard[bfloat16]``; the shards' dependency),
  which rounds to nearest, ties to even, too.

A finite float32 beyond the wire dtype's range would arrive as an infinity: :func:`narrow`
refuses it instead (:class:`~client_sdk.wire.errors.WireError`, ``bad_tensor``), naming the
tensor and the largest magnitude the dtype holds.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import casts
from .errors import WireError
from .tensors import BFLOAT16 as BFLOAT16_STR
from .tensors import parse_dtype

__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT16_MAX",
    "WIRE_DTYPES",
    "bfloat16",
    "check_wire_dtype",
    "narrow",
    "narrow_array",
    "narrow_rows",
    "widen",
    "widen_into",
]

FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
#: float16's largest finite value: a float32 of at most this magnitude narrows to a finite one.
FLOAT16_MAX = 65504.0
#: The values a pull's ``wire_dtype`` (and ``PSClient(wire_dtype=...)``) may take.
WIRE_DTYPES = (FLOAT16, BFLOAT16)
#: Elements narrowed per cast: numpy casts small pieces much more slowly, so blocks are big;
#: the overflow check reads each block right after its cast, while it is in the cache.
_BLOCK = 1 << 20
#: Arrays of at least this many elements are converted by :data:`THREADS` threads at once.
THREADS_FROM = 1 << 21
#: Threads that convert one big array (at most 4: the conversion is bound by memory soon).
THREADS = max(1, min(4, os.cpu_count() or 1))
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_F4 = np.dtype("<f4")
_F2 = np.dtype("<f2")

#: How to install bfloat16 support where ml_dtypes is missing.
INSTALL_BFLOAT16 = (
    "bfloat16 on the wire needs the ml_dtypes package: pip install 'paramshard[bfloat16]' "
    "(or pip install ml_dtypes)"
)


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 dtype; :class:`WireError` saying how to install it when missing."""
    try:
        return parse_dtype(BFLOAT16_STR)
    except WireError:
        raise WireError(INSTALL_BFLOAT16, code="bad_request") from None


def check_wire_dtype(value: Any) -> str | None:
    """``value`` as a wire dtype name (``None``, or one of :data:`WIRE_DTYPES`), checked:
    :class:`WireError` ``bad_request`` for anything else, or for bfloat16 without ml_dtypes."""
    if value is None or value == "float32":
        return None
    if value not in WIRE_DTYPES:
        raise WireError(
            f"wire_dtype must be 'float16' or 'bfloat16' (or absent: float32), got {value!r}",
            code="bad_request",
        )
    if value == BFLOAT16:
        bfloat16()
    return str(value)


def _dtype(wire_dtype: str) -> np.dtype:
    return _F2 if wire_dtype == FLOAT16 else bfloat16()


def narrow(
    value: np.ndarray,
    wire_dtype: str,
    name: str = "tensor",
    out: np.ndarray | None = None,
    in_range: bool = False,
) -> tuple[np.ndarray, str]:
    """``value`` (float32) rounded to nearest in ``wire_dtype``, as it goes on the wire: a new
    array (or ``out``, C-contiguous, of ``value``'s shape and the wire dtype) and its type
    string (``"<f2"``; or ``"<bf2"`` for bfloat16, whose array then holds its bits as
    ``uint16``, the form a socket and a memoryview take). Refuses (:class:`WireError`
    ``bad_tensor``) a finite entry beyond the dtype's range, which would become an infinity,
    unless ``in_range`` says that ``value`` holds no magnitude beyond :data:`FLOAT16_MAX`
    (a shard that knows a bound of its value: the cast is then not read again). A big array
    is converted by several threads (:func:`_blocks`)."""
    dtype = _dtype(wire_dtype)
    if out is None or out.shape != value.shape or out.dtype != dtype or not out.flags.c_contiguous:
        out = np.empty(value.shape, dtype)
    src, dst = value.reshape(-1), out.reshape(-1)
    half = dtype == _F2
    check = half and not in_range  # bfloat16 holds float32's range

    def part(start: int, stop: int) -> None:
        for at in range(start, stop, _BLOCK):
            block = src[at : min(at + _BLOCK, stop)]
            narrowed = dst[at : at + block.size]
            if check:  # an overflow becomes an infinity: found here, and refused
                if casts.to_float16(block, narrowed):
                    _refuse_overflow(block, narrowed, name)
            elif half:
                casts.to_float16_in_range(block, narrowed)
            else:
                np.copyto(narrowed, block, casting="unsafe")

    _blocks(src.size, part)
    if half:
        return out, "<f2"
    return out.view(np.uint16), BFLOAT16_STR


def _refuse_overflow(block: np.ndarray, narrowed: np.ndarray, name: str) -> None:
    """:class:`WireError` if a finite entry of ``block`` became an infinity in ``narrowed``."""
    inf = np.isinf(narrowed)
    if np.isfinite(block[inf]).any():
        raise WireError(
            f"{name} holds values beyond float16's range (|x| > 65504, here up to "
            f"{float(np.abs(block[np.isfinite(block)]).max()):.6g}): they would travel "
            "as infinities, so nothing was sent; use wire_dtype='bfloat16' (float32's "
            "range) or float32 for it",
            code="bad_tensor",
        )


def _blocks(size: int, part: Callable[[int, int], None]) -> None:
    """Run ``part(start, stop)`` over ``range(size)``: at once below :data:`THREADS_FROM`
    elements, else in :data:`THREADS` slices at the same time (numpy releases the GIL while
    it casts), each on a thread of a pool this module keeps; the first exception raised in a
    slice is raised here once all are done."""
    if size < THREADS_FROM or THREADS < 2:
        part(0, size)
        return
    step = -(-size // THREADS // _BLOCK) * _BLOCK
    slices = [(at, min(at + step, size)) for at in range(0, size, step)]
    futures = [_pool().submit(part, *s) for s in slices[1:]]
    try:
        part(*slices[0])
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                THREADS - 1, thread_name_prefix="paramshard-halves"
            )
        return _POOL


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there (work given to them
    would never run), so the child makes its own."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def narrow_array(value: np.ndarray, wire_dtype: str, name: str = "tensor") -> np.ndarray:
    """:func:`narrow`'s array in its own dtype (float16, or ml_dtypes' bfloat16, which
    :func:`~client_sdk.wire.encode` sends as ``"<bf2"``), for a message's tensor."""
    out, text = narrow(value, wire_dtype, name)
    return out if text == "<f2" else out.view(bfloat16())


def widen(value: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A narrowed ``value`` (float16 or bfloat16, as decoded) back in float32 (exact: every
    float16 and bfloat16 is a float32), read-only; or written into ``out`` (float32 of
    ``value``'s shape), which is returned as it is. A big array is converted by several
    threads (:func:`_blocks`)."""
    given = out is not None
    if out is None:
        out = np.empty(value.shape, _F4)
    elif not out.flags.c_contiguous:
        out[...] = widen(value)
        return out
    src, dst = value.reshape(-1), out.reshape(-1)

    half = src.dtype == _F2

    def part(start: int, stop: int) -> None:
        if half:
            casts.to_float32(src[start:stop], dst[start:stop])
        else:
            np.copyto(dst[start:stop], src[start:stop])

    _blocks(src.size, part)
    if not given:
        out.flags.writeable = False
    return out


def widen_into(value: np.ndarray, out: np.ndarray) -> None:
    """Write a narrowed ``value`` (float16 or bfloat16) into float32 ``out`` of its size, both
    C-contiguous, on this thread: :func:`widen` for a piece of a value as it arrives."""
    if value.dtype == _F2:
        casts.to_float32(value, out)
    else:
        np.copyto(out, value)


def narrow_rows(
    names: list[str],
    values: list[np.ndarray | None],
    dtypes: list[str | None],
    wire_dtype: str,
    into: list[np.ndarray | None] | None = None,
    in_range: list[bool] | None = None,
) -> list[int]:
    """Narrow, in place in these parallel lists, every float32 value to ``wire_dtype`` as it
    goes on the wire (:func:`narrow`; its type string too), into the array ``into`` gives for
    it where it gives one, without the range check where ``in_range`` says it holds no
    magnitude beyond :data:`FLOAT16_MAX`; return the indices of the rows narrowed."""
    narrowed = []
    for i, value in enumerate(values):
        if value is not None and value.dtype == _F4:
            out = into[i] if into is not None else None
            fits = in_range[i] if in_range is not None else False
            values[i], dtypes[i] = narrow(
                value, wire_dtype, f"variable {names[i]!r}", out, in_range=fits
            )
            narrowed.append(i)
    return narrowed
