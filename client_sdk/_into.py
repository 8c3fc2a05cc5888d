"""``pull(names, out={name: buffer})``: pulled values written into the caller's own memory.

:func:`targets` checks the buffers before anything is sent: each names a variable being
pulled, and is viewed as a writable ndarray without a copy (an ndarray, an object with the
buffer protocol or ``__array_interface__``, or a DLPack tensor in host memory such as a torch
CPU tensor); its shape and dtype must be the variable's as far as this client knows it (from
its init or last pull; a partitioned variable's whole shape). Once the pull's replies are in,
:func:`check` compares every value with its buffer again (a variable made again with another
shape since) before :func:`write` writes any of them, so a refused pull leaves every buffer as
it was. Writing is one ``np.copyto`` per variable (per part of a partitioned one, straight into
the buffer's rows): the pulled bytes are copied once, from the reply's receive buffer into the
caller's, and nothing parameter-sized is allocated for them on the way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._args import SENDABLE_DTYPES, host_view
from ._exceptions import BadRequestError, BadTensorError
from .partitions import Layout

__all__ = ["check", "targets", "write"]

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
                np.copyto(rows, part)
            out[name] = view
        elif view is not None:
            np.copyto(view, value)
            out[name] = view
        else:
            out[name] = value
    return out
