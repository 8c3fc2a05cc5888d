"""``pull(names, out={name: buffer})``: pulled values written into the caller's own memory.

:func:`targets` checks the buffers before anything is sent: each names a variable being
pulled, and is viewed as a writable ndarray without a copy (an ndarray, an object with the
buffer protocol or ``__array_interface__``, or a DLPack tensor in host memory such as a torch
CPU tensor); its shape and dtype must be the variable's as far as this client knows it (from
its init or last pull; a partitioned variable's whole shape). Once the pull's replies are in,
:func:`check` compares every value with its buffer again (a variable made again with another
shape since) before :func:`write` writes any of them.

Over the SDK's own connections a reply is received straight into the buffers: each shard's
pull request carries a :class:`Sink` of the buffers its names have, and once the reply's
header is in (the framed body's msgpack header, docs/PROTOCOL.md) the sink lays the body out
(:func:`client_sdk.wire.table_spans`): a row of at least :data:`DIRECT_BYTES` whose buffer
has its dtype and shape and is C-contiguous is received into the buffer itself; everything
else (the smaller rows, those of a narrowed ``wire_dtype``, the padding) into one buffer of
its own, as it lies in the body. Nothing of the value is copied but by the kernel, into the
buffer. A reply the sink does not lay out so (not a table, a row of another dtype or shape
than its buffer, anything malformed) is received whole as usual, and the pull decodes and
checks it as it does any reply. The rest, and replies through an injected transport, are
written by :func:`write`: one ``np.copyto`` per variable (per part of a partitioned one,
straight into the buffer's rows), from the reply's receive buffer into the caller's.

A shard's reply with a value that does not fit its buffer is thus received whole, and the
check refuses it before that shard's buffers are written. Since values arrive straight into
the buffers, a pull that fails otherwise (a shard lost mid-reply, or one shard's value refused
while another shard's went in) may leave some buffers with this pull's values, or part of
them, and the others as they were; a pull that succeeds has written every one.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import numpy as np

from . import wire
from ._args import SENDABLE_DTYPES, host_view
from ._exceptions import BadRequestError, BadTensorError
from ._http.http11 import body_buffer
from .partitions import Layout
from .wire import halves

__all__ = ["DIRECT_BYTES", "Sink", "check", "same", "targets", "write"]

#: A row of a pull reply this big or bigger is received straight into its buffer; a smaller one
#: goes with the padding into the sink's own buffer and is copied (a receive per row would cost
#: more than the copy).
DIRECT_BYTES = 16 * 1024
#: Rows of a narrowed wire dtype are widened into float32: into their buffer, or a new array.
_WIDENED = np.dtype(np.float32)
#: Bytes of a narrowed row received at a time, then widened while they are in the cache.
STAGE = 256 * 1024

#: A pulled value as :func:`write` takes it: the whole array, or a partitioned variable's
#: parts with its layout (written into the buffer's rows, never put together first).
Value = np.ndarray | tuple[Layout, Sequence[np.ndarray]]


def targets(
    out: Any,
    names: Sequence[str],
    known: Mapping[str, tuple[tuple[int, ...], np.dtype]],
) -> dict[str, np.ndarray]:
    """``out`` as name -> writable ndarray viewing the caller's buffer, checked against the
    names pulled and the ``known`` shape and dtype of each (:class:`BadRequestError` or
    :class:`BadTensorError` naming the variable, before anything is sent)."""
    if not isinstance(out, Mapping):
        raise BadRequestError(
            f"pull(out=...) takes a dict of name -> array to write into, got {type(out).__name__}"
        )
    pulled = set(names)
    views = {}
    for name, buffer in out.items():
        if name not in pulled:
            raise BadRequestError(
                f"pull: out names {name!r}, which is not among the names pulled: pull it too, "
                "or leave it out of out",
                details={"variable": name},
            )
        view = _writable(name, buffer)
        layout = known.get(name)
        if layout is not None:
            _fits(name, layout[0], layout[1], view)
        views[name] = view
    return views


def _writable(name: str, buffer: Any) -> np.ndarray:
    """A writable ndarray over ``buffer``'s own memory; :class:`BadRequestError` otherwise."""
    if isinstance(buffer, np.ndarray):
        view = buffer
    elif hasattr(type(buffer), "__dlpack__"):
        view = host_view(name, buffer)
        if not view.flags.writeable and hasattr(buffer, "__array__"):
            view = np.asarray(buffer)  # numpy < 2 marks DLPack views read-only; torch's is not
    elif isinstance(buffer, (list, tuple, int, float, str, bytes)):
        view = None  # numpy would make a new array, which nobody would see written
    else:
        try:
            view = np.asarray(buffer)
        except (TypeError, ValueError):
            view = None
        if view is not None and view.base is None:
            view = None  # a new array, not a view of the caller's memory
    if view is None or not view.flags.writeable:
        kind = "read-only " if view is not None else ""
        raise BadRequestError(
            f"pull: out[{name!r}] is a {kind}{type(buffer).__name__}: pass a writable array to "
            "write the value into (an ndarray, a CPU torch tensor, any writable buffer)",
            details={"variable": name},
        )
    if view.dtype not in SENDABLE_DTYPES:
        raise BadTensorError(
            f"pull: out[{name!r}] has dtype {view.dtype}, which no variable has: give a buffer "
            "of the variable's own dtype",
            code="bad_tensor",
            details={"variable": name, "dtype": str(view.dtype)},
        )
    return view


