"""One tensor on the wire: its dtype and shape checked, its map decoded as a view.

A tensor inside a message is a map::

    {"dtype": "<f4", "shape": [2, 3], "data": <bin>}            # inline
    {"dtype": "<f4", "shape": [2, 3], "offset": 128, "nbytes": 24}  # framed

``dtype`` is a numpy array-interface type string (byte order + kind + item size), restricted to
:data:`~client_sdk.wire.constants.DTYPES`, or ``"<bf2"``, bfloat16 (:data:`BFLOAT16`, through
ml_dtypes). Decoding is one ``np.frombuffer`` over the received bytes (:func:`decode_tensor`;
:func:`framed_view` for the common framed case with as little Python as possible): no
per-element work, and never pickle. :func:`dtype_str` is the other way: the type string of an
array's dtype, refused when the protocol has no name for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeGuard

import numpy as np

from .constants import ALIGN, DTYPES, MAX_NDIM
from .errors import WireError

__all__ = [
    "BFLOAT16",
    "MAX_ARRAY_BYTES",
    "PARSED",
    "PARSED_NATIVE",
    "SENDABLE",
    "Buffer",
    "buffer_size",
    "decode_tensor",
    "dtype_str",
    "framed_view",
    "is_tensor",
    "parse_dtype",
    "parse_shape",
]

Buffer = bytes | bytearray | memoryview
_DTYPE_RE = re.compile(r"([<>|])([fiu])([1248])")
#: numpy refuses shapes whose byte size (zero dimensions left out) does not fit in an intp.
MAX_ARRAY_BYTES = np.iinfo(np.intp).max


#: The type string of bfloat16 (ml_dtypes' ``bfloat16``, little-endian), the one dtype off
#: :data:`~client_sdk.wire.constants.DTYPES` (:mod:`client_sdk.wire.halves`).
BFLOAT16 = "<bf2"


def _bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, noted as parsed; :class:`WireError` saying how to install it."""
    try:
        import ml_dtypes
    except ImportError:
        raise WireError(
            "a tensor of dtype '<bf2' (bfloat16) needs the ml_dtypes package: pip install "
            "'paramshard[bfloat16]' (or pip install ml_dtypes)",
            code="bad_tensor",
        ) from None
    dtype: np.dtype = np.dtype(ml_dtypes.bfloat16)
    PARSED[BFLOAT16] = dtype
    if dtype.isnative:
        PARSED_NATIVE[BFLOAT16] = dtype
    return dtype


#: Type strings already parsed (only valid ones: at most the 11 kinds in each byte order).
PARSED: dict[str, np.dtype] = {}
#: The ones of them in this machine's byte order.
PARSED_NATIVE: dict[str, np.dtype] = {}


def parse_dtype(text: Any) -> np.dtype:
    """``"<f4"`` -> ``np.dtype``; anything off the allow-list raises :class:`WireError`."""
    if type(text) is str:
        known = PARSED.get(text)
        if known is not None:
            return known
        if text == BFLOAT16:
            return _bfloat16()
    m = _DTYPE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None or (m.group(2) + m.group(3)) not in DTYPES:
        raise WireError(
            f"unsupported dtype {text!r}: use a numpy type string such as '<f4' "
            f"(kinds f2 f4 f8 i1..i8 u1..u8)",
            code="bad_tensor",
        )
    order, size = m.group(1), int(m.group(3))
    if (order == "|") != (size == 1):
        raise WireError(
            f"dtype {text!r}: byte order must be '|' for one-byte types and '<' or '>' otherwise",
            code="bad_tensor",
        )
    dtype: np.dtype[Any] = np.dtype(text)
    PARSED[text] = dtype
    if dtype.isnative:
        PARSED_NATIVE[text] = dtype
    return dtype


