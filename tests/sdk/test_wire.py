"""The wire format (client_sdk/wire/, docs/PROTOCOL.md §2) as properties.

Round trips: ``encode -> join -> unpack -> decode_tensor`` gives back every array bit for bit
(NaN payloads included), as a view of the received body rather than a copy, for every dtype and
byte order, 0-d, empty, non-contiguous and multi-megabyte arrays, inline and framed.
Robustness: whatever arrives, decoding raises :class:`wire.WireError` with a protocol error
code and nothing else.
"""

from __future__ import annotations

import ast
import json
import math
import re
import struct

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from client_sdk import wire
from client_sdk.wire.tensors import BFLOAT16
from tests.conftest import ROOT

settings.register_profile("wire", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("wire")

PROTOCOL_CODES = {"bad_request", "bad_tensor"}


# --------------------------------------------------------------------------- strategies


def dtype_strings() -> st.SearchStrategy[str]:
    """Every wire dtype in every byte order it may be written in."""

    def orders(kind_size: str) -> list[str]:
        return ["|" + kind_size] if kind_size.endswith("1") else ["<" + kind_size, ">" + kind_size]

    return st.sampled_from(sorted(s for ks in wire.DTYPES for s in orders(ks)))


@st.composite
def arrays(draw, max_side: int = 6, max_dims: int = 4) -> np.ndarray:
    """An array of any wire dtype whose bytes are arbitrary (so floats include every NaN,
    infinity and -0.0 pattern), in one of several memory layouts."""
    dtype = np.dtype(draw(dtype_strings()))
    shape = draw(array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side))
    layout = draw(st.sampled_from(["c", "fortran", "strided", "reversed", "transposed"]))
    if layout == "strided" and shape:
        # every other row of an array twice as tall: a view with a non-unit stride
        big = _random_array(draw, dtype, (shape[0] * 2, *shape[1:]))
        a = big[::2]
    else:
        a = _random_array(draw, dtype, shape)
        if layout == "fortran" and shape:  # (asfortranarray makes 0-d arrays 1-d)
            a = np.asfortranarray(a)
        elif layout == "reversed" and shape:
            a = a[::-1]
        elif layout == "transposed":
            a = a.T
    assert a.shape in (shape, shape[::-1])
    return a


def _random_array(draw, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _same(decoded: np.ndarray, original: np.ndarray) -> None:
    """Exactly the same tensor: dtype (with byte order), shape and every byte, compared as
    bytes so that NaNs with equal bit patterns count as equal."""
    assert decoded.dtype.str == original.dtype.str
    assert decoded.shape == original.shape
    assert decoded.tobytes() == original.tobytes()


def _u8(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _round_trip(msg, frame, body_type=bytes):
    enc = wire.encode(msg, frame=frame)
    joined = enc.join()
    assert len(joined) == enc.nbytes
    body = body_type(joined)
    return enc, body, wire.unpack(body, enc.content_type)


# --------------------------------------------------------------------------- round trips


@given(arrays(), st.sampled_from([False, True, None]), st.sampled_from([bytes, bytearray]))
def test_round_trip_is_exact_and_copy_free(a, frame, body_type):
    enc, body, msg = _round_trip({"t": a}, frame, body_type)
    framed = enc.content_type == wire.FRAME
    if frame is None:
        assert framed == (a.nbytes >= wire.FRAME_THRESHOLD)
    else:
        assert framed == frame
    t = msg["t"]
    assert set(t) == (
        {"dtype", "shape", "offset", "nbytes"} if framed else {"dtype", "shape", "data"}
    )
    out = wire.decode_tensor(t, body)
    _same(out, a)
    # The decoded array is a view of what arrived, not a copy of it.
    holder = body if framed else t["data"]
    if out.nbytes:
        assert np.shares_memory(out, _u8(holder))
    # Writable exactly when the memory under it is: a framed tensor over a bytearray body.
    # (msgpack hands inline data over as immutable bytes, whatever the body was.)
    assert out.flags.writeable == (framed and body_type is bytearray)


@given(arrays(max_side=4, max_dims=3))
def test_decoded_framed_tensor_writes_through_to_the_body(a):
    assume(a.nbytes > 0)
    _enc, body, msg = _round_trip({"t": a}, True, bytearray)
    out = wire.decode_tensor(msg["t"], body)
    before = bytes(body)
    out.reshape(-1).view(np.uint8)[:] = 0xAB
    off = msg["t"]["offset"]
    assert body[off : off + a.nbytes] == b"\xab" * a.nbytes
    assert body[:off] == before[:off] and body[off + a.nbytes :] == before[off + a.nbytes :]


@given(arrays(max_side=4, max_dims=3))
def test_decoding_from_a_memoryview_body(a):
    enc = wire.encode({"t": a}, frame=True)
    for holder, writable in ((bytearray(enc.join()), True), (enc.join(), False)):
        body = memoryview(holder)
        out = wire.decode_tensor(wire.unpack(body, wire.FRAME)["t"], body)
        _same(out, a)
        assert out.flags.writeable == writable


@given(
    st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), arrays(max_side=5), max_size=6),
    st.sampled_from([False, True]),
)
def test_many_tensors_in_one_message(grads, frame):
    msg = {
        "worker_id": "w0",
        "seq": 7,
        "grads": grads,
        "versions": {k: 3 for k in grads},
        "scalar": np.float32(1.5),
        "nested": [(1, 2), {"x": None}],
    }
    _enc, body, got = _round_trip(msg, frame)
    assert got["worker_id"] == "w0" and got["seq"] == 7 and got["versions"] == msg["versions"]
    assert got["scalar"] == 1.5 and got["nested"] == [[1, 2], {"x": None}]
    decoded = wire.tensors_of(got["grads"], body, "grads")
    assert list(decoded) == list(grads)
    for name, a in grads.items():
        _same(decoded[name], a)


