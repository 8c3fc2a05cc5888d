"""float16 casts (client_sdk/wire/casts.py) and the widening of narrowed rows as they arrive
(client_sdk/_into.py's ``Sink``), without a network.

Both backends write numpy's bits: every float16 widened, float32 values narrowed around the
ties, the subnormals and the range's edges, and each says when a block holds an infinity.
A NumKong that rounds otherwise is not used, and the log says why. A sink fed a half-precision
reply however its bytes come (a byte at a time, odd pieces, all at once) widens each big
narrowed row into the caller's buffer or a new read-only array, and leaves the small ones and
the float16 variables (not in ``narrowed``) as they came.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from client_sdk import wire
from client_sdk._into import DIRECT_BYTES, STAGE, Sink
from client_sdk.wire import casts, halves
from tests.helpers.sinks import drive

F16_PATTERNS = np.arange(1 << 16, dtype=np.uint16).view(np.float16)


def probes() -> np.ndarray:
    rng = np.random.default_rng(3)
    edges = casts._PROBES
    ties = (np.arange(1, 2049, dtype=np.float32) + 0.5) * np.float32(2.0**-13)  # halfway, small
    return np.concatenate([edges, ties, rng.standard_normal(50_000).astype(np.float32) * 300])


@pytest.fixture(params=[casts.NUMKONG, casts.NUMPY])
def backend(request, monkeypatch):
    if request.param == casts.NUMKONG:
        pytest.importorskip("numkong")
    else:
        monkeypatch.setattr(casts, "_numkong", lambda: "not installed")
    monkeypatch.setattr(casts, "_chosen", None)
    assert casts.backend() == request.param
    return request.param


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))


def test_each_backend_writes_numpys_bits_and_finds_every_infinity(backend):
    x = probes()
    out = np.empty(x.size, np.float16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert casts.to_float16(x, out) is True  # the probes hold 65520 and infinities
    same_bits(out, want)
    fits = x[np.abs(x) <= 65504]  # what a bound within float16's range vouches for
    cast = np.empty(fits.size, np.float16)
    casts.to_float16_in_range(fits, cast)
    same_bits(cast, fits.astype(np.float16))
    wide = np.empty(F16_PATTERNS.size, np.float32)
    casts.to_float32(F16_PATTERNS, wide)
    same_bits(wide, F16_PATTERNS.astype(np.float32))
    for block, infinite in (
        ([1.0, np.nan, -65504.0, 65519.0], False),
        ([np.nan, np.nan], False),
        ([1.0, 65520.0], True),
        ([-1e30, np.nan], True),
        ([np.inf], True),
    ):
        src = np.array(block, np.float32)
        found = casts.to_float16(src, np.empty(src.size, np.float16))
        # numpy's check reads the float32 block, where a NaN may be anything: it says "look"
        assert found is infinite or (backend == casts.NUMPY and found), block
    assert casts.to_float16(np.empty(0, np.float32), np.empty(0, np.float16)) is False
    # halves.narrow refuses through either
    with pytest.raises(wire.WireError, match="65520"):
        halves.narrow(np.array([0.5] * 1000 + [65520.0], np.float32), "float16")


def test_a_numkong_that_rounds_otherwise_is_not_used_and_the_log_says_why(monkeypatch, caplog):
    numkong = pytest.importorskip("numkong")

    def truncating(a, dtype, out=None):  # float32 -> float16 by dropping bits: wrong ties
        if dtype == "float16":
            bits = (np.asarray(a, np.float32).view(np.uint32) >> 13).astype(np.uint16)
            with np.errstate(over="ignore"):
                out[...] = np.asarray(a, np.float32).astype(np.float16)
            out.view(np.uint16)[::7] = bits[::7]
            return out
        out[...] = np.asarray(a).astype(np.float32)
        return out

    monkeypatch.setattr(numkong, "astype", truncating)
    monkeypatch.setattr(casts, "_chosen", None)
    with caplog.at_level(logging.WARNING, logger="paramshard.wire"):
        assert casts.backend() == casts.NUMPY
    assert "rounds differently from numpy" in caplog.text
    monkeypatch.undo()  # astype as it was; a minmax that never sees an infinity
    monkeypatch.setattr(numkong, "minmax", lambda a: None)
    monkeypatch.setattr(casts, "_chosen", None)
    with caplog.at_level(logging.WARNING, logger="paramshard.wire"):
        assert casts.backend() == casts.NUMPY
    assert "minmax misses an infinity" in caplog.text


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("first, step", [(0, 1 << 22), (100, 4097), (70_000, 65_536), (9, 3)])
def test_a_sink_widens_narrowed_rows_as_they_arrive(wire_dtype, first, step):
    if wire_dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(step)
    big = STAGE + 3000 if step > 3 else DIRECT_BYTES // 2 + 7  # several stages, odd ends
    values = [
        rng.standard_normal(big).astype(np.float32),  # into the caller's buffer
        rng.standard_normal((2, big // 2 + 1)).astype(np.float32),  # into a new array
        np.arange(10, dtype=np.float32),  # small: widened once the reply is in
        rng.standard_normal(DIRECT_BYTES).astype(np.float16),  # a float16 variable: as it is
    ]
    names = [f"v{i}" for i in range(len(values))]
    arrays, dtypes = list(values[:3]), [None, None, None]
    narrowed = halves.narrow_rows(names[:3], arrays, dtypes, wire_dtype)
    arrays.append(values[3])
    table: dict = {"names": names, "narrowed": narrowed}
    body = wire.encode_table({"table": table}, table, arrays).join()
    buf = np.zeros(big, np.float32)
    sink = Sink({names[0]: buf}, names, narrowed=True)
    drive(sink, body, min(first, len(body) - 1), step)
    assert sink.rows is not None
    _, rows = sink.rows
    want = [halves.widen(a) if i in narrowed else a for i, a in enumerate(arrays)]
    assert rows[0] is buf and np.array_equal(buf, want[0])
    assert rows[1].dtype == np.float32 and not rows[1].flags.writeable
    assert np.array_equal(rows[1], want[1])
    assert rows[2].dtype != np.float32  # left for the pull to widen
    assert np.array_equal(halves.widen(rows[2]), want[2])
    assert rows[3].dtype == np.float16 and np.array_equal(rows[3], values[3])