def _fits(name: str, shape: tuple[int, ...], dtype: np.dtype, view: np.ndarray) -> None:
    if view.shape != tuple(shape) or view.dtype != dtype:
        raise BadTensorError(
            f"pull: out[{name!r}] is {view.dtype} {list(view.shape)}, but the variable is "
            f"{np.dtype(dtype)} {list(shape)}: give a buffer of the variable's shape and dtype "
            "(nothing was written)",
            code="bad_tensor",
            details={
                "variable": name,
                "shape": list(view.shape),
                "expected_shape": list(shape),
                "dtype": str(view.dtype),
                "expected_dtype": str(np.dtype(dtype)),
            },
        )


def check(views: Mapping[str, np.ndarray], got: Mapping[str, Value]) -> None:
    """Every pulled value fits its buffer (:class:`BadTensorError` for the first that does
    not); called before :func:`write` writes any."""
    for name, view in views.items():
        value = got.get(name)
        if value is None:
            continue  # a poll that found it unchanged: its buffer stays as it is
        if isinstance(value, tuple):
            layout = value[0]
            _fits(name, layout.shape, np.dtype(layout.dtype), view)
        else:
            _fits(name, value.shape, value.dtype, view)


def write(views: Mapping[str, np.ndarray], got: Mapping[str, Value]) -> dict[str, np.ndarray]:
    """Write each pulled value into its buffer (checked by :func:`check`); return the pull's
    result: each name's value, its buffer's view where it has one."""
    out: dict[str, np.ndarray] = {}
    for name, value in got.items():
        view = views.get(name)
        if isinstance(value, tuple):
            assert view is not None  # parts come back apart only for a name with a buffer
            layout, parts = value
            for rows, part in zip(layout.split(view), parts):
                if not same(rows, part):
                    np.copyto(rows, part)
            out[name] = view
        elif view is not None:
            if not same(view, value):
                np.copyto(view, value)
            out[name] = view
        else:
            out[name] = value
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is ``a``'s own memory seen alike (a value received into its buffer)."""
    return a is b or (
        a.ctypes.data == b.ctypes.data
        and a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
    )