@given(st.lists(arrays(max_side=5), min_size=1, max_size=6))
def test_frame_layout(arrs):
    """Header first; every tensor at a multiple of ALIGN past it; in order, no overlaps; the
    arrays' own memory is handed to the writer, not copied into a joined buffer."""
    enc = wire.encode({"ts": arrs}, frame=True)
    assert enc.content_type == wire.FRAME
    body = enc.join()
    magic, hlen = struct.unpack_from("<4sI", body)
    assert magic == wire.FRAME_MAGIC
    header = msgpack.unpackb(body[8 : 8 + hlen], raw=False)
    assert header == wire.unpack(body, wire.FRAME)
    end = 8 + hlen
    for t, a in zip(header["ts"], arrs):
        assert t["offset"] % wire.ALIGN == 0
        assert t["offset"] >= end
        assert body[end : t["offset"]] == bytes(t["offset"] - end)  # zero padding
        assert t["nbytes"] == a.nbytes
        end = t["offset"] + t["nbytes"]
    assert end == len(body) == enc.nbytes
    for a in arrs:
        if a.nbytes and a.flags.c_contiguous:
            assert any(
                isinstance(c, memoryview) and np.shares_memory(_u8(c), a) for c in enc.chunks
            )


@pytest.mark.parametrize(
    ("dtype", "bits"),
    [
        ("<f2", [0x7C01, 0xFE00, 0x7E00, 0x8000, 0x7C00]),
        (">f2", [0x7C01, 0xFC01]),
        ("<f4", [0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x80000000, 0xFF800000]),
        (">f4", [0x7F800001, 0xFFFFFFFF]),
        ("<f8", [0x7FF0000000000001, 0xFFF8000000000001, 0x7FF7FFFFFFFFFFFF, 1 << 63]),
        (">f8", [0x7FF0000000000001, 0xFFFFFFFFFFFFFFFF]),
    ],
)
@pytest.mark.parametrize("frame", [False, True])
def test_nan_payloads_and_signed_zero_survive(dtype, bits, frame):
    dt = np.dtype(dtype)
    uint = np.dtype(dtype[0] + "u" + dtype[2])
    a = np.array(bits, dtype=uint).view(dt)
    _enc, body, msg = _round_trip({"t": a}, frame)
    out = wire.decode_tensor(msg["t"], body)
    assert out.dtype == dt
    assert out.view(uint).tolist() == bits


@settings(max_examples=4)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(["<f4", ">f8", "|u1", "<i2"]),
    st.sampled_from([False, True]),
)
def test_multi_megabyte_arrays(seed, dtype, frame):
    rng = np.random.default_rng(seed)
    nbytes = int(rng.integers(2 << 20, 5 << 20)) // 8 * 8 + 8  # a few MB, odd element counts
    a = np.frombuffer(rng.bytes(nbytes), dtype=dtype).reshape(-1)
    a = a[: a.size - int(rng.integers(0, 3))]
    a = a.reshape(-1, 1) if seed % 2 else a
    _enc, body, msg = _round_trip({"big": a, "small": np.arange(3)}, frame, bytearray)
    out = wire.decode_tensor(msg["big"], body)
    _same(out, a)
    if frame:
        assert np.shares_memory(out, _u8(body))
    _same(wire.decode_tensor(msg["small"], body), np.arange(3))


def test_zero_d_and_empty_tensors_on_the_wire():
    for frame in (False, True):
        _enc, body, msg = _round_trip(
            {"s": np.float64(2.5), "z": np.array(7, "<i4"), "e": np.zeros((3, 0, 2), ">f4")}, frame
        )
        assert msg["s"] == 2.5  # a numpy scalar is a plain msgpack number, not a tensor
        z = wire.decode_tensor(msg["z"], body)
        assert z.shape == () and z.dtype.str == "<i4" and int(z) == 7
        assert msg["z"]["shape"] == []
        e = wire.decode_tensor(msg["e"], body)
        assert e.shape == (3, 0, 2) and e.dtype.str == ">f4"


def test_encoding_does_not_modify_or_keep_noncontiguous_inputs():
    a = np.arange(24, dtype="<f4").reshape(4, 6)[:, ::2]
    before = a.copy()
    enc = wire.encode({"a": a}, frame=True)
    assert not any(isinstance(c, memoryview) and np.shares_memory(_u8(c), a) for c in enc.chunks)
    np.testing.assert_array_equal(a, before)


@pytest.mark.parametrize(
    "arr",
    [
        np.array([True, False]),
        np.array([1 + 2j], dtype=np.complex64),
        np.array(["x"], dtype=object),
        np.array(["ab"]),
        np.array([1], dtype="datetime64[s]"),
        np.zeros(2, dtype=[("a", "<f4")]),
        np.zeros(2, dtype=np.longdouble),
    ],
)
@pytest.mark.parametrize("frame", [False, True])
def test_encoding_refuses_arrays_off_the_dtype_list(arr, frame):
    with pytest.raises(wire.WireError) as info:
        wire.encode({"a": arr}, frame=frame)
    assert info.value.code == "bad_tensor"


# --------------------------------------------------------------------------- robustness


def _check(exc: wire.WireError) -> None:
    assert exc.code in PROTOCOL_CODES, exc.code
    assert exc.message and str(exc) == exc.message
    assert isinstance(exc.details, dict)


def _only_wire_errors(body, content_type) -> None:
    """Decode whatever could be decoded in a body, as a careless shard might: every call
    either succeeds or raises WireError (any other exception fails the test)."""
    try:
        msg = wire.unpack(body, content_type)
    except wire.WireError as exc:
        _check(exc)
        return
    assert isinstance(msg, dict)

    def visit(v):
        if isinstance(v, dict):
            for call in (
                lambda: wire.decode_tensor(v, body),
                lambda: wire.tensors_of(v, body, "field"),
            ):
                try:
                    call()
                except wire.WireError as exc:
                    _check(exc)
            for x in v.values():
                visit(x)
        elif isinstance(v, list):
            for x in v:
                visit(x)

    visit(msg)


@given(st.binary(max_size=300), st.sampled_from([wire.MSGPACK, wire.FRAME]))
def test_random_bytes_raise_only_wire_errors(data, content_type):
    _only_wire_errors(data, content_type)


@given(st.binary(max_size=200))
def test_random_bytes_after_a_valid_frame_prefix(rest):
    body = struct.pack("<4sI", wire.FRAME_MAGIC, len(rest) // 2) + rest
    _only_wire_errors(body, wire.FRAME)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)

