"""The wire format both sides share: msgpack messages, tensors, error payloads.

This module imports msgpack and numpy only. docs/PROTOCOL.md is the prose form of it,
written so a client in another language can be built from that page alone.

A message is a msgpack map. A tensor inside a message is a map::

    {"dtype": "<f4", "shape": [2, 3], "data": <bin>}            # inline
    {"dtype": "<f4", "shape": [2, 3], "offset": 128, "nbytes": 24}  # framed

``dtype`` is a numpy array-interface type string (byte order + kind + item size), restricted to
:data:`DTYPES`. Decoding is one ``np.frombuffer`` over the received bytes: no per-element work,
and never pickle.

Two body encodings, told apart by ``Content-Type``:

* ``application/msgpack`` (:data:`MSGPACK`): the whole body is one msgpack map; tensors inline.
* ``application/x-paramshard-frame`` (:data:`FRAME`): ``b"PSF1"``, a little-endian uint32 header
  length ``H``, ``H`` bytes of msgpack header, then the tensors' raw bytes, each starting at a
  body offset that is a multiple of :data:`ALIGN`. Tensors in the header carry ``offset`` and
  ``nbytes`` instead of ``data``. Big tensors never pass through msgpack, so neither side copies
  them into or out of a msgpack buffer; the receiver takes views at the offsets.

Which fields of a message are tensors is fixed by each verb's schema (docs/PROTOCOL.md); the
decoder is told, it does not guess.

A framed body may also carry many tensors as one *tensor table* (:func:`encode_table`,
:func:`table_rows`): a map of parallel lists (``names``, ``dtype``, ``shape``, ``offset`` and
whatever columns the verb adds, e.g. ``versions``), one row per tensor, instead of one map per
tensor. It says the same thing in a fraction of the msgpack: a pull of many small variables
packs and unpacks several times faster this way, and that is most of what such a pull costs.
"""

from __future__ import annotations

import itertools
import math
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeGuard

import msgpack
import numpy as np

__all__ = [
    "ALIGN",
    "DTYPES",
    "ENV_PREFIX",
    "ENV_SHARDS",
    "ENV_TOKEN",
    "ENV_WORKER_ID",
    "ERROR_STATUS",
    "FEATURE_COUNTER_KIND",
    "FEATURE_PACKED",
    "FEATURE_POLL",
    "FEATURE_TABLES",
    "FRAME",
    "FRAME_MAGIC",
    "FRAME_PREFIX",
    "FRAME_THRESHOLD",
    "HEADER_FLEET",
    "HEADER_INCARNATION",
    "HEADER_PROTOCOL",
    "HEADER_SHARD",
    "HEADER_STATE_VERSION",
    "JSON",
    "MAX_REQUEST_NAMES",
    "MSGPACK",
    "PROTOCOL_VERSION",
    "Encoded",
    "WireError",
    "check_end",
    "decode_tensor",
    "encode",
    "encode_table",
    "error_payload",
    "framed_view",
    "header_end",
    "is_tensor",
    "parse_dtype",
    "table_rows",
    "unpack",
]

PROTOCOL_VERSION = 1

MSGPACK = "application/msgpack"
FRAME = "application/x-paramshard-frame"
JSON = "application/json"

#: Every response carries these, so a client can tell which shard answered and whether it restarted.
HEADER_SHARD = "x-paramshard-shard"  # "<index>/<num_shards>"
HEADER_INCARNATION = "x-paramshard-incarnation"
HEADER_PROTOCOL = "x-paramshard-protocol"
#: The shard's state version (sum of its variables' versions), once it has restored its state.
HEADER_STATE_VERSION = "x-paramshard-state-version"
#: A data-plane request names the shard it is meant for, ``"<index>/<num_shards>"``; a shard
#: that is not that one answers 421 ``fleet_mismatch``.
HEADER_FLEET = "x-paramshard-fleet"

#: Every environment variable paramshard reads starts with this: the SDK's three below, and a
#: shard's settings (``PARAMSHARD_`` and the flag's name, see ``paramshard serve --help``).
ENV_PREFIX = "PARAMSHARD_"
#: The fleet's shard URLs, comma-separated, in shard-index order (the SDK, ``paramshard status``).
ENV_SHARDS = ENV_PREFIX + "SHARDS"
#: The worker's id (the SDK).
ENV_WORKER_ID = ENV_PREFIX + "WORKER_ID"
#: The bearer token the SDK sends.
ENV_TOKEN = ENV_PREFIX + "TOKEN"