def is_tensor(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "dtype" in obj and "shape" in obj


def parse_shape(shape: Any, itemsize: int) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise WireError(
            f"tensor shape must be a list of at most {MAX_NDIM} ints", code="bad_tensor"
        )
    out = []
    span = itemsize  # bytes, counting zero dimensions as 1: what numpy checks for overflow
    for d in shape:
        if (type(d) is not int and not _is_int(d)) or d < 0:
            raise WireError(
                f"tensor shape {shape!r}: dimensions must be ints >= 0", code="bad_tensor"
            )
        span *= max(d, 1)
        if span > MAX_ARRAY_BYTES:
            raise WireError(
                f"tensor shape {shape!r} is too large for an array on this machine",
                code="bad_tensor",
            )
        out.append(d)
    return tuple(out)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def buffer_size(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def decode_tensor(obj: Any, body: Buffer | None = None) -> np.ndarray:
    """Decode a tensor map into an ndarray without copying its bytes.

    Inline tensors view their ``data``; framed ones view ``body`` at ``offset``. The array is
    writable exactly when the underlying buffer is (``bytearray`` yes, ``bytes`` no).
    """
    if type(obj) is dict and body is not None:
        fast = framed_view(obj, body)
        if fast is not None:
            return fast
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise WireError("expected a tensor map {dtype, shape, data}", code="bad_tensor")
    dtype = parse_dtype(obj.get("dtype"))
    shape = parse_shape(obj.get("shape"), dtype.itemsize)
    count = 1
    for d in shape:
        count *= d
    nbytes = count * dtype.itemsize
    if "data" in obj:
        data = obj["data"]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError("tensor 'data' must be msgpack bin", code="bad_tensor")
        if buffer_size(data) != nbytes:
            raise WireError(
                f"tensor of dtype {dtype.str} and shape {list(shape)} needs {nbytes} bytes, "
                f"got {buffer_size(data)}",
                code="bad_tensor",
            )
        return np.frombuffer(data, dtype=dtype, count=count).reshape(shape)
    offset, declared = obj.get("offset"), obj.get("nbytes")
    if body is None or not _is_int(offset) or not _is_int(declared):
        raise WireError(
            "tensor needs 'data', or 'offset' and 'nbytes' in a framed body", code="bad_tensor"
        )
    if declared != nbytes:
        raise WireError(
            f"tensor of dtype {dtype.str} and shape {list(shape)} needs {nbytes} bytes, "
            f"header says {declared}",
            code="bad_tensor",
        )
    size = buffer_size(body)
    if offset < 0 or offset + nbytes > size:
        raise WireError(
            f"tensor bytes [{offset}, {offset + nbytes}) lie outside the body of {size} bytes",
            code="bad_tensor",
        )
    if offset % ALIGN:
        raise WireError(
            f"tensor offset {offset} is not a multiple of {ALIGN}: a framed body "
            f"starts every tensor at a multiple of {ALIGN}",
            code="bad_tensor",
        )
    return np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)


def framed_view(obj: dict[Any, Any], body: Buffer) -> np.ndarray | None:
    """:func:`decode_tensor` for the common framed tensor (known dtype, positive dimensions, in
    bounds) with as little Python as possible; ``None`` for anything else, which the general
    path then decodes or refuses with the right message."""
    text, shape, offset = obj.get("dtype"), obj.get("shape"), obj.get("offset")
    if type(text) is not str or type(shape) is not list or type(offset) is not int:
        return None
    dtype = PARSED.get(text)
    if dtype is None or len(shape) > MAX_NDIM or "data" in obj:
        return None
    count = 1
    for d in shape:
        if type(d) is not int or d <= 0:
            return None
        count *= d
    nbytes = count * dtype.itemsize
    declared = obj.get("nbytes")
    if (
        type(declared) is not int
        or declared != nbytes
        or nbytes > MAX_ARRAY_BYTES
        or offset < 0
        or offset + nbytes > buffer_size(body)
        or offset % ALIGN
    ):
        return None
    view = np.frombuffer(body, dtype, count, offset)
    return view if len(shape) == 1 else view.reshape(shape)


#: dtype -> its type string, for the dtypes already found sendable (at most the 11 kinds of
#: DTYPES in each byte order).
SENDABLE: dict[np.dtype, str] = {}


def dtype_str(dtype: np.dtype) -> str:
    text = SENDABLE.get(dtype)
    if text is None:
        if dtype.name == "bfloat16" and dtype == _bfloat16():
            SENDABLE[dtype] = BFLOAT16
            return BFLOAT16
        if dtype.kind not in "fiu":
            raise WireError(
                f"cannot send arrays of dtype {dtype}: use a float or int dtype", code="bad_tensor"
            )
        text = parse_dtype(dtype.str).str  # raises for e.g. float128
        SENDABLE[dtype] = text
    return text