tensor_fields = st.fixed_dictionaries(
    {},
    optional={
        "dtype": dtype_strings() | st.text(max_size=5) | msgpack_values,
        "shape": st.lists(st.integers(-2, 2**64 - 1), max_size=4) | msgpack_values,
        "data": st.binary(max_size=64) | msgpack_values,
        "offset": st.integers(-100, 300) | msgpack_values,
        "nbytes": st.integers(-10, 300) | msgpack_values,
    },
)


@given(
    st.dictionaries(st.text(max_size=4), tensor_fields | msgpack_values, max_size=4),
    st.binary(max_size=256),
    st.sampled_from([wire.MSGPACK, wire.FRAME]),
)
def test_arbitrary_messages_raise_only_wire_errors(msg, tail, content_type):
    head = msgpack.packb(msg, use_bin_type=True)
    if content_type == wire.FRAME:
        body = struct.pack("<4sI", wire.FRAME_MAGIC, len(head)) + head + tail
    else:
        body = head
    _only_wire_errors(body, content_type)


@given(tensor_fields, st.binary(max_size=256) | st.none())
def test_decode_tensor_accepts_consistent_maps_and_refuses_the_rest(t, body):
    try:
        out = wire.decode_tensor(t, body)
    except wire.WireError as exc:
        assert exc.code == "bad_tensor"
        return
    # Whatever it accepted is self-consistent.
    assert out.dtype.str == t["dtype"] and list(out.shape) == t["shape"]
    if "data" in t:
        assert out.tobytes() == bytes(t["data"])
    else:
        assert out.tobytes() == bytes(body[t["offset"] : t["offset"] + t["nbytes"]])


def _valid(frame: bool):
    a = np.arange(40, dtype="<f4").reshape(5, 8)
    enc = wire.encode({"grads": {"w": a, "b": np.ones(3, ">f8")}}, frame=frame)
    return enc.join(), enc.content_type


@given(st.data(), st.sampled_from([False, True]))
def test_truncated_bodies_are_refused(data, frame):
    body, ctype = _valid(frame)
    cut = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(wire.WireError) as info:
        truncated = body[:cut]
        wire.tensors_of(wire.unpack(truncated, ctype)["grads"], truncated, "grads")
    assert info.value.code in PROTOCOL_CODES
    # the whole body decodes
    assert set(wire.tensors_of(wire.unpack(body, ctype)["grads"], body, "grads")) == {"w", "b"}


@given(st.binary(min_size=4, max_size=4).filter(lambda m: m != wire.FRAME_MAGIC))
def test_wrong_magic(magic):
    body, ctype = _valid(True)
    with pytest.raises(wire.WireError) as info:
        wire.unpack(magic + body[4:], ctype)
    assert info.value.code == "bad_request"


def test_frame_header_longer_than_body():
    body, _ = _valid(True)
    bad = struct.pack("<4sI", wire.FRAME_MAGIC, len(body)) + body[8:]
    with pytest.raises(wire.WireError, match="header"):
        wire.unpack(bad, wire.FRAME)


def _framed(tensor: dict, payload: bytes = bytes(256)) -> tuple[bytes, dict]:
    head = msgpack.packb({"t": tensor}, use_bin_type=True)
    body = struct.pack("<4sI", wire.FRAME_MAGIC, len(head)) + head + payload
    return body, wire.unpack(body, wire.FRAME)["t"]


@pytest.mark.parametrize("offset", [-1, -64, 300, 2**63, 2**64 + 5, "n/a", None, True, 1.0])
def test_offsets_outside_the_body(offset):
    body, _ = _framed({})
    t = {"dtype": "<f4", "shape": [4], "offset": offset, "nbytes": 16}
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(t, body)
    assert info.value.code == "bad_tensor"


@given(st.integers(1, 64))
def test_tensor_running_past_the_end(over):
    body, _ = _framed({}, bytes(128))
    body += bytes(-len(body) % wire.ALIGN)
    t = {"dtype": "<f4", "shape": [16], "offset": len(body) - 64 + over, "nbytes": 64}
    with pytest.raises(wire.WireError, match="outside"):
        wire.decode_tensor(t, body)
    t["offset"] = len(body) - 64  # exactly at the end is fine
    assert wire.decode_tensor(t, body).shape == (16,)


@pytest.mark.parametrize("nbytes", [0, 15, 17, 32, -16, True, 16.0, "16"])
def test_nbytes_mismatch(nbytes):
    body, t = _framed({"dtype": "<f4", "shape": [4], "offset": 64, "nbytes": nbytes})
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(t, body)
    assert info.value.code == "bad_tensor"


@pytest.mark.parametrize("size", [0, 3, 5, 8])
def test_inline_data_length_mismatch(size):
    with pytest.raises(wire.WireError, match="needs 4 bytes"):
        wire.decode_tensor({"dtype": "<i4", "shape": [], "data": bytes(size)})


@pytest.mark.parametrize("data", ["abcd", 1234, [1, 2, 3, 4], None])
def test_inline_data_must_be_bin(data):
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor({"dtype": "|u1", "shape": [4], "data": data})
    assert info.value.code == "bad_tensor"


def test_framed_tensor_without_a_body():
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor({"dtype": "|u1", "shape": [4], "offset": 64, "nbytes": 4}, None)
    assert info.value.code == "bad_tensor"


BAD_DTYPES = [
    "O",
    "<c8",
    "<f3",
    "|f4",
    ">u1",
    "<u1",
    "<b1",
    "<f16",
    "<V4",
    "f4",
    "=f4",
    "<F4",
    " <f4",
    "<f4 ",
    "<f4\n",
    "<i8\x00",
    "<U4",
    "float32",
    "",
    "<",
    "<f",
    4,
    4.0,
    None,
    True,
    b"<f4",
    ["<f4"],
    {"<f4": 1},
]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=repr)
@pytest.mark.parametrize("inline", [True, False])
def test_bad_dtypes(dtype, inline):
    t = {"dtype": dtype, "shape": [1]}
    t.update({"data": bytes(8)} if inline else {"offset": 0, "nbytes": 8})
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(t, bytes(64))
    assert info.value.code == "bad_tensor"
    with pytest.raises(wire.WireError):
        wire.parse_dtype(dtype)


