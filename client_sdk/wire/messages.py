"""A message's body: encoded (one msgpack map, or framed), unpacked, its tensor fields decoded.

Two body encodings, told apart by ``Content-Type``:

* ``application/msgpack`` (:data:`~client_sdk.wire.constants.MSGPACK`): the whole body is one
  msgpack map; tensors inline.
* ``application/x-paramshard-frame`` (:data:`~client_sdk.wire.constants.FRAME`): ``b"PSF1"``, a
  little-endian uint32 header length ``H``, ``H`` bytes of msgpack header, then the tensors' raw
  bytes, each starting at a body offset that is a multiple of
  :data:`~client_sdk.wire.constants.ALIGN`. Tensors in the header carry ``offset`` and
  ``nbytes`` instead of ``data``. Big tensors never pass through msgpack, so neither side copies
  them into or out of a msgpack buffer; the receiver takes views at the offsets.

:func:`encode` makes either, as :class:`Encoded` (the buffers to write, never joined);
:func:`unpack` decodes a body's message, within the limits a shard sets on requests;
:func:`tensors_of` decodes a verb's ``{name: tensor}`` field; :func:`check_end` holds a framed
body to end where its last tensor ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import numpy as np

from .constants import (
    ALIGN,
    COUNT_FROM,
    FRAME,
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_THRESHOLD,
    MSGPACK,
    OBJECTS_PER_NAME,
)
from .errors import WireError
from .tensors import SENDABLE, Buffer, buffer_size, decode_tensor, dtype_str

__all__ = [
    "PADS",
    "Encoded",
    "align",
    "check_end",
    "encode",
    "header_end",
    "tensors_of",
    "unpack",
]


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
                    "dtype": SENDABLE.get(v.dtype) or dtype_str(v.dtype),
                    "shape": list(v.shape),
                }
                found.append((desc, v if v.flags.c_contiguous else v.copy(order="C")))
            else:
                out[k] = _collect(v, found)
        return out
    if kind is str or kind is int or kind is float or obj is None or kind is bool:
        return obj
    if isinstance(obj, np.ndarray):
        desc = {"dtype": dtype_str(obj.dtype), "shape": list(obj.shape)}
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
PADS = tuple(bytes(n) for n in range(ALIGN))


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
            d["data"] = _raw(a) if a.nbytes else b""
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
    pos = align(FRAME_PREFIX.size + len(head))
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
            append(_raw(a))
        at = offset + size
    return Encoded(FRAME, chunks, at)


def _raw(a: np.ndarray) -> memoryview:
    """The bytes of C-contiguous ``a``, uncopied. ml_dtypes' bfloat16 has no buffer format
    of its own: its bytes are read through a view as ``uint16``."""
    if a.dtype.kind == "V":
        a = a.view(np.uint16)
    return a.data.cast("B")


def align(n: int) -> int:
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
        size = buffer_size(body)
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
        if buffer_size(buf) > COUNT_FROM:
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
    size = buffer_size(body)
    if size != end:
        raise WireError(
            f"framed body of {size} bytes goes on {size - end} bytes past the end "
            f"of its last tensor (byte {end}; without tensors, of its header): a "
            "framed body ends where its last tensor ends",
            details={"bytes": size, "end": end},
        )