#: What a shard lists in ``/v1/cluster`` ``features`` when its verbs take tensor tables in
#: requests (push ``grads``); every shard that lists it also answers pulls in tables.
FEATURE_TABLES = "tables"
#: A shard's verbs take request tables with a ``uniform`` map, packed or not (§2).
FEATURE_PACKED = "packed"
#: A shard's increment takes ``kind`` (``"int"`` or ``"float"``), the counter's kind stated
#: instead of read from the msgpack type of ``delta``.
FEATURE_COUNTER_KIND = "counter_kind"
#: A shard has ``POST /v1/poll``: a pull that waits for newer versions (§3).
FEATURE_POLL = "poll"

FRAME_MAGIC = b"PSF1"
#: A framed body's prefix: :data:`FRAME_MAGIC` and the header's length, a little-endian uint32.
FRAME_PREFIX = struct.Struct("<4sI")
ALIGN = 64
#: Messages whose tensors hold at least this many bytes in all are framed by default.
FRAME_THRESHOLD = 64 * 1024

#: The dtypes a tensor may have on the wire (byte order is free; ``|`` for one-byte types).
DTYPES = frozenset({"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"})
_DTYPE_RE = re.compile(r"([<>|])([fiu])([1248])")
MAX_NDIM = 32
#: The most entries one request may hold in any one list or map (names, variables, gradients,
#: a table's rows) that a shard takes by default (``--max-request-names``): past it, 413
#: ``too_large``. The Python SDK splits bigger batches into requests of at most this many.
MAX_REQUEST_NAMES = 2048
#: A message of more bytes than this (a msgpack body, or a framed body's header) is decoded
#: counting its lists, maps and their entries, at most :data:`OBJECTS_PER_NAME` per allowed
#: name: a body of nothing but empty maps would otherwise decode to ~64 bytes of memory per
#: byte.
COUNT_FROM = 1 << 20
OBJECTS_PER_NAME = 8
#: numpy refuses shapes whose byte size (zero dimensions left out) does not fit in an intp.
_MAX_ARRAY_BYTES = np.iinfo(np.intp).max

#: The machine code of an error payload and the HTTP status it travels with.
ERROR_STATUS = {
    "bad_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "seq_expired": 409,
    "no_data_dir": 409,
    "too_large": 413,
    "unsupported_media_type": 415,
    "not_owner": 421,
    "fleet_mismatch": 421,
    "bad_tensor": 422,
    "overloaded": 429,
    "internal": 500,
    "unavailable": 503,
}

Buffer = bytes | bytearray | memoryview


