"""Many tensors as one *tensor table* in a framed body: :func:`encode_table`, :func:`table_rows`.

A table is a map of parallel lists (``names``, ``dtype``, ``shape`` and whatever columns the
verb adds, e.g. ``versions``), one row per tensor, instead of one map per tensor; the rows'
bytes follow the header in row order, each at the next multiple of
:data:`~client_sdk.wire.constants.ALIGN`. It says the same thing in a fraction of the msgpack: a
pull of many small variables packs and unpacks several times faster this way, and that is most
of what such a pull costs. A table whose rows all have one dtype and shape may say so once
(``uniform``), its rows then packed one right after the other if it says ``packed``.

Decoding takes views of the body, no copy, with as little Python per row as the table allows
(one strided view for rows of one dtype and shape).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .constants import ALIGN, FRAME, FRAME_MAGIC, FRAME_PREFIX, MAX_NDIM
from .errors import WireError
from .messages import PADS, Encoded, align, check_end
from .tensors import (
    PARSED_NATIVE,
    SENDABLE,
    Buffer,
    buffer_size,
    decode_tensor,
    dtype_str,
    parse_dtype,
    parse_shape,
)

__all__ = ["Span", "encode_row", "encode_table", "table_rows", "table_spans"]

#: Where one row's tensor lies in a framed body: (offset, dtype, shape) (see :func:`table_spans`).
Span = tuple[int, np.dtype, tuple[int, ...]]


def encode_table(
    message: dict[str, Any],
    table: dict[str, Any],
    arrays: Sequence[np.ndarray | None],
    dtypes: list[str | None] | None = None,
    shapes: list[list[int] | None] | None = None,
    *,
    arrays_as_chunks: bool = False,
    uniform: bool = False,
    packed: bool = False,
    laid_out: Buffer | None = None,
) -> Encoded:
    """Frame ``message``, in which the map ``table`` (already holding its other columns, e.g.
    ``names``) gets the columns ``dtype`` and ``shape`` for ``arrays``, one row each; the
    arrays' bytes follow the header in row order, each at the next multiple of :data:`ALIGN`.

    A ``None`` in ``arrays`` is a row without a tensor (nil in both columns). Arrays must be
    C-contiguous and of a sendable dtype (a shard's values always are). ``dtypes`` and
    ``shapes``, when given, are those columns already made (type strings, shape lists), one
    entry per row (``None`` in rows without a tensor). Always framed; the arrays' bytes are
    not copied here (the chunks are memoryviews of them).

    With ``arrays_as_chunks`` the chunks are the arrays themselves, not byte memoryviews of
    them: for a writer that takes any buffer and never asks a chunk's ``len()`` (which for an
    array is not its size in bytes), such as a vectored write. A memoryview per row costs
    more than the rest of the row's work, and when every row is a tensor of one dtype and
    shape the chunk list is then made without any Python work per row.

    With ``uniform``, a table of two or more rows that all hold a tensor of one dtype and
    shape gets ``uniform`` (that dtype and shape, once) instead of the two columns: for a
    receiver that asked for it (a pull's ``"uniform": true``). With ``packed`` as well, such
    a table's rows follow one another with no padding between them (``"packed": true`` in the
    ``uniform`` map): one buffer per row for a vectored write instead of two, which is what a
    kernel's send costs most per.
    ``laid_out``, for a uniform table with ``arrays_as_chunks`` whose rows lie one right
    after another (packed, or of a size that is a multiple of :data:`ALIGN`), is the rows'
    bytes already so, in one buffer (a shard's values made together, side by side): then
    that buffer is the rows' one chunk, the cheapest send of all; otherwise unused.
    """
    if dtypes is None or shapes is None:
        dtypes, shapes = [], []
        for a in arrays:
            if a is None:
                dtypes.append(None)
                shapes.append(None)
            else:
                dtypes.append(SENDABLE.get(a.dtype) or dtype_str(a.dtype))
                shapes.append(list(a.shape))
    same = (uniform or arrays_as_chunks) and _one_dtype_and_shape(dtypes, shapes)
    if uniform and same:
        table["uniform"] = {"dtype": dtypes[0], "shape": shapes[0]}
        if packed:
            table["uniform"]["packed"] = True
    else:
        packed = False
        table["dtype"], table["shape"] = dtypes, shapes
    head = msgpack.packb(message, use_bin_type=True)
    at = FRAME_PREFIX.size + len(head)
    # Buffers, and with arrays_as_chunks the arrays themselves.
    chunks: list[Any] = [FRAME_PREFIX.pack(FRAME_MAGIC, len(head)), head]
    append = chunks.append
    pads = PADS
    n = len(arrays)
    if arrays_as_chunks and same:
        size = arrays[0].nbytes  # type: ignore[union-attr]  # same: no None row; every row: one dtype, one shape, so one size and stride
        if size:
            pad = -at % ALIGN
            if pad:
                append(pads[pad])
            gap = 0 if packed else -size % ALIGN
            if gap:  # each row after the first starts gap bytes after the end of the last
                rows: list[Any] = [pads[gap]] * (2 * n - 1)
                rows[0::2] = arrays
            elif getattr(laid_out, "nbytes", None) == n * size:  # rows side by side anyway
                rows = [laid_out]
            else:
                rows = list(arrays)
            chunks += rows
            return Encoded(FRAME, chunks, at + pad + n * size + (n - 1) * gap)
    for i, a in enumerate(arrays):
        if a is None:
            continue
        pad = -at % ALIGN if not (packed and i) else 0
        if pad:
            append(pads[pad])
            at += pad
        size = a.nbytes
        if size:
            append(a if arrays_as_chunks else a.data.cast("B"))
            at += size
    return Encoded(FRAME, chunks, at)


def encode_row(
    message: dict[str, Any],
    table: dict[str, Any],
    array: np.ndarray | None,
    dtype: str | None,
    shape: list[int] | None,
) -> Encoded:
    """:func:`encode_table` of one row, with ``arrays_as_chunks``: the same bytes, for the
    commonest table, without the columns' lists made first. ``dtype`` and ``shape`` are the
    row's (``None`` with ``array`` for a row without a tensor); one row is never ``uniform``
    (that needs two or more), so the table always gets both columns."""
    table["dtype"], table["shape"] = [dtype], [shape]
    head = msgpack.packb(message, use_bin_type=True)
    at = FRAME_PREFIX.size + len(head)
    chunks: list[Any] = [FRAME_PREFIX.pack(FRAME_MAGIC, len(head)), head]
    if array is not None:
        pad = -at % ALIGN
        if pad:
            chunks.append(PADS[pad])
        size = array.nbytes
        if size:
            chunks.append(array)
        at += pad + size
    return Encoded(FRAME, chunks, at)


def table_rows(
    table: Any,
    body: Buffer,
    what: str = "table",
    *,
    native: bool = False,
    names: list[str] | None = None,
    with_block: bool = False,
    whole: bool = False,
) -> tuple[Any, ...]:
    """Decode a tensor table of the framed ``body``: its names and, per row, the tensor (a
    view of ``body``, no copy) or ``None`` for a row without one. Other columns stay in
    ``table`` for the caller. With ``native=True`` a tensor in the other byte order is
    converted (a read-only copy in this machine's order) instead of viewed. ``names`` are the
    rows' names when the table has no ``names`` column (a pull reply may leave it out: its
    rows are the requested names, in order). A table may carry ``uniform`` (one dtype and
    shape for every row) in place of its ``dtype`` and ``shape`` columns.

    With ``with_block=True``, a third item: when there are two or more rows, all tensors of
    one dtype (in this machine's byte order) and one shape, the rows as one ``(rows, *shape)``
    view of ``body`` (the rows given are its rows), else ``None``. For work on all the rows
    at once, e.g. checking them for NaN in one pass (a row's ``base`` is not this view:
    numpy points it at the memory's owner).

    With ``whole=True`` the table's are all the body's tensors (a shard decoding a request):
    the body must end where the last row's tensor ends (:func:`check_end`).

    Raises :class:`WireError` (``bad_request`` for a malformed table, ``bad_tensor`` for a bad
    row, saying which).
    """
    if type(table) is not dict:
        raise WireError(f"'{what}' must be a map of columns")
    # Checked to be lists below unless the table is uniform.
    dtypes: Any = table.get("dtype")
    shapes: Any = table.get("shape")
    if "names" in table or names is None:
        names = table.get("names")
        if type(names) is not list or not all(type(n) is str for n in names):
            raise WireError(f"'{what}.names' must be a list of variable names")
    n = len(names)
    uniform = table.get("uniform")
    if uniform is None:
        for key, column in (("dtype", dtypes), ("shape", shapes)):
            if type(column) is not list or len(column) != n:
                raise WireError(f"'{what}.{key}' must be a list as long as '{what}.names' ({n})")
    elif type(uniform) is not dict or dtypes is not None or shapes is not None:
        raise WireError(
            f"'{what}.uniform' must be a map {{dtype, shape}}, in place of the "
            f"'dtype' and 'shape' columns"
        )
    size = buffer_size(body)
    if size < FRAME_PREFIX.size:
        raise WireError("a tensor table needs a framed body")
    start = FRAME_PREFIX.size + FRAME_PREFIX.unpack_from(body, 0)[1]
    if uniform is not None:
        same_rows, block, end = _uniform_rows(uniform, n, body, start, size, what, native)
        if whole:
            check_end(body, end)
        return (names, same_rows, block) if with_block else (names, same_rows)
    try:
        block = _uniform_block(dtypes, shapes, body, start, size)
        if block is not None:
            rows: list[np.ndarray | None] = list(block)
            end = align(start) + block.strides[0] * (n - 1) + block.nbytes // n
        else:
            rows, end = _fast_rows(dtypes, shapes, body, start, size)
        if whole:
            check_end(body, end)
        return (names, rows, block) if with_block else (names, rows)
    except (KeyError, TypeError, ValueError):
        pass  # a row off the common path: decode again, row by row, with the checks
    at = start
    out: list[np.ndarray | None] = []
    for name, text, shape in zip(names, dtypes, shapes):
        if text is None:
            if shape is not None:
                raise WireError(
                    f"{what} row {name!r}: a shape without a dtype",
                    code="bad_tensor",
                    details={"variable": name},
                )
            out.append(None)
            continue
        at = (at + ALIGN - 1) // ALIGN * ALIGN
        row = _table_row(name, text, shape, at, body, what)
        at += row.nbytes
        if native and not row.dtype.isnative:
            row = row.astype(row.dtype.newbyteorder("="))
            row.flags.writeable = False
        out.append(row)
    if whole:
        check_end(body, at)
    return (names, out, None) if with_block else (names, out)


def table_spans(
    table: Any, start: int, size: int, names: list[str] | None = None
) -> tuple[list[str], list[Span | None]]:
    """Where the rows of a tensor table lie in a framed body of ``size`` bytes whose header
    ends at ``start``, read from the table alone (the body need not have arrived): its names
    and, per row, ``(offset, dtype, shape)``, or ``None`` for a row without a tensor. The
    layout :func:`table_rows` reads, for a receiver that puts each row's bytes somewhere of
    its own as they arrive (``client_sdk._into``); ``names`` as there.

    Raises :class:`WireError` for a table :func:`table_rows` refuses: malformed, a bad dtype
    or shape, or tensors running past ``size``.
    """
    if type(table) is not dict:
        raise WireError("'table' must be a map of columns")
    if "names" in table or names is None:
        names = table.get("names")
        if type(names) is not list or not all(type(n) is str for n in names):
            raise WireError("'table.names' must be a list of variable names")
    n = len(names)
    uniform = table.get("uniform")
    spans: list[Span | None] = []
    at = start
    if uniform is not None:
        if type(uniform) is not dict or "dtype" in table or "shape" in table:
            raise WireError("'table.uniform' must be a map {dtype, shape}, in place of columns")
        dtype = parse_dtype(uniform.get("dtype"))
        dims = parse_shape(uniform.get("shape"), dtype.itemsize)
        packed = uniform.get("packed", False)
        if type(packed) is not bool:
            raise WireError(f"'packed' must be true or false (or absent), not {packed!r}")
        nbytes = dtype.itemsize * math.prod(dims)
        stride = nbytes if packed else align(nbytes)
        at = align(start)
        if n and nbytes and at + stride * (n - 1) + nbytes > size:
            raise WireError(f"{n} tensors run past the end of the body", code="bad_tensor")
        if not nbytes:
            stride = 0
        return names, [(at + i * stride, dtype, dims) for i in range(n)]
    dtypes: Any = table.get("dtype")  # checked to be lists next
    shapes: Any = table.get("shape")
    for key, column in (("dtype", dtypes), ("shape", shapes)):
        if type(column) is not list or len(column) != n:
            raise WireError(f"'table.{key}' must be a list as long as 'table.names' ({n})")
    for text, shape in zip(dtypes, shapes):
        if text is None:
            if shape is not None:
                raise WireError("a table row with a shape but no dtype", code="bad_tensor")
            spans.append(None)
            continue
        at = align(at)
        dtype = parse_dtype(text)
        dims = parse_shape(shape, dtype.itemsize)
        end = at + dtype.itemsize * math.prod(dims)
        if end > size:
            raise WireError("a tensor runs past the end of the body", code="bad_tensor")
        spans.append((at, dtype, dims))
        at = end
    return names, spans


def _uniform_rows(
    uniform: dict[Any, Any], n: int, body: Buffer, at: int, size: int, what: str, native: bool
) -> tuple[list[np.ndarray], np.ndarray | None, int]:
    """The ``n`` rows of a table whose tensors all have the dtype and shape of its ``uniform``
    map (padded to the next multiple of :data:`ALIGN`, or, with ``"packed": true``, one
    right after the other), the ``(n, *shape)`` view of the body they are the rows of, and
    where the last row ends in the body;
    :class:`WireError` (``bad_tensor``) for a bad dtype or shape or tensors running past the
    body's end."""
    try:
        dtype = parse_dtype(uniform.get("dtype"))
        dims = parse_shape(uniform.get("shape"), dtype.itemsize)
        packed = uniform.get("packed")
        if packed is None:
            packed = False
        elif type(packed) is not bool:
            raise WireError(
                f"'packed' must be true or false (or absent), not {packed!r}", code="bad_request"
            )
    except WireError as exc:
        exc.message = f"{what}.uniform: {exc.message}"
        exc.args = (exc.message,)
        raise
    if 0 in dims:  # tensors without bytes take no room in the body
        block = np.empty((n, *dims), dtype.newbyteorder("=") if native else dtype)
        block.flags.writeable = False
        end = align(at) if n else at
    else:
        strided = _strided_rows(dtype, dims, n, body, at, size, packed)
        if strided is None:
            raise WireError(
                f"{what}: {n} tensors of {dtype.itemsize * math.prod(dims)} bytes "
                f"each run past the end of the body ({size} bytes)",
                code="bad_tensor",
            )
        block = strided
        end = align(at) + strided.strides[0] * (n - 1) + strided.nbytes // n if n else at
        if native and not dtype.isnative:
            block = block.astype(dtype.newbyteorder("="))
            block.flags.writeable = False
    rows = list(block) if dims else [block[i, ...] for i in range(n)]  # 0-d arrays, not scalars
    return rows, (block if n > 1 and block.dtype.isnative else None), end


def _one_dtype_and_shape(dtypes: list[Any], shapes: list[Any]) -> bool:
    """Whether a table has two or more rows, all tensors of one dtype and one shape (equal
    entries of its columns, compared in C)."""
    n = len(dtypes)
    return (
        n > 1
        and dtypes[0] is not None
        and dtypes.count(dtypes[0]) == n
        and shapes.count(shapes[0]) == n
    )


def _uniform_block(
    dtypes: list[Any], shapes: list[Any], body: Buffer, at: int, size: int
) -> np.ndarray | None:
    """A table of two or more tensors that all have one dtype (already seen, in this
    machine's byte order) and one shape (ints > 0), lying in the body, as one strided view of
    it; ``None`` for any other table. Such rows sit at a fixed stride, so the view's rows are
    the tensors: no Python work per row (a step's many same-shaped variables, e.g. the layers
    of a stack)."""
    if not _one_dtype_and_shape(dtypes, shapes):
        return None
    n = len(dtypes)
    text, shape = dtypes[0], shapes[0]
    if type(text) is not str or type(shape) is not list or not 0 < len(shape) <= MAX_NDIM:
        return None
    dtype = PARSED_NATIVE.get(text)
    # Equal lists may still differ in their items' types (1 == 1.0 == True): ints only.
    if dtype is None or set(map(type, itertools.chain.from_iterable(shapes))) != {int}:
        return None
    if min(shape) <= 0:
        return None
    return _strided_rows(dtype, shape, n, body, at, size)


def _strided_rows(
    dtype: np.dtype,
    dims: Sequence[int],
    n: int,
    body: Buffer,
    at: int,
    size: int,
    packed: bool = False,
) -> np.ndarray | None:
    """``n`` tensors of ``dtype`` and ``dims`` (all > 0) laid out as a table lays them out
    from ``at`` on (each at the next multiple of :data:`ALIGN`, so at a fixed stride; or,
    ``packed``, the first there and each of the others right after the one before), as one
    ``(n, *dims)`` view of ``body``; ``None`` if they run past its ``size`` bytes."""
    strides = []
    span = dtype.itemsize
    for d in reversed(dims):
        strides.append(span)
        span *= d
    stride = span if packed else (span + ALIGN - 1) // ALIGN * ALIGN
    first = (at + ALIGN - 1) // ALIGN * ALIGN
    if n and first + stride * (n - 1) + span > size:
        return None
    strides.append(stride)
    view: np.ndarray = np.ndarray((n, *dims), dtype, body, first, strides[::-1])
    return view


def _fast_rows(
    dtypes: list[Any], shapes: list[Any], body: Buffer, at: int, size: int
) -> tuple[list[np.ndarray | None], int]:
    """The rows of a table whose tensors all have a dtype already seen in this machine's byte
    order and one positive dimension, and lie in the body, and where the last one ends;
    raises ``KeyError``, ``TypeError`` or ``ValueError`` for any other."""
    out: list[np.ndarray | None] = []
    append = out.append
    # Per dtype, one view of the whole body; each row is a slice of it (a slice costs about
    # half a frombuffer). Rows start at multiples of ALIGN, so at multiples of any itemsize.
    wholes: dict[str, tuple[np.ndarray, int]] = {}
    for text, shape in zip(dtypes, shapes):
        if text is None:
            if shape is not None:
                raise ValueError
            append(None)
            continue
        known = wholes.get(text)
        if known is None:
            dtype = PARSED_NATIVE[text]
            known = wholes[text] = (
                np.frombuffer(body, dtype, size // dtype.itemsize),
                dtype.itemsize,
            )
        whole, itemsize = known
        if type(shape) is not list:
            raise TypeError
        (count,) = shape
        if type(count) is not int or count <= 0:
            raise ValueError
        at = (at + ALIGN - 1) // ALIGN * ALIGN
        end = at + count * itemsize
        if end > size:
            raise ValueError
        append(whole[at // itemsize : end // itemsize])
        at = end
    return out, at


def _table_row(
    name: str, text: Any, shape: Any, offset: Any, body: Buffer, what: str
) -> np.ndarray:
    """One row of :func:`table_rows` the general way, with the error that says what is wrong."""
    try:
        dtype = parse_dtype(text)
        dims = parse_shape(shape, dtype.itemsize)
        count = 1
        for d in dims:
            count *= d
        return decode_tensor(
            {
                "dtype": text,
                "shape": list(dims),
                "offset": offset,
                "nbytes": count * dtype.itemsize,
            },
            body,
        )
    except WireError as exc:
        exc.details = {"variable": name, **exc.details}
        exc.message = f"{what} row {name!r}: {exc.message}"
        exc.args = (exc.message,)
        raise