@given(
    st.text(max_size=6)
    | dtype_strings()
    | dtype_strings().map(lambda s: s.upper())
    | st.sampled_from([BFLOAT16, BFLOAT16.upper(), ">bf2", "|bf2", "bf2", "<bf4"])
)
def test_parse_dtype_accepts_exactly_the_list(text):
    valid = {o + ks for ks in wire.DTYPES for o in ("|" if ks.endswith("1") else "<>")}
    if text == BFLOAT16:  # the one dtype off DTYPES (ml_dtypes, installed with the tests)
        assert wire.parse_dtype(text) == np.dtype(ml_dtypes.bfloat16)
    elif text in valid:
        assert wire.parse_dtype(text).str == text
    else:
        with pytest.raises(wire.WireError):
            wire.parse_dtype(text)


BAD_SHAPES = [
    [-1],
    [2, -3],
    [True],
    [1, False],
    [1.0],
    [2.5],
    ["2"],
    [None],
    [[2]],
    [1] * (wire.MAX_NDIM + 1),
    "ab",
    3,
    None,
    {"0": 1},
    b"\x01",
    [0, 2**63],
    [0, 2**62, 2**62],
    [2**64],
    [2**70, 0],
]


@pytest.mark.parametrize("shape", BAD_SHAPES, ids=repr)
@pytest.mark.parametrize("inline", [True, False])
def test_bad_shapes(shape, inline):
    t = {"dtype": "<f4", "shape": shape}
    t.update({"data": b""} if inline else {"offset": 0, "nbytes": 0})
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(t, bytes(64))
    assert info.value.code == "bad_tensor"


def test_shape_at_the_dimension_limit():
    t = {"dtype": "|u1", "shape": [1] * wire.MAX_NDIM, "data": b"\x05"}
    assert wire.decode_tensor(t).shape == (1,) * wire.MAX_NDIM


@pytest.mark.parametrize("body", [b"\x01", b"\xa3abc", b"\x92\x01\x02", b"\xc0"])
@pytest.mark.parametrize("frame", [False, True])
def test_message_must_be_a_map(body, frame):
    if frame:
        body = struct.pack("<4sI", wire.FRAME_MAGIC, len(body)) + body
    with pytest.raises(wire.WireError, match="map") as info:
        wire.unpack(body, wire.FRAME if frame else wire.MSGPACK)
    assert info.value.code == "bad_request"


def test_tensors_of_names_the_bad_variable():
    with pytest.raises(wire.WireError) as info:
        wire.tensors_of(
            {
                "ok": {"dtype": "|u1", "shape": [1], "data": b"x"},
                "bad": {"dtype": "<f3", "shape": [1], "data": b"x"},
            },
            None,
            "grads",
        )
    assert info.value.code == "bad_tensor"
    assert info.value.details["variable"] == "bad"
    assert str(info.value).startswith("bad: ")
    for bad in ([1, 2], "x", None, {1: {"dtype": "|u1", "shape": [], "data": b"x"}}):
        with pytest.raises(wire.WireError, match="grads") as info:
            wire.tensors_of(bad, None, "grads")
        assert info.value.code == "bad_request"


@pytest.mark.parametrize(
    "ctype",
    [
        "application/json",
        "text/plain",
        "",
        None,
        "application/msgpackx",
        "application/x-msgpack",
        "multipart/form-data; boundary=x",
    ],
)
def test_unsupported_content_type(ctype):
    body, _ = _valid(False)
    with pytest.raises(wire.WireError) as info:
        wire.unpack(body, ctype)
    assert info.value.code == "unsupported_media_type"
    assert wire.ERROR_STATUS[info.value.code] == 415
    assert wire.MSGPACK in info.value.message  # says what to send instead


@pytest.mark.parametrize(
    "ctype", ["Application/MsgPack", "application/msgpack; charset=binary", " application/msgpack "]
)
def test_content_type_parameters_and_case_are_ignored(ctype):
    body, _ = _valid(False)
    assert set(wire.unpack(body, ctype)) == {"grads"}


def test_error_payload_shape():
    details = {"missing": ["w"]}
    p = wire.error_payload("not_found", "create it with init first", details)
    assert p == {
        "error": {
            "code": "not_found",
            "message": "create it with init first",
            "details": {"missing": ["w"]},
        }
    }
    assert p["error"]["details"] is not details  # a copy: the caller's map is not shared
    assert wire.error_payload("bad_request", "m") == {
        "error": {"code": "bad_request", "message": "m", "details": {}}
    }
    # travels as msgpack (data plane) and JSON (inspection)
    assert msgpack.unpackb(msgpack.packb(p), raw=False) == p
    assert json.loads(json.dumps(p)) == p


def test_error_codes_map_to_statuses():
    assert all(isinstance(s, int) and 400 <= s < 600 for s in wire.ERROR_STATUS.values())
    for code in (
        "bad_request",
        "not_found",
        "conflict",
        "too_large",
        "unsupported_media_type",
        "not_owner",
        "fleet_mismatch",
        "bad_tensor",
        "overloaded",
        "unavailable",
    ):
        assert code in wire.ERROR_STATUS  # every code PROTOCOL.md §2 lists
    assert wire.WireError("m").code == "bad_request"
    assert isinstance(wire.WireError("m"), ValueError)


# --------------------------------------------------------------------------- tensor tables