class WireError(ValueError):
    """A message or tensor that does not follow the protocol.

    ``code`` is one of :data:`ERROR_STATUS`' keys (``bad_request`` or ``bad_tensor``), so a
    server can answer with it directly.
    """

    def __init__(self, message: str, code: str = "bad_request", details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.details = details if details is not None else {}


def error_payload(
    code: str, message: str, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The body of every error response: ``{"error": {"code", "message", "details"}}``."""
    return {"error": {"code": code, "message": message, "details": dict(details or {})}}


#: Type strings already parsed (only valid ones: at most the 11 kinds in each byte order).
_PARSED: dict[str, np.dtype] = {}
#: The ones of them in this machine's byte order.
_PARSED_NATIVE: dict[str, np.dtype] = {}


def parse_dtype(text: Any) -> np.dtype:
    """``"<f4"`` -> ``np.dtype``; anything off the allow-list raises :class:`WireError`."""
    if type(text) is str:
        known = _PARSED.get(text)
        if known is not None:
            return known
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
    _PARSED[text] = dtype
    if dtype.isnative:
        _PARSED_NATIVE[text] = dtype
    return dtype


def is_tensor(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "dtype" in obj and "shape" in obj


def _parse_shape(shape: Any, itemsize: int) -> tuple[int, ...]:
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
        if span > _MAX_ARRAY_BYTES:
            raise WireError(
                f"tensor shape {shape!r} is too large for an array on this machine",
                code="bad_tensor",
            )
        out.append(d)
    return tuple(out)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _buffer_size(buf: Buffer) -> int:
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
    shape = _parse_shape(obj.get("shape"), dtype.itemsize)
    count = 1
    for d in shape:
        count *= d
    nbytes = count * dtype.itemsize
    if "data" in obj:
        data = obj["data"]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError("tensor 'data' must be msgpack bin", code="bad_tensor")
        if _buffer_size(data) != nbytes:
            raise WireError(
                f"tensor of dtype {dtype.str} and shape {list(shape)} needs {nbytes} bytes, "
                f"got {_buffer_size(data)}",
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
    size = _buffer_size(body)
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
    dtype = _PARSED.get(text)
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
        or nbytes > _MAX_ARRAY_BYTES
        or offset < 0
        or offset + nbytes > _buffer_size(body)
        or offset % ALIGN
    ):
        return None
    view = np.frombuffer(body, dtype, count, offset)
    return view if len(shape) == 1 else view.reshape(shape)


class Encoded:
    """An encoded body: its content type and the buffers to write, in order, without joining.

    ``chunks`` holds the msgpack header and, for a framed body, padding and memoryviews of the
    arrays' own memory; :meth:`join` makes one ``bytes`` when a caller needs it.
    """

    __slots__ = ("content_type", "chunks", "nbytes")

    def __init__(self, content_type: str, chunks: list[Buffer], nbytes: int) -> None:
        self.content_type = content_type
        self.chunks = chunks
        self.nbytes = nbytes

    def join(self) -> bytes:
        if len(self.chunks) == 1 and isinstance(self.chunks[0], bytes):
            return self.chunks[0]
        return b"".join(self.chunks)

    def __iter__(self) -> Iterator[Buffer]:
        return iter(self.chunks)


#: dtype -> its type string, for the dtypes already found sendable (at most the 11 kinds of
#: DTYPES in each byte order).
_SENDABLE: dict[np.dtype, str] = {}


def _dtype_str(dtype: np.dtype) -> str:
    text = _SENDABLE.get(dtype)
    if text is None:
        if dtype.kind not in "fiu":
            raise WireError(
                f"cannot send arrays of dtype {dtype}: use a float or int dtype", code="bad_tensor"
            )
        text = parse_dtype(dtype.str).str  # raises for e.g. float128
        _SENDABLE[dtype] = text
    return text


def _collect(obj: Any, found: list[tuple[dict[str, Any], np.ndarray]]) -> Any:
    """``obj`` with its containers copied and each ndarray replaced by a new descriptor map
    ``{"dtype", "shape"}``, appended to ``found`` with the (C-contiguous) array."""
    kind = type(obj)
    if kind is dict:
        out = {}
        for k, v in obj.items():
            kind = type(v)
            if kind is int or kind is str or kind is float or v is None:
                out[k] = v
            elif kind is np.ndarray:  # inline: pull replies hold one per variable
                desc = out[k] = {
                    "dtype": _SENDABLE.get(v.dtype) or _dtype_str(v.dtype),
                    "shape": list(v.shape),
                }
                found.append((desc, v if v.flags.c_contiguous else v.copy(order="C")))
            else:
                out[k] = _collect(v, found)
        return out
    if kind is str or kind is int or kind is float or obj is None or kind is bool:
        return obj
    if isinstance(obj, np.ndarray):
        desc = {"dtype": _dtype_str(obj.dtype), "shape": list(obj.shape)}
        # not np.ascontiguousarray: it turns 0-d arrays into 1-d ones
        found.append((desc, obj if obj.flags.c_contiguous else obj.copy(order="C")))
        return desc
    if isinstance(obj, Mapping):
        return {k: _collect(v, found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_collect(v, found) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


_PADDING = bytes(ALIGN)
#: Zero padding of each length below ALIGN, made once (a slice of _PADDING is a new object).
_PADS = tuple(bytes(n) for n in range(ALIGN))


def _scalar(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message declared without tensors")


def encode(msg: Any, frame: bool | None = None, *, tensors: bool = True) -> Encoded:
    """Encode a message whose ndarrays (anywhere in it) become tensors.

    ``frame=None`` frames the body when its tensors hold :data:`FRAME_THRESHOLD` bytes or more.
    One walk over the message; the arrays' bytes are never copied (but for a non-contiguous
    array, which is made contiguous first). ``tensors=False`` promises a message without
    arrays (numpy scalars are fine): it is packed as it is, without the walk.
    """
    if not tensors:
        body = msgpack.packb(msg, use_bin_type=True, default=_scalar)
        return Encoded(MSGPACK, [body], len(body))
    found: list[tuple[dict[str, Any], np.ndarray]] = []
    header_obj = _collect(msg, found)
    if frame is None:
        frame = sum(a.nbytes for _, a in found) >= FRAME_THRESHOLD
    if not frame:
        for d, a in found:
            d["data"] = a.data.cast("B") if a.nbytes else b""
        body = msgpack.packb(header_obj, use_bin_type=True)
        return Encoded(MSGPACK, [body], len(body))

    # Offsets depend on the header's length, which depends on how wide the offsets encode.
    # Lay out with the widest placeholder (msgpack uint64, 9 bytes): the real header can only be
    # shorter, so the offsets computed from the placeholder stay past its end.
    widest = (1 << 64) - 1
    for d, a in found:
        d["offset"] = widest
        d["nbytes"] = a.nbytes
    head = msgpack.packb(header_obj, use_bin_type=True)
    pos = _align(FRAME_PREFIX.size + len(head))
    for d, a in found:
        d["offset"] = pos
        pos = (pos + a.nbytes + ALIGN - 1) // ALIGN * ALIGN
    head = msgpack.packb(header_obj, use_bin_type=True)
    chunks: list[Buffer] = [FRAME_PREFIX.pack(FRAME_MAGIC, len(head)), head]
    append = chunks.append
    at = FRAME_PREFIX.size + len(head)
    for d, a in found:
        offset = d["offset"]
        if offset > at:
            append(_PADDING[: offset - at] if offset - at <= ALIGN else bytes(offset - at))
        size = d["nbytes"]
        if size:
            append(a.data.cast("B"))
        at = offset + size
    return Encoded(FRAME, chunks, at)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def unpack(
    body: Buffer, content_type: str | None, max_entries: int | None = None
) -> dict[Any, Any]:
    """Decode a body's message, a map (tensors still as maps: pass them to
    :func:`decode_tensor` together with ``body``).

    Raises :class:`WireError`: ``bad_request`` for a body that is not what its type says or
    whose message is not a map, ``unsupported_media_type`` for any other content type, and
    with ``max_entries`` (a shard decoding a request), ``too_large`` for a message with a list
    or map of more entries, or a big one (:data:`COUNT_FROM`) of more than
    :data:`OBJECTS_PER_NAME` times as many lists, maps and entries in all.
    """
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == MSGPACK:
        return _unpack_map(body, "body", max_entries)
    if kind == FRAME:
        size = _buffer_size(body)
        if size < FRAME_PREFIX.size:
            raise WireError("framed body shorter than its 8-byte prefix")
        magic, hlen = FRAME_PREFIX.unpack_from(body, 0)
        if magic != FRAME_MAGIC:
            raise WireError(f"framed body must start with {FRAME_MAGIC!r}")
        if FRAME_PREFIX.size + hlen > size:
            raise WireError("framed body shorter than its declared header")
        return _unpack_map(
            memoryview(body).cast("B")[FRAME_PREFIX.size : FRAME_PREFIX.size + hlen],
            "framed header",
            max_entries,
        )
    raise WireError(
        f"unsupported content type {content_type!r}: send {MSGPACK} or {FRAME}",
        code="unsupported_media_type",
    )


class _TooMany(Exception):
    pass


def _unpack_map(buf: Buffer, what: str, max_entries: int | None = None) -> dict[Any, Any]:
    limits: dict[str, Any] = {}
    if max_entries is not None:
        limits = {"max_array_len": max_entries, "max_map_len": max_entries}
        if _buffer_size(buf) > COUNT_FROM:
            left = [OBJECTS_PER_NAME * max_entries]

            def count(obj: Any) -> Any:
                left[0] -= len(obj) + 1
                if left[0] < 0:
                    raise _TooMany
                return obj

            limits["object_hook"] = limits["list_hook"] = count
    try:
        msg = msgpack.unpackb(buf, raw=False, strict_map_key=False, **limits)
    except Exception as exc:  # msgpack raises several unrelated types
        if max_entries is not None and (
            isinstance(exc, _TooMany)
            or (
                f"max_array_len({max_entries})" in str(exc)
                or f"max_map_len({max_entries})" in str(exc)
            )
        ):
            raise WireError(
                f"{what} holds a list or map of more than {max_entries} entries, or more than "
                f"{OBJECTS_PER_NAME * max_entries} lists, maps and entries in all: a request "
                f"may name at most {max_entries} variables (this shard's "
                "--max-request-names); split it into smaller requests",
                code="too_large",
                details={"limit": max_entries},
            ) from None
        raise WireError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(msg, dict):
        raise WireError(f"{what} must be one msgpack map, got {type(msg).__name__}")
    return msg


def tensors_of(
    value: Any, body: Buffer | None, what: str, *, whole: bool = False
) -> dict[str, np.ndarray]:
    """Decode a ``{name: tensor}`` map (a verb's tensor field) into ``{name: ndarray}``.

    With ``whole=True`` and a framed ``body``, these are all the body's tensors (a shard
    decoding a request): every framed tensor must start after the header, and the body must
    end where the last one ends (:func:`check_end`).
    """
    if not isinstance(value, Mapping):
        raise WireError(f"'{what}' must be a map of name -> tensor")
    out = {}
    start = end = header_end(body) if whole and body is not None else -1
    for name, t in value.items():
        if not isinstance(name, str):
            raise WireError(f"'{what}' keys must be variable names (strings)")
        try:
            out[name] = decode_tensor(t, body)
            if start >= 0:
                offset = t.get("offset")
                if offset is not None and "data" not in t:  # framed: offset, nbytes checked
                    if offset < start:
                        raise WireError(
                            f"tensor offset {offset} lies in the header, which "
                            f"ends at byte {start}",
                            code="bad_tensor",
                        )
                    offset += t["nbytes"]
                    if offset > end:
                        end = offset
        except WireError as exc:
            exc.details = {"variable": name, **exc.details}
            exc.message = f"{name}: {exc.message}"
            exc.args = (exc.message,)
            raise
    if start >= 0 and body is not None:
        check_end(body, end)
    return out


def header_end(body: Buffer) -> int:
    """Where the header of a framed ``body`` (already :func:`unpack`-ed) ends: ``8 + H``."""
    return FRAME_PREFIX.size + int(FRAME_PREFIX.unpack_from(body, 0)[1])


def check_end(body: Buffer, end: int) -> None:
    """:class:`WireError` (``bad_request``) unless the framed ``body`` ends at ``end``, where
    its last tensor ends (its header, without tensors): the protocol leaves no bytes after it,
    so a body with more is not what its sender meant (e.g. a tensor left out of the header)."""
    size = _buffer_size(body)
    if size != end:
        raise WireError(
            f"framed body of {size} bytes goes on {size - end} bytes past the end "
            f"of its last tensor (byte {end}; without tensors, of its header): a "
            "framed body ends where its last tensor ends",
            details={"bytes": size, "end": end},
        )


# -- tensor tables ---------------------------------------------------------------------------


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
                dtypes.append(_SENDABLE.get(a.dtype) or _dtype_str(a.dtype))
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
    pads = _PADS
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
    size = _buffer_size(body)
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
            end = _align(start) + block.strides[0] * (n - 1) + block.nbytes // n
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
        dims = _parse_shape(uniform.get("shape"), dtype.itemsize)
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
        end = _align(at) if n else at
    else:
        strided = _strided_rows(dtype, dims, n, body, at, size, packed)
        if strided is None:
            raise WireError(
                f"{what}: {n} tensors of {dtype.itemsize * math.prod(dims)} bytes "
                f"each run past the end of the body ({size} bytes)",
                code="bad_tensor",
            )
        block = strided
        end = _align(at) + strided.strides[0] * (n - 1) + strided.nbytes // n if n else at
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
    dtype = _PARSED_NATIVE.get(text)
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
            dtype = _PARSED_NATIVE[text]
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
        dims = _parse_shape(shape, dtype.itemsize)
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