class Sink:
    """Receives one shard's pull reply, its rows straight into the buffers ``views`` (name ->
    writable ndarray) where they fit (see the module). ``names`` are the request's (a reply's
    table may leave its names column out); ``narrowed`` says the pull asked for a
    ``wire_dtype``. After a reply it took apart, :attr:`rows` is the reply's rows as
    :func:`client_sdk.wire.table_rows` gives them (a row received into its buffer: the
    buffer's ndarray), else ``None``. One reply at a time."""

    __slots__ = ("views", "names", "narrowed", "rows")

    def __init__(self, views: dict[str, np.ndarray], names: list[str], narrowed: bool) -> None:
        self.views = views
        self.names = names
        self.narrowed = narrowed
        self.rows: tuple[list[str], list[np.ndarray | None]] | None = None

    def receive(self, got: memoryview, size: int) -> Generator[memoryview, int, wire.Buffer]:
        """See :class:`client_sdk._http.http11.Into`: the body is the framed header (prefix
        and msgpack map) when the rows went where :attr:`rows` says, else the whole body."""
        self.rows = None
        prefix = wire.FRAME_PREFIX.size
        head = bytearray(min(prefix, size))
        used = yield from _fill(memoryview(head), got)
        if len(head) < prefix:
            return bytes(head)
        magic, hlen = wire.FRAME_PREFIX.unpack_from(head)
        start = prefix + hlen
        if magic != wire.FRAME_MAGIC or start > size:
            return (yield from _whole(head, got[used:], size))
        header = bytearray(start)
        header[:prefix] = head
        used += yield from _fill(memoryview(header)[prefix:], got[used:])
        plan = self._plan(header, start, size)
        if plan is None:
            return (yield from _whole(header, got[used:], size))
        targets, rows = plan
        left = got[used:]
        for target in targets:
            if isinstance(target, _Widening):
                left = yield from target.receive(left)
                continue
            take = min(len(target), len(left))
            target[:take] = left[:take]
            left = left[take:]
            while take < len(target):
                take += yield target[take:]
        self.rows = rows
        return bytes(header)

    def _plan(
        self, header: bytearray, start: int, size: int
    ) -> tuple[list[memoryview | _Widening], tuple[list[str], list[np.ndarray | None]]] | None:
        """Where each byte of the body after its header goes (memoryviews in body order) and
        the rows they make; ``None`` to receive the body whole instead."""
        try:
            table = wire.unpack(header, wire.FRAME).get("table")
            names, spans = wire.table_spans(table, start, size, self.names)
        except wire.WireError:
            return None
        listed = table.get("narrowed", []) if self.narrowed and type(table) is dict else []
        if type(listed) is not list or not all(type(i) is int for i in listed):
            return None  # received whole, for the pull to refuse
        narrowed = set(listed)
        views = self.views
        # (row, its offset, its bytes in the body, its buffer's bytes or the row's widening)
        direct: list[tuple[int, int, int, memoryview | _Widening]] = []
        widened = False
        for i, (name, span) in enumerate(zip(names, spans)):
            if span is None:
                continue
            offset, dtype, shape = span
            view = views.get(name)
            if i in narrowed:  # float16 or bfloat16 on the wire, float32 in the end
                if dtype.itemsize != 2 or not dtype.isnative:
                    return None
                if view is not None and (view.shape != shape or view.dtype != _WIDENED):
                    return None
                nbytes = 2 * math.prod(shape)
                if nbytes < DIRECT_BYTES or (view is not None and not view.flags.c_contiguous):
                    widened = widened or view is not None  # into its buffer once in (pull.py)
                    continue
                direct.append(
                    (
                        i,
                        offset,
                        nbytes,
                        _Widening.fresh(dtype, shape) if view is None else _Widening(dtype, view),
                    )
                )
                continue
            if view is None:
                continue
            if not dtype.isnative or view.shape != shape or view.dtype != dtype:
                return None  # checked, and refused, as received whole
            if view.nbytes >= DIRECT_BYTES and view.flags.c_contiguous:
                direct.append((i, offset, view.nbytes, view.data.cast("B")))
        if not direct and not widened:
            return None
        # The bytes between the rows received into buffers, each stretch kept at its offset's
        # place in a multiple of ALIGN (the rows in it stay aligned), in one buffer.
        stretches: list[tuple[int, int, int]] = []  # (body start, body end, offset in rest)
        at, room = start, 0
        for _, offset, nbytes, _ in direct:
            if offset > at:
                place = _align(room) + at % wire.ALIGN
                stretches.append((at, offset, place))
                room = place + offset - at
            at = offset + nbytes
        if at < size:
            place = _align(room) + at % wire.ALIGN
            stretches.append((at, size, place))
            room = place + size - at
        rest = body_buffer(room) if room else memoryview(b"")
        targets: list[memoryview | _Widening] = []
        stretch = iter(stretches)
        pending = next(stretch, None)
        for _, offset, _, target in direct:
            if pending is not None and pending[0] < offset:
                targets.append(rest[pending[2] : pending[2] + pending[1] - pending[0]])
                pending = next(stretch, None)
            targets.append(target)
        if pending is not None:
            targets.append(rest[pending[2] : pending[2] + pending[1] - pending[0]])
        values: list[np.ndarray | None] = [None] * len(names)
        for i, _, _, target in direct:
            values[i] = target.out if isinstance(target, _Widening) else views[names[i]]
        readonly = rest.toreadonly()
        k = 0  # the stretch holding the row (rows and stretches are both in body order)
        for i, span in enumerate(spans):
            if span is None or values[i] is not None:
                continue
            offset, dtype, shape = span
            count = math.prod(shape)
            if not count:
                value = np.empty(shape, dtype)
            else:
                while stretches[k][1] <= offset:
                    k += 1
                a, _, place = stretches[k]
                value = np.frombuffer(readonly, dtype, count, place + offset - a).reshape(shape)
                if not dtype.isnative:
                    value = value.astype(dtype.newbyteorder("="))
            value.flags.writeable = False
            values[i] = value
        return targets, (names, values)