def _contiguous(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else a.copy(order="C")


def _table_round_trip(rows, body_type=bytes):
    arrs = [None if a is None else _contiguous(a) for a in rows]
    names = [f"v{i}" for i in range(len(arrs))]
    table = {"names": names, "versions": list(range(len(arrs)))}
    enc = wire.encode_table({"table": table, "other": 1}, table, arrs)
    assert enc.content_type == wire.FRAME
    joined = enc.join()
    assert len(joined) == enc.nbytes
    body = body_type(joined)
    msg = wire.unpack(body, wire.FRAME)
    return arrs, enc, body, msg


@given(
    st.lists(arrays(max_side=4, max_dims=3) | st.none(), max_size=8),
    st.sampled_from([bytes, bytearray]),
)
def test_table_round_trip_is_exact_and_copy_free(rows, body_type):
    arrs, _enc, body, msg = _table_round_trip(rows, body_type)
    assert msg["other"] == 1 and msg["table"]["versions"] == list(range(len(arrs)))
    names, out = wire.table_rows(msg["table"], body)
    assert names == [f"v{i}" for i in range(len(arrs))]
    for got, a in zip(out, arrs):
        if a is None:
            assert got is None
            continue
        _same(got, a)
        if a.nbytes:
            assert np.shares_memory(got, _u8(body))
        assert got.flags.writeable == (body_type is bytearray)


@given(st.lists(arrays(max_side=4, max_dims=3) | st.none(), max_size=8))
def test_table_layout_follows_the_protocol_text(rows):
    """Decoded the way docs/PROTOCOL.md describes it, independently of table_rows: after the
    header, each tensor of a row with a dtype in row order, each at the next multiple of 64,
    zero padding in between; the body ends where the last tensor ends."""
    arrs, enc, body, msg = _table_round_trip(rows)
    table = msg["table"]
    assert set(table) == {"names", "versions", "dtype", "shape"}
    _, hlen = struct.unpack_from("<4sI", body)
    pos = 8 + hlen
    for a, dtype, shape in zip(arrs, table["dtype"], table["shape"]):
        if a is None:
            assert dtype is None and shape is None
            continue
        assert dtype == a.dtype.str and shape == list(a.shape)
        start = -(-pos // 64) * 64
        assert body[pos:start] == bytes(start - pos)
        assert body[start : start + a.nbytes] == a.tobytes()
        pos = start + a.nbytes
    assert pos == len(body)
    for a in arrs:  # the arrays' own memory is handed to the writer
        if a is not None and a.nbytes:
            assert any(
                isinstance(c, memoryview) and np.shares_memory(_u8(c), a) for c in enc.chunks
            )


def test_table_native_converts_the_other_byte_order():
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    little = np.arange(3, dtype="<i8")
    _arrs, _, body, msg = _table_round_trip([big, little])
    _, (as_sent, _same) = wire.table_rows(msg["table"], body)
    assert as_sent.dtype.str == ">f4" and np.shares_memory(as_sent, _u8(body))
    _, (native, same2) = wire.table_rows(msg["table"], body, native=True)
    assert native.dtype.isnative and not native.flags.writeable
    np.testing.assert_array_equal(native, big)
    assert np.shares_memory(same2, _u8(body))
    # decoded row by row (the other byte order): no block, the same rows
    _, (native3, same3), block = wire.table_rows(msg["table"], body, native=True, with_block=True)
    assert block is None and np.array_equal(native3, big) and np.array_equal(same3, little)


def test_table_with_block_gives_same_shaped_rows_as_one_view():
    rows = [np.full((2, 3), i, np.float32) for i in range(4)]
    _, _, body, msg = _table_round_trip(rows)
    _names, out, block = wire.table_rows(msg["table"], body, with_block=True)
    assert block.shape == (4, 2, 3) and np.shares_memory(block, _u8(body))
    assert all(np.array_equal(a, b) and np.shares_memory(a, b) for a, b in zip(out, block))
    assert len(wire.table_rows(msg["table"], body)) == 2


def _table_refusal(table, body, code, variable=None):
    with pytest.raises(wire.WireError) as err:
        wire.table_rows(table, body)
    assert err.value.code == code, err.value
    if variable is not None:
        assert err.value.details.get("variable") == variable
    return err.value


def test_bad_tables_are_refused_with_what_is_wrong():
    _arrs, _, body, msg = _table_round_trip([np.arange(4, dtype=np.float32), None])
    good = msg["table"]
    _table_refusal([1, 2], body, "bad_request")
    _table_refusal({**good, "names": "v0"}, body, "bad_request")
    _table_refusal({**good, "names": ["v0", 1]}, body, "bad_request")
    _table_refusal({**good, "dtype": ["<f4"]}, body, "bad_request")
    _table_refusal({k: v for k, v in good.items() if k != "shape"}, body, "bad_request")
    _table_refusal({**good, "dtype": ["<c8", None]}, body, "bad_tensor", "v0")
    _table_refusal({**good, "shape": [[-1], None]}, body, "bad_tensor", "v0")
    _table_refusal({**good, "shape": ["4", None]}, body, "bad_tensor", "v0")
    _table_refusal({**good, "shape": [[4], [1]]}, body, "bad_tensor", "v1")  # shape, no dtype
    err = _table_refusal({**good, "shape": [[5], None]}, body, "bad_tensor", "v0")
    assert "v0" in err.message  # runs past the end of the body
    _table_refusal(good, body[:-4], "bad_tensor", "v0")  # truncated body
    _table_refusal(good, body[:6], "bad_request")  # not even a frame prefix


@given(
    st.lists(st.one_of(st.none(), dtype_strings(), msgpack_values), max_size=4),
    st.lists(
        st.one_of(st.none(), st.lists(st.integers(-3, 2**40), max_size=3), msgpack_values),
        max_size=4,
    ),
    st.binary(max_size=300),
)
def test_arbitrary_tables_raise_only_wire_errors(dtypes, shapes, tail):
    n = min(len(dtypes), len(shapes))
    table = {"names": [f"v{i}" for i in range(n)], "dtype": dtypes[:n], "shape": shapes[:n]}
    head = msgpack.packb({"table": table}, use_bin_type=True)
    body = struct.pack("<4sI", wire.FRAME_MAGIC, len(head)) + head + tail
    try:
        _, out = wire.table_rows(wire.unpack(body, wire.FRAME)["table"], body)
    except wire.WireError as exc:
        assert exc.code in PROTOCOL_CODES
    else:
        assert len(out) == n


def test_a_table_without_names_takes_them_from_the_caller():
    arrs, _, body, msg = _table_round_trip([np.arange(4, dtype=np.float32), None])
    table = {k: v for k, v in msg["table"].items() if k != "names"}
    names, rows = wire.table_rows(table, body, names=["x", "y"])
    assert names == ["x", "y"] and rows[1] is None
    np.testing.assert_array_equal(rows[0], arrs[0])
    _table_refusal(table, body, "bad_request")  # no names anywhere
    with pytest.raises(wire.WireError):
        wire.table_rows(table, body, names=["x"])  # a column longer than the names


@st.composite
def uniform_rows(draw) -> list[np.ndarray | None]:
    """Two to six tensors of one dtype and one shape (a step's same-shaped variables), which
    table_rows decodes as one strided view, and encode_table lays out at one stride; now and
    then a row without a tensor, which takes both off that path."""
    dtype = np.dtype(draw(dtype_strings()))
    shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=20))
    rows: list[np.ndarray | None] = [
        _random_array(draw, dtype, shape) for _ in range(draw(st.integers(2, 6)))
    ]
    if draw(st.integers(0, 4)) == 0:
        rows[draw(st.integers(0, len(rows) - 1))] = None
    return rows


