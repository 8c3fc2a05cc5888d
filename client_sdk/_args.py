"""Argument coercion: what a caller passes to a verb, checked and made into what the wire
carries, before anything is sent.

Variable names (:func:`valid_name`, :func:`names`), ``{name: array-like}`` maps (:func:`arrays`,
each value by :func:`as_array`: a C-contiguous ndarray of a dtype the protocol has a name for),
optimizer specs (:func:`optimizer_specs`), training modes (:func:`mode`) and the names-or-prefix
of the verbs that change or remove variables (:func:`target`). A bad argument is a
:class:`BadRequestError` or :class:`BadTensorError` that says what to pass instead. Names are
placed on their shard as they are checked (:meth:`Fleet.place <client_sdk._fleet.Fleet.place>`
remembers both, so a name used every step is checked once).

Checks of one verb's own arguments (a timeout, a counter's delta) are in that verb's module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from . import wire
from ._exceptions import BadRequestError, BadTensorError
from .modes import Mode, ModeError
from .optimizers import Optimizer
from .placement import validate_name

if TYPE_CHECKING:
    from ._fleet import Fleet

__all__ = [
    "arrays",
    "as_array",
    "host_view",
    "mode",
    "names",
    "optimizer_specs",
    "target",
    "valid_name",
]


def valid_name(name: Any) -> str:
    """``name`` if it is a valid variable name; else :class:`BadRequestError` saying why."""
    try:
        return validate_name(name)
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None


def names(names: Any, verb: str, fleet: Fleet) -> list[str]:
    """Validate a list of names (duplicates dropped, order kept) and place them."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise BadRequestError(
            f"{verb} takes a list of variable names, e.g. "
            f"{verb}(['w', 'b']); got {type(names).__name__} {names!r:.80}"
        )
    try:
        out = list(dict.fromkeys(names))
    except TypeError:  # an unhashable item, e.g. a list: say which
        for name in names:
            valid_name(name)
        raise
    placed = fleet.placed
    for name in out:
        if name not in placed:
            fleet.place(name)
    return out


def arrays(values: Any, verb: str, fleet: Fleet, *, copy: bool = False) -> dict[str, np.ndarray]:
    """Validate ``{name: array-like}``, place the names and convert each value to a sendable
    ndarray (a copy of it with ``copy``)."""
    if not isinstance(values, Mapping):
        raise BadRequestError(
            f"{verb} takes a dict of name -> array, e.g. "
            f"{verb}({{'w': w}}); got {type(values).__name__}"
        )
    placed = fleet.placed
    out = {}
    for k, v in values.items():
        if k not in placed:
            fleet.place(k)
        out[k] = as_array(k, v, copy=copy)
    return out


def as_array(name: str, value: Any, *, copy: bool = False) -> np.ndarray:
    """Convert an array-like to a C-contiguous ndarray of a dtype the protocol carries.

    What numpy can view is viewed, not copied (unless ``copy``): an ndarray, an object with the
    buffer protocol or ``__array_interface__``, and a DLPack tensor in host memory (a torch CPU
    tensor, a JAX CPU array; :func:`host_view`). Only a non-contiguous value is copied, into C
    order.

    Raises :class:`BadTensorError` (saying which variable and what to send instead) for object,
    complex, bool, string and other dtypes the protocol has no name for.
    """
    if (
        not copy
        and type(value) is np.ndarray
        and value.dtype in SENDABLE_DTYPES
        and value.flags.c_contiguous
    ):
        return value  # the common case: nothing to check twice, nothing to convert
    if not isinstance(value, np.ndarray) and hasattr(type(value), "__dlpack__"):
        value = host_view(name, value)
    try:
        arr = np.array(value, copy=True) if copy else np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise BadTensorError(
            f"{name}: cannot convert the value to an array ({exc}); pass a "
            "numpy array or a nested list of numbers"
        ) from None
    if arr.dtype.kind not in "fiu" or (arr.dtype.kind + str(arr.dtype.itemsize)) not in wire.DTYPES:
        raise BadTensorError(
            f"{name}: dtype {arr.dtype} cannot be sent; use a float (float16/32/64) or an "
            "integer dtype, e.g. np.asarray(value, dtype=np.float32)",
            code="bad_tensor",
            details={"variable": name, "dtype": str(arr.dtype)},
        )
    if arr.ndim > wire.MAX_NDIM:
        raise BadTensorError(
            f"{name}: at most {wire.MAX_NDIM} dimensions, got {arr.ndim}",
            code="bad_tensor",
            details={"variable": name},
        )
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return arr