class _Widening:
    """A narrowed row (float16 or bfloat16) widened into ``out`` (float32, C-contiguous) as its
    bytes arrive: received :data:`STAGE` bytes at a time into one small buffer and widened from
    there while they are in the cache, so the narrowed value is never held whole and the
    widening keeps pace with the socket."""

    __slots__ = ("dtype", "out", "_flat")

    def __init__(self, dtype: np.dtype, out: np.ndarray) -> None:
        self.dtype = dtype
        self.out = out
        self._flat = out.reshape(-1)

    @classmethod
    def fresh(cls, dtype: np.dtype, shape: tuple[int, ...]) -> _Widening:
        """Into a new array, the pull's value: read-only, as the cache keeps it (written
        through a view made before)."""
        widening = cls(dtype, np.empty(shape, _WIDENED))
        widening.out.flags.writeable = False
        return widening

    def receive(self, left: memoryview) -> Generator[memoryview, int, memoryview]:
        """Receive the row (its first bytes in ``left``); return what of ``left`` is past it."""
        flat = self._flat
        stage = memoryview(bytearray(min(STAGE, 2 * flat.size)))
        done = 0
        while done < flat.size:
            n = min(len(stage) // 2, flat.size - done)
            chunk = stage[: 2 * n]
            take = min(len(chunk), len(left))
            chunk[:take] = left[:take]
            left = left[take:]
            while take < len(chunk):
                take += yield chunk[take:]
            halves.widen_into(np.frombuffer(chunk, self.dtype), flat[done : done + n])
            done += n
        return left


def _align(n: int) -> int:
    return (n + wire.ALIGN - 1) // wire.ALIGN * wire.ALIGN


def _fill(dst: memoryview, got: memoryview) -> Generator[memoryview, int, int]:
    """Fill ``dst`` from ``got`` and then the socket; how many bytes of ``got`` it took."""
    take = min(len(dst), len(got))
    dst[:take] = got[:take]
    pos = take
    while pos < len(dst):
        pos += yield dst[pos:]
    return take


def _whole(head: bytearray, got: memoryview, size: int) -> Generator[memoryview, int, memoryview]:
    """The whole body of ``size`` bytes in one buffer, as a reply is received without a sink:
    ``head`` (its first bytes, taken already), ``got`` (the next ones) and the rest."""
    body = body_buffer(size)
    at = len(head)
    body[:at] = head
    body[at : at + len(got)] = got
    yield from _fill(body[at + len(got) :], memoryview(b""))
    return body