def _rows_the_general_way(table, body, names):
    """table_rows' result, row by row through decode_tensor, as PROTOCOL.md lays it out."""
    _, hlen = struct.unpack_from("<4sI", body)
    pos, out = 8 + hlen, []
    for dtype, shape in zip(table["dtype"], table["shape"]):
        if dtype is None:
            out.append(None)
            continue
        start = -(-pos // 64) * 64
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        out.append(
            wire.decode_tensor(
                {"dtype": dtype, "shape": shape, "offset": start, "nbytes": nbytes}, body
            )
        )
        pos = start + nbytes
    return out


@given(uniform_rows(), st.sampled_from([bytes, bytearray]), st.booleans())
def test_same_shaped_rows_decode_as_any_others(rows, body_type, native):
    """Rows of one dtype and shape come back as the general decoding gives them: same dtype,
    shape and bytes, views of the body (writable exactly when it is), each its own tensor."""
    arrs, _, body, msg = _table_round_trip(rows, body_type)
    names, out = wire.table_rows(msg["table"], body, native=native)
    expected = _rows_the_general_way(msg["table"], body, names)
    assert len(out) == len(arrs)
    for got, want, a in zip(out, expected, arrs):
        if a is None:
            assert got is None
            continue
        if native and not a.dtype.isnative:
            np.testing.assert_array_equal(got, a)
            assert got.dtype.isnative and not got.flags.writeable
            continue
        _same(got, want)
        _same(got, a)
        if a.nbytes:
            assert np.shares_memory(got, _u8(body))
        assert got.flags.writeable == (body_type is bytearray)
    if out[0] is not None and out[0].flags.writeable and out[0].size:
        out[0].reshape(-1).view(np.uint8)[:] = 0xAB  # rows are distinct tensors
        assert all(got is None or got.tobytes() == a.tobytes() for got, a in zip(out[1:], arrs[1:]))


def test_same_shaped_rows_are_checked_as_strictly_as_any_others():
    """A shape that equals the others only as a number (1.0 or True for 1) is refused as it
    would be in any table, naming its row; so is a body that ends before the last row."""
    rows = [np.arange(4, dtype=np.float32) for _ in range(3)]
    _, _, body, msg = _table_round_trip(rows)
    good = msg["table"]
    _names, out = wire.table_rows(good, body)
    assert [r.tolist() for r in out] == [[0.0, 1.0, 2.0, 3.0]] * 3
    _table_refusal({**good, "shape": [[4], [4.0], [4]]}, body, "bad_tensor", "v1")
    ones = [np.ones(1, dtype=np.float32)] * 2
    _, _, body1, msg1 = _table_round_trip(ones)
    _table_refusal({**msg1["table"], "shape": [[1], [True]]}, body1, "bad_tensor", "v1")
    _table_refusal(good, body[:-4], "bad_tensor", "v2")


@given(st.one_of(uniform_rows(), st.lists(arrays(max_side=4, max_dims=3) | st.none(), max_size=6)))
def test_arrays_as_chunks_encode_the_same_bytes(rows):
    """encode_table(arrays_as_chunks=True) (what a shard hands a vectored write): the same
    bytes and size as the usual encoding, with the arrays themselves among the chunks."""
    arrs = [None if a is None else _contiguous(a) for a in rows]
    t1 = {"versions": list(range(len(arrs)))}
    t2 = dict(t1)
    usual = wire.encode_table({"table": t1}, t1, arrs)
    raw = wire.encode_table({"table": t2}, t2, arrs, arrays_as_chunks=True)
    joined = b"".join(raw.chunks)  # bytes.join takes any C-contiguous buffer
    assert joined == usual.join() and raw.nbytes == usual.nbytes == len(joined)
    for a in arrs:
        if a is not None and a.nbytes:
            assert any(c is a for c in raw.chunks)


# ------------------------------------------------------------- tables with one dtype and shape


@given(
    st.one_of(uniform_rows(), st.lists(arrays(max_side=4, max_dims=3) | st.none(), max_size=6)),
    st.sampled_from([bytes, bytearray]),
    st.booleans(),
    st.booleans(),
)
def test_a_uniform_table_decodes_as_its_columns_do(rows, body_type, native, as_chunks):
    """encode_table(uniform=True): a table whose rows all hold a tensor of one dtype and shape
    carries that dtype and shape once (``uniform``) instead of two columns, the tensors laid
    out exactly as with the columns; it decodes to the same rows, views of the body; any other table
    keeps its columns."""
    arrs = [None if a is None else _contiguous(a) for a in rows]
    t1 = {"versions": list(range(len(arrs)))}
    t2 = dict(t1)
    columns = wire.encode_table({"table": t1}, t1, arrs)
    compact = wire.encode_table({"table": t2}, t2, arrs, arrays_as_chunks=as_chunks, uniform=True)
    same = len(arrs) > 1 and all(
        a is not None and a.dtype == arrs[0].dtype and a.shape == arrs[0].shape for a in arrs
    )
    assert ("uniform" in t2) == same and ("dtype" in t2) == (not same)
    body = body_type(b"".join(compact.chunks))
    assert len(body) == compact.nbytes
    names = [f"v{i}" for i in range(len(arrs))]
    table = wire.unpack(body, wire.FRAME)["table"]
    if same:
        assert set(table) == {"versions", "uniform"}
        assert table["uniform"] == {"dtype": arrs[0].dtype.str, "shape": list(arrs[0].shape)}

        # the tensors are laid out as with the columns, from the first multiple of 64 after
        # the (shorter) header on
        def tensors(data: bytes) -> bytes:
            return data[-(-(8 + struct.unpack_from("<4sI", data)[1]) // 64) * 64 :]

        assert tensors(bytes(body)) == tensors(columns.join())
    _, got, block = wire.table_rows(table, body, names=names, native=native, with_block=True)
    _, want = wire.table_rows(
        wire.unpack(columns.join(), wire.FRAME)["table"], columns.join(), names=names, native=native
    )
    assert len(got) == len(want) == len(arrs)
    for g, w, a in zip(got, want, arrs):
        if a is None:
            assert g is None and w is None
            continue
        assert g.dtype == w.dtype and g.shape == a.shape and g.tobytes() == w.tobytes()
        if a.nbytes and (a.dtype.isnative or not native):
            assert np.shares_memory(g, _u8(body))
            assert g.flags.writeable == (body_type is bytearray)
        else:
            assert not g.flags.writeable or not g.size
    if same and block is not None:
        assert block.shape == (len(arrs), *arrs[0].shape)
        assert all(r.tobytes() == b.tobytes() for r, b in zip(got, block))


@given(uniform_rows(), st.sampled_from([bytes, bytearray]), st.booleans(), st.booleans())
def test_a_packed_uniform_table_has_its_rows_one_after_another(rows, body_type, native, as_chunks):
    """encode_table(uniform=True, packed=True): a uniform table's rows follow one another
    with no padding (``"packed": true`` in its ``uniform`` map), the first where it would be
    anyway; one chunk per row, not two; it decodes to the same rows, views of the body. Any
    other table is laid out as without ``packed``."""
    arrs = [None if a is None else _contiguous(a) for a in rows]
    names = [f"v{i}" for i in range(len(arrs))]
    t1, t2 = {}, {}
    padded = wire.encode_table({"table": t1}, t1, arrs, arrays_as_chunks=as_chunks, uniform=True)
    packed = wire.encode_table(
        {"table": t2}, t2, arrs, arrays_as_chunks=as_chunks, uniform=True, packed=True
    )
    body = body_type(b"".join(packed.chunks))
    assert len(body) == packed.nbytes
    if "uniform" not in t1:
        assert t2 == t1 and packed.join() == padded.join()
        return
    assert t2["uniform"] == {**t1["uniform"], "packed": True}
    size = arrs[0].nbytes
    first = -(-(8 + struct.unpack_from("<4sI", bytes(body))[1]) // 64) * 64
    assert len(body) == (first + len(arrs) * size if size else len(body))
    if size:
        assert bytes(body[first:]) == b"".join(a.tobytes() for a in arrs)
        assert len(packed.chunks) == len(padded.chunks) - (len(arrs) - 1) * bool(-size % 64)
    table = wire.unpack(body, wire.FRAME)["table"]
    _, got, block = wire.table_rows(table, body, names=names, native=native, with_block=True)
    for g, a in zip(got, arrs):
        assert g.dtype.newbyteorder("=") == a.dtype.newbyteorder("=") and g.shape == a.shape
        assert np.array_equal(g, a, equal_nan=True)
        if size and (a.dtype.isnative or not native):
            assert np.shares_memory(g, _u8(body))
    if block is not None:
        assert all(r.tobytes() == b.tobytes() for r, b in zip(got, block))


@pytest.mark.parametrize("size", [5, 16])  # 20 bytes (packed only), 64 (side by side anyway)
def test_rows_already_laid_out_go_as_one_chunk(size):
    """encode_table(laid_out=...): the rows' bytes already side by side in one buffer are the
    rows' one chunk, where the table's rows lie side by side (packed, or a multiple of 64
    bytes each); the body is the same as from the rows. Elsewhere, or if its size is not
    the rows', it is not used."""
    rows = [np.full(size, i, np.float32) for i in range(3)]
    block = np.concatenate(rows)
    for packed in (True, False):
        t1, t2 = {}, {}
        plain = wire.encode_table(
            {"table": t1}, t1, rows, arrays_as_chunks=True, uniform=True, packed=packed
        )
        laid = wire.encode_table(
            {"table": t2},
            t2,
            rows,
            arrays_as_chunks=True,
            uniform=True,
            packed=packed,
            laid_out=block,
        )
        assert laid.join() == plain.join() and t1 == t2
        side_by_side = packed or size * 4 % 64 == 0
        assert any(c is block for c in laid.chunks) == side_by_side
        assert len(laid.chunks) == (len(plain.chunks) - 2 if side_by_side else len(plain.chunks))
    t = {}
    short = wire.encode_table(
        {"table": t}, t, rows, arrays_as_chunks=True, uniform=True, packed=True, laid_out=block[:-1]
    )
    assert sum(isinstance(c, np.ndarray) for c in short.chunks) == 3  # the rows themselves


def test_a_uniform_table_is_checked_as_strictly_as_columns():
    rows = [np.arange(4, dtype=np.float32) for _ in range(3)]
    t = {}
    enc = wire.encode_table({"table": t}, t, rows, uniform=True)
    body = enc.join()
    good = wire.unpack(body, wire.FRAME)["table"]
    names = ["a", "b", "c"]
    assert [r.tolist() for r in wire.table_rows(good, body, names=names)[1]] == [[0, 1, 2, 3]] * 3

    def refused(table, data=body, code="bad_tensor"):
        with pytest.raises(wire.WireError) as err:
            wire.table_rows(table, data, names=names)
        assert err.value.code == code, err.value
        return err.value.message

    assert "uniform" in refused({"uniform": "<f4"}, code="bad_request")
    assert "uniform" in refused({**good, "dtype": ["<f4"] * 3}, code="bad_request")
    assert "uniform" in refused({**good, "shape": [[4]] * 3}, code="bad_request")
    for dtype in ("<c8", "f4", 4, None):
        assert "uniform" in refused({"uniform": {"dtype": dtype, "shape": [4]}})
    for shape in ([-1], [4.0], [True], "4", None, [1] * 33):
        assert "uniform" in refused({"uniform": {"dtype": "<f4", "shape": shape}})
    assert "past the end" in refused({"uniform": {"dtype": "<f4", "shape": [5]}})
    assert "past the end" in refused(good, body[:-4])
    for packed in (1, "yes", [True]):
        assert "packed" in refused(
            {"uniform": {**good["uniform"], "packed": packed}}, code="bad_request"
        )
    for absent in (None, False):  # as without it
        same = {"uniform": {**good["uniform"], "packed": absent}}
        assert [r.tolist() for r in wire.table_rows(same, body, names=names)[1]] == [
            [0, 1, 2, 3]
        ] * 3
    # Packed rows lie at their own size's stride: three of 48 bytes end where the padded
    # rows of 16 end (two strides of 64 and 16), padded ones of 48 would run past it.
    assert "past the end" in refused({"uniform": {"dtype": "<f4", "shape": [12]}})
    packed = {"uniform": {"dtype": "<f4", "shape": [12], "packed": True}}
    assert [r.size for r in wire.table_rows(packed, body, names=names)[1]] == [12] * 3
    assert "past the end" in refused(packed, body[:-4])
    refused(good, body[:6], code="bad_request")  # not even a frame prefix
    # no bytes at all: tensors of size zero, and 0-d tensors (arrays, not numpy scalars)
    _, empty = wire.table_rows({"uniform": {"dtype": "<i8", "shape": [2, 0]}}, body, names=names)
    assert [e.shape for e in empty] == [(2, 0)] * 3
    t = {}
    scalars = [np.array(float(i), np.float64) for i in range(3)]
    enc = wire.encode_table({"table": t}, t, scalars, uniform=True)
    _, got = wire.table_rows(t, enc.join(), names=names)
    assert all(type(g) is np.ndarray and g.shape == () and g == i for i, g in enumerate(got))


@given(msgpack_values, msgpack_values, st.integers(0, 5), st.binary(max_size=300))
def test_arbitrary_uniform_tables_raise_only_wire_errors(dtype, shape, n, tail):
    table = {"uniform": {"dtype": dtype, "shape": shape}}
    head = msgpack.packb({"table": table}, use_bin_type=True)
    body = struct.pack("<4sI", wire.FRAME_MAGIC, len(head)) + head + tail
    try:
        _, out = wire.table_rows(
            wire.unpack(body, wire.FRAME)["table"], body, names=[f"v{i}" for i in range(n)]
        )
    except wire.WireError as exc:
        assert exc.code in PROTOCOL_CODES
    else:
        assert len(out) == n


# ------------------------------------------- the layout a shard checks (decoding with whole)


@given(
    st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), arrays(max_side=5), max_size=6)
)
def test_framed_messages_end_where_their_last_tensor_ends(grads):
    """What the encoder frames is what a shard takes whole: every offset a multiple of 64
    after the header, no byte after the last tensor."""
    _enc, body, got = _round_trip({"seq": 1, "grads": grads}, True)
    decoded = wire.tensors_of(got["grads"], body, "grads", whole=True)
    for name, a in grads.items():
        _same(decoded[name], a)
        assert got["grads"][name]["offset"] % wire.ALIGN == 0
    with pytest.raises(wire.WireError, match="past the end"):
        wire.tensors_of(got["grads"], body + b"\0", "grads", whole=True)


@given(
    st.lists(arrays(max_side=4, max_dims=3) | st.none(), max_size=8),
    st.sampled_from(["columns", "uniform", "packed"]),
    st.booleans(),
)
def test_tables_end_where_their_last_tensor_ends(rows, form, as_chunks):
    """Tables as the encoder lays them out, in every form, are taken whole; a byte more is
    refused."""
    if form != "columns" and rows:  # rows of one dtype and shape: the uniform forms
        first = rows[0] if rows[0] is not None else np.zeros(3, np.float32)
        rows = [first.copy() for _ in rows]
    arrs = [None if a is None else _contiguous(a) for a in rows]
    table: dict = {"names": [f"v{i}" for i in range(len(arrs))]}
    enc = wire.encode_table(
        {"t": table},
        table,
        arrs,
        uniform=form != "columns",
        packed=form == "packed",
        arrays_as_chunks=as_chunks,
    )
    body = b"".join(bytes(memoryview(c).cast("B")) for c in enc.chunks)
    assert len(body) == enc.nbytes
    msg = wire.unpack(body, wire.FRAME)
    _, out = wire.table_rows(msg["t"], body, whole=True)
    for got, a in zip(out, arrs):
        assert (got is None) == (a is None)
        if a is not None:
            _same(got, a)
    with pytest.raises(wire.WireError, match="past the end"):
        wire.table_rows(msg["t"], body + b"\0", whole=True)


def test_framed_offsets_off_the_64_byte_grid_are_refused():
    body, _ = _framed({}, bytes(256))
    body += bytes(-len(body) % wire.ALIGN)
    start = len(body) - 128
    t = {"dtype": "<f4", "shape": [4], "offset": start + 4, "nbytes": 16}
    with pytest.raises(wire.WireError, match="multiple of 64") as info:
        wire.decode_tensor(t, body)
    assert info.value.code == "bad_tensor"
    t["offset"] = start
    assert wire.decode_tensor(t, body).shape == (4,)


# --------------------------------------------------------------------------- names spelled once

#: The one module that spells the protocol's names; every other module of the SDK and the
#: shard refers to its constants.
NAMES_MODULE = ROOT / "client_sdk" / "wire" / "constants.py"
#: A literal that is one of these is a name of the protocol (a header, an environment
#: variable, a content type, the frame's prefix).
WIRE_NAME = re.compile(
    r"(?i:x-paramshard-[a-z-]+|application/(msgpack|x-paramshard-frame|json))"
    r"|PARAMSHARD_[A-Z_]*|PSF1|<4sI"
)


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """Every str or bytes constant of the module but its docstrings, with its line."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings:
            value = node.value
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            if isinstance(value, str):
                out.append((node.lineno, value))
    return out


def test_the_protocols_names_are_spelled_once():
    """Header names, environment variable names, content types and the frame's prefix are
    each written once, in client_sdk/wire: a literal elsewhere in the SDK or the shard that is
    such a name is a second spelling that can drift from the first."""
    spelled: dict[str, list[str]] = {}
    for package in ("client_sdk", "server"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, value in _literals(ast.parse(path.read_text(), str(path))):
                if WIRE_NAME.fullmatch(value):
                    where = f"{path.relative_to(ROOT)}:{line}"
                    spelled.setdefault(value.lower(), []).append(where)
    elsewhere = {
        name: places
        for name, places in spelled.items()
        if any(not p.startswith(str(NAMES_MODULE.relative_to(ROOT)) + ":") for p in places)
    }
    assert not elsewhere, f"use client_sdk.wire's constants instead of these literals: {elsewhere}"
    for name, places in spelled.items():
        assert len(places) == 1, f"{name!r} is spelled {len(places)} times: {places}"
