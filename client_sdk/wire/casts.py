"""IEEE float16 <-> float32 casts into memory the caller gives, vectorized where a kept library
offers it: the one door to that library.

numpy casts float16 element by element (its builds do not use the F16C or AVX-512 conversion
instructions for it), several times slower than copying the bytes. NumKong (the ``numkong``
package: the shards' dependency, and the SDK's optional extra ``paramshard[float16]``) converts
with those instructions where the CPU has them, picked at run time, and rounds to nearest, ties
to even, as numpy does. :func:`backend` picks once, at the first cast (a shard asks at start):
NumKong when it imports, offers ``astype(a, dtype, out=)``, and its results on
:data:`_PROBES` (ties, subnormals, the range's edges, infinities, NaN) and on every float16 are
numpy's bit for bit (a NaN only as a NaN: NumKong may quiet a signalling one); numpy's
``np.copyto`` otherwise, with one warning saying why when NumKong is installed but fails the
check. Either way the bits written are the same.

Thread-safety: :func:`backend` may pick twice when first called by two threads at once (the
same answer); the casts themselves hold no state and release the GIL in both backends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

__all__ = ["NUMKONG", "NUMPY", "backend", "to_float16", "to_float16_in_range", "to_float32"]

logger = logging.getLogger("paramshard.wire")

NUMKONG, NUMPY = "numkong", "numpy"
_F4 = np.dtype("<f4")
_F2 = np.dtype("<f2")

#: float32 values whose float16 rounding the check compares: halfway ties (even and odd), the
#: subnormals and the ties below the smallest one, the largest finite float16 and the first
#: float32 that overflows (65520), infinities, NaN, signed zeros.
_PROBES = np.array(
    [
        0.0,
        -0.0,
        1.0,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        -(1.0 + 2.0**-11),
        2.0**-14,
        2.0**-24,
        2.0**-25,
        3 * 2.0**-25,
        2.0**-26,
        1e-10,
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        1e10,
        np.inf,
        -np.inf,
        np.nan,
        0.1,
        -3.14159,
    ],
    _F4,
)

_Narrow = Callable[[np.ndarray, np.ndarray], bool]
_Widen = Callable[[np.ndarray, np.ndarray], None]
#: (backend, narrow, widen, narrow without looking for infinities), once :func:`_pick` ran.
_chosen: tuple[str, _Narrow, _Widen, _Widen] | None = None
#: Blocks whose narrowing the check asks whether they hold an infinity (NaN: not one).
_INFINITIES = (
    [1.0, np.inf, np.nan, -2.0],
    [-np.inf, 3.0],
    [np.nan, 3.0],
    [3.0, np.nan],
    [np.nan, np.nan],
    [65504.0, -65504.0, 65519.0],
    [1.0, 65520.0],
    [-65520.0, 0.0],
    [1e30, 1.0],
    [1.0] * 100 + [-1e30],
)
#: The smallest float32 magnitude that rounds to an infinity in float16 (65504 + half a step).
_F16_INF = np.float32(65520.0)


def _numpy_cast(src: np.ndarray, out: np.ndarray) -> None:
    with np.errstate(over="ignore"):  # a float16 overflow is the caller's to refuse
        np.copyto(out, src, casting="unsafe")


def _numpy_narrow(src: np.ndarray, out: np.ndarray) -> bool:
    _numpy_cast(src, out)
    # max and min read the block while it is in the cache; NaN fails both tests
    return bool(src.size) and not (src.max() < _F16_INF and src.min() > -_F16_INF)


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether ``got`` is ``want`` bit for bit, a NaN counting as any NaN."""
    nan = np.isnan(want)
    return bool(
        np.array_equal(np.isnan(got), nan)
        and np.array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))
    )


def _numkong() -> tuple[_Narrow, _Widen, _Widen] | str:
    """NumKong's two casts, or why not (a sentence)."""
    try:
        import numkong
    except ImportError:
        return "not installed"
    astype, minmax = getattr(numkong, "astype", None), getattr(numkong, "minmax", None)
    if astype is None or minmax is None:
        return f"numkong {getattr(numkong, '__version__', '?')} lacks astype() or minmax()"

    def narrow(src: np.ndarray, out: np.ndarray) -> bool:
        if src.dtype != _F4 or out.dtype != _F2:  # another byte order: numpy's
            return _numpy_narrow(src, out)
        if not src.size:
            return False
        astype(src, "float16", out=out)
        # the infinities the block holds, from half the bytes (None: NaN only)
        low_high = minmax(out)
        return low_high is not None and (low_high[0] == -np.inf or low_high[2] == np.inf)

    def widen(src: np.ndarray, out: np.ndarray) -> None:
        if src.dtype == _F2 and out.dtype == _F4:
            astype(src, "float32", out=out)
        else:
            _numpy_cast(src, out)

    def cast(src: np.ndarray, out: np.ndarray) -> None:
        if src.dtype == _F4 and out.dtype == _F2:
            astype(src, "float16", out=out)
        else:
            _numpy_cast(src, out)

    rng = np.random.default_rng(0)
    probes = np.concatenate([_PROBES, rng.standard_normal(4096, _F4) * 1000]).astype(_F4)
    halves = np.arange(1 << 16, dtype=np.uint16).view(_F2)
    try:
        got16, got32 = np.empty(probes.size, _F2), np.empty(halves.size, _F4)
        narrow(probes, got16)
        widen(halves, got32)
        infinities = [narrow(np.array(x, _F4), np.empty(len(x), _F2)) for x in _INFINITIES]
    except Exception as exc:  # any failure means: do not use it
        return f"numkong failed its check ({type(exc).__name__}: {exc})"
    want16 = np.empty(probes.size, _F2)
    _numpy_cast(probes, want16)
    if not _same_bits(got16, want16) or not _same_bits(got32, halves.astype(_F4)):
        return "numkong's astype rounds differently from numpy on the check's values"
    if infinities != [any(abs(v) >= _F16_INF for v in x) for x in _INFINITIES]:
        return "numkong's minmax misses an infinity (or finds one) on the check's values"
    return narrow, widen, cast


def backend() -> str:
    """The casts' backend, :data:`NUMKONG` or :data:`NUMPY`, picked at the first call."""
    return (_chosen or _pick())[0]


def _pick() -> tuple[str, _Narrow, _Widen, _Widen]:
    global _chosen
    found = _numkong()
    if isinstance(found, str):
        if found != "not installed":
            logger.warning("float16 casts use numpy (slower): %s", found)
        _chosen = (NUMPY, _numpy_narrow, _numpy_cast, _numpy_cast)
    else:
        _chosen = (NUMKONG, *found)
    return _chosen


def to_float16(src: np.ndarray, out: np.ndarray) -> bool:
    """Write float32 ``src`` rounded to nearest-even float16 into ``out`` (C-contiguous, the
    same shape, native ``<f2``); return whether ``out`` may hold an infinity. A float32 beyond
    float16's range becomes one here: the caller looks, and refuses it
    (:func:`client_sdk.wire.halves.narrow`). Never ``False`` when ``out`` holds one."""
    return (_chosen or _pick())[1](src, out)


def to_float16_in_range(src: np.ndarray, out: np.ndarray) -> None:
    """:func:`to_float16` of ``src`` known to hold no magnitude beyond float16's largest
    (65504): the cast alone, without looking for infinities in ``out`` afterwards."""
    (_chosen or _pick())[3](src, out)


def to_float32(src: np.ndarray, out: np.ndarray) -> None:
    """Write float16 ``src`` into float32 ``out`` (C-contiguous, the same shape): exact."""
    (_chosen or _pick())[2](src, out)