#: DLPack's device types (``__dlpack_device__()[0]``), by name, for the error a tensor that is
#: not in host memory gets; 1 (kDLCPU) is the one numpy can view.
DLPACK_DEVICES = {2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm"}
DLPACK_CPU = 1


def host_view(name: str, value: Any) -> np.ndarray:
    """An ndarray viewing a DLPack tensor's memory (no copy): ``value`` has ``__dlpack__``.

    A tensor on another device than the host's memory (a GPU's) raises
    :class:`BadTensorError` saying to move it to host first, before numpy is asked to view
    it; so does one that cannot be exported (a torch tensor that requires grad, a dtype
    numpy lacks such as torch's bfloat16), with the exporter's reason.
    """
    device = getattr(value, "__dlpack_device__", None)
    kind: Any = DLPACK_CPU
    if device is not None:
        try:
            kind, index = device()
        except Exception as exc:  # a third-party method: anything it raises says why
            raise BadTensorError(
                f"{name}: cannot tell which device the tensor is on ({exc})",
                code="bad_tensor",
                details={"variable": name},
            ) from None
    if kind != DLPACK_CPU:
        where = f"{DLPACK_DEVICES.get(int(kind), f'device type {kind}')}:{index}"
        raise BadTensorError(
            f"{name}: the tensor is on {where}, not in host memory: move it to the host first "
            "(torch: tensor.cpu(); JAX: jax.device_get(x)); the SDK sends host memory only",
            code="bad_tensor",
            details={"variable": name, "device": where},
        )
    try:
        return np.from_dlpack(value)
    except Exception as exc:  # the exporter's own error class (torch raises RuntimeError)
        raise BadTensorError(
            f"{name}: numpy cannot view the tensor ({type(exc).__name__}: {exc}); pass a "
            "CPU tensor of a float or int dtype numpy has (torch: tensor.detach() for one that "
            "requires grad; bfloat16 travels as float32 with PSClient(wire_dtype='bfloat16'))",
            code="bad_tensor",
            details={"variable": name},
        ) from None


#: The dtypes :func:`as_array` passes through (every wire dtype, either byte order).
SENDABLE_DTYPES = frozenset(np.dtype(o + k) for k in wire.DTYPES for o in "<>")


def optimizer_specs(
    optimizer: Any, arrays: Mapping[str, np.ndarray]
) -> dict[str, dict[str, Any] | None]:
    """``optimizer`` is one spec for every variable, a dict name -> spec, or None."""
    if optimizer is None or isinstance(optimizer, Optimizer):
        spec = optimizer.to_wire() if optimizer is not None else None
        return {name: spec for name in arrays}
    if isinstance(optimizer, Mapping):
        out: dict[str, dict[str, Any] | None] = {}
        for name in arrays:
            o = optimizer.get(name)
            if o is not None and not isinstance(o, Optimizer):
                raise BadRequestError(
                    f"init: optimizer for {name!r} must be an optimizer spec "
                    f"such as SGD(lr=0.1), got {o!r}"
                )
            out[name] = o.to_wire() if o is not None else None
        unknown = set(optimizer) - set(arrays)
        if unknown:
            raise BadRequestError(
                f"init: optimizers given for names not being initialised: {sorted(unknown)}"
            )
        return out
    raise BadRequestError(
        "init: optimizer must be a spec from client_sdk.optimizers (e.g. "
        f"Adagrad(lr=0.1)) or a dict name -> spec; got {optimizer!r}"
    )


def mode(sync: Any, max_staleness: Any, staleness_policy: Any) -> Mode:
    """The training mode an ``init`` asks for (:mod:`client_sdk.modes`);
    :class:`BadRequestError` naming the argument when it is out of range or contradictory."""
    try:
        return Mode(sync, max_staleness, staleness_policy)
    except ModeError as exc:
        raise BadRequestError(f"init: {exc}", details={"field": exc.field}) from None


def target(target: Any, verb: str, fleet: Fleet) -> tuple[list[str] | None, str | None]:
    """``(names, None)`` for a list of names (checked, placed), ``(None, prefix)`` for a string:
    the start of the names to match on every shard. An empty prefix would match every variable
    of the fleet: refused, as the shards refuse it."""
    if isinstance(target, str):
        if not target:
            raise BadRequestError(
                f"{verb}: an empty prefix would match every variable of the fleet, so it is "
                "refused: name the variables instead (ps.variables() lists them)"
            )
        try:
            validate_name(target)
        except ValueError:
            raise BadRequestError(
                f"{verb}: prefix {target[:40]!r} is not the start of any variable name "
                "(1-256 characters of A-Z a-z 0-9 _ . : / -)"
            ) from None
        return None, target
    if isinstance(target, bytes) or not isinstance(target, Iterable):
        raise BadRequestError(
            f"{verb} takes a list of variable names, or a string: the prefix of the names to "
            f"match (e.g. {verb}('run1/')); got {type(target).__name__}"
        )
    return names(target, verb, fleet), None
