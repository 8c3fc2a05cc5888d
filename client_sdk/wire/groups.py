"""A step group's bodies: one flat tensor of a group's values (or gradients), the versions as
one int64 tensor (docs/PROTOCOL.md, Step groups).

Both a group pull's reply and a group push's request are framed bodies whose header holds, next
to the verb's fields, ``versions`` (int64, one per variable, in the group's order; optional in
a push) and one flat tensor (``values`` or ``grads``): the variables' bytes back to back in the
group's order, no padding between them. The sender writes each variable's own memory as a
piece of that tensor (:func:`encode`); nothing is joined. The versions come first, the flat
tensor last, so a receiver can read the header and the versions, then the rest of the body
straight into one buffer of the group's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .constants import ALIGN, FRAME, FRAME_MAGIC, FRAME_PREFIX
from .errors import WireError
from .messages import PADS, Encoded, align
from .tensors import Buffer, decode_tensor

__all__ = ["VERSIONS_DTYPE", "encode", "flat_tensor", "read_versions"]

#: The versions' type string on the wire.
VERSIONS_DTYPE = "<i8"
_VERSIONS = np.dtype(VERSIONS_DTYPE)


def encode(
    msg: dict[str, Any],
    versions: np.ndarray | None,
    key: str,
    dtype: str,
    pieces: Sequence[Buffer],
    nbytes: int,
) -> Encoded:
    """A framed body: ``msg``'s fields, ``versions`` (int64, native order: sent as
    little-endian, or left out when ``None``) and the tensor ``key`` of ``dtype`` whose
    ``nbytes`` bytes are ``pieces`` back to back (each C-contiguous memory: ndarrays,
    memoryviews)."""
    itemsize = np.dtype(dtype).itemsize
    header = dict(msg)
    widest = (1 << 64) - 1  # as wire.encode: lay out with the widest offsets first
    if versions is not None:
        versions = np.ascontiguousarray(versions, _VERSIONS)
        header["versions"] = {
            "dtype": VERSIONS_DTYPE,
            "shape": [len(versions)],
            "offset": widest,
            "nbytes": versions.nbytes,
        }
    header[key] = {
        "dtype": dtype,
        "shape": [nbytes // itemsize],
        "offset": widest,
        "nbytes": nbytes,
    }
    head = msgpack.packb(header, use_bin_type=True)
    pos = align(FRAME_PREFIX.size + len(head))
    if versions is not None:
        header["versions"]["offset"] = pos
        pos = align(pos + versions.nbytes)
    header[key]["offset"] = pos
    head = msgpack.packb(header, use_bin_type=True)
    at = FRAME_PREFIX.size + len(head)
    chunks: list[Buffer] = [FRAME_PREFIX.pack(FRAME_MAGIC, len(head)), head]
    if versions is not None:
        start = header["versions"]["offset"]
        chunks.append(_pad(start - at))
        chunks.append(versions.data.cast("B"))
        at = start + versions.nbytes
    start = header[key]["offset"]
    if start > at:
        chunks.append(_pad(start - at))
    chunks.extend(pieces)
    return Encoded(FRAME, chunks, start + nbytes)


def _pad(n: int) -> bytes:
    return PADS[n] if n < ALIGN else bytes(n)


def flat_tensor(
    header: Any, key: str, dtype: np.dtype, count: int, start: int, size: int
) -> tuple[int, int]:
    """Where the flat tensor ``key`` of a group body lies: ``(offset, nbytes)``, checked to be
    ``count`` elements of ``dtype``, after the header (which ends at ``start``) and ending the
    body of ``size`` bytes; :class:`WireError` otherwise."""
    t = header.get(key) if isinstance(header, dict) else None
    if not isinstance(t, dict):
        raise WireError(f"a group body needs the tensor {key!r}", details={"field": key})
    offset, nbytes = t.get("offset"), t.get("nbytes")
    if (
        t.get("dtype") != dtype.str
        or t.get("shape") != [count]
        or type(offset) is not int
        or type(nbytes) is not int
        or nbytes != count * dtype.itemsize
        or offset < start
        or offset + nbytes != size
    ):
        raise WireError(
            f"the group body's {key!r} must be {count} elements of {dtype.str} ending the body, "
            f"got { ({k: t.get(k) for k in ('dtype', 'shape', 'offset', 'nbytes')}) }",
            code="bad_tensor",
            details={"field": key},
        )
    return offset, nbytes


def read_versions(header: Any, body: Buffer, count: int) -> np.ndarray | None:
    """A group body's ``versions`` (``count`` int64, in native order), or ``None`` when it has
    none; :class:`WireError` for one of another length or type."""
    t = header.get("versions") if isinstance(header, dict) else None
    if t is None:
        return None
    versions = decode_tensor(t, body)
    if versions.dtype != _VERSIONS or versions.shape != (count,):
        raise WireError(
            f"the group body's 'versions' must be {count} int64, got {versions.dtype.str} "
            f"{list(versions.shape)}",
            details={"field": "versions"},
        )
    if (versions < 0).any():
        raise WireError("the group body's 'versions' must be >= 0", details={"field": "versions"})
    return versions
