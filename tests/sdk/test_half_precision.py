"""``PSClient(wire_dtype=...)``: float32 values and gradients, and embedding-table rows and
their gradients, travel as float16 or bfloat16 (docs/PROTOCOL.md §3 pull, "Half precision";
§3 Embedding tables, "Half precision for rows"), against a real 2-shard fleet.

What a half-precision pull gives is compared with the float32 value rounded to the wire dtype
(numpy's float16 cast and ml_dtypes' bfloat16 cast round to nearest, ties to even) and back:
equal bit for bit. A push's gradient arrives as that rounding of it, which an SGD step with
lr 1 shows exactly. The bytes on the wire are read off the replies (their Content-Length), and
what a refused request leaves is read back with a float32 client.
"""

from __future__ import annotations

import sys
import threading
import uuid

import httpx2
import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadTensorError,
    ConfigError,
    ProtocolError,
    PSClient,
    wire,
)
from client_sdk.embedding import Normal, segment_sum
from client_sdk.optimizers import SGD
from client_sdk.placement import shard_for
from client_sdk.wire import halves, tensors
from tests.conftest import OnLoop
from tests.sdk.test_client import AsIfOlder

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def fresh(prefix: str = "h") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def on_both(prefix: str) -> list[str]:
    """Two fresh names, one on each shard of a 2-shard fleet."""
    names: dict[int, str] = {}
    while len(names) < 2:
        name = fresh(prefix)
        names.setdefault(shard_for(name, 2), name)
    return [names[0], names[1]]


def rounded(value: np.ndarray, wire_dtype: str) -> np.ndarray:
    return value.astype(DTYPES[wire_dtype]).astype(np.float32)


class Sizes(httpx2.BaseTransport):
    """Real HTTP, recording the Content-Length of every reply to ``paths``."""

    def __init__(self, paths: tuple[str, ...] = ("/v1/pull", "/v1/poll")) -> None:
        self.inner = httpx2.HTTPTransport()
        self.paths = paths
        self.replies: list[int] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        if request.url.path in self.paths:
            self.replies.append(int(response.headers["content-length"]))
        return response

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_a_pull_gets_the_values_rounded_to_the_wire_dtype_in_half_the_bytes(fleet2, wire_dtype):
    names = on_both(f"pull-{wire_dtype}")
    rng = np.random.default_rng(1)
    values = {n: (rng.standard_normal((300, 100)) * 100).astype(np.float32) for n in names}
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init(values, optimizer=SGD(lr=1.0))
        whole = Sizes()
        with PSClient(fleet2.urls, worker_id=fresh("w"), transport=whole) as plain:
            plain.pull(names)
        half = Sizes()
        with PSClient(
            fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype, transport=half
        ) as hp:
            got = hp.pull(names)
            for n in names:
                assert got[n].dtype == np.float32 and not got[n].flags.writeable
                np.testing.assert_array_equal(got[n], rounded(values[n], wire_dtype))
            assert hp.pull(names)[names[0]] is got[names[0]]  # unchanged: from the cache
    # 120,000 bytes of float32 per shard: about half of it on the wire
    assert all(h < w * 0.55 for h, w in zip(sorted(half.replies[:2]), sorted(whole.replies)))


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_a_push_applies_the_gradient_rounded_to_the_wire_dtype(fleet2, wire_dtype):
    names = on_both(f"push-{wire_dtype}")
    rng = np.random.default_rng(2)
    grads = {n: rng.standard_normal(1000).astype(np.float32) for n in names}
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype) as ps:
        ps.init({n: np.zeros(1000, np.float32) for n in names}, optimizer=SGD(lr=1.0))
        result = ps.push(grads)
        assert all(result[n]["status"] == "applied" for n in names)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
        got = plain.pull(names)
    for n in names:
        np.testing.assert_array_equal(got[n], -rounded(grads[n], wire_dtype))


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_big_pushes_one_after_another_each_apply_their_own_gradient(fleet2, wire_dtype):
    """Gradients big enough to be applied off the shard's event loop, widened there into
    memory the loop handed out: each push applies its own, and one with a NaN is refused
    whole with nothing applied."""
    from server.store.apply import OFFLOAD_BYTES  # the shard's threshold, in wire bytes

    name = fresh(f"big-{wire_dtype}")
    n = OFFLOAD_BYTES // 2 + 4096
    steps = [np.full(n, 0.5, np.float32), np.linspace(-2, 2, n, dtype=np.float32)]
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype) as ps:
        ps.init({name: np.zeros(n, np.float32)}, optimizer=SGD(lr=1.0))
        for grad in steps:
            assert ps.push({name: grad})[name]["status"] == "applied"
        bad = steps[1].copy()
        bad[n // 2] = np.nan
        with pytest.raises(BadTensorError, match="NaN"):
            ps.push({name: bad})
    with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
        got = plain.pull([name])[name]
    np.testing.assert_array_equal(
        got, -rounded(steps[0], wire_dtype) - rounded(steps[1], wire_dtype)
    )


def test_other_dtypes_travel_as_they_are(fleet2):
    f64, i64 = fresh("f64"), fresh("i64")
    value = np.random.default_rng(3).standard_normal(50)
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16") as ps:
        ps.init({f64: value}, optimizer=SGD(lr=1.0))
        ps.increment(i64, 7)
        ps.push({f64: np.ones(50)})
        got = ps.pull([f64, i64])
    np.testing.assert_array_equal(got[f64], value - 1)
    assert got[f64].dtype == np.float64 and got[i64] == 7 and got[i64].dtype == np.int64


def test_a_gradient_beyond_float16_is_refused_before_sending_and_nothing_changes(fleet2):
    names = on_both("over-push")
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16") as ps:
        ps.init({n: np.zeros(4, np.float32) for n in names}, optimizer=SGD(lr=1.0))
        big = np.array([1.0, 2.0, 7e4, 3.0], np.float32)
        with pytest.raises(BadTensorError) as caught:
            ps.push({names[0]: np.ones(4, np.float32), names[1]: big})
        assert repr(names[1]) in str(caught.value) and "65504" in str(caught.value)
        assert "bfloat16" in str(caught.value)  # what to do instead
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="bfloat16") as ps:
        ps.push({names[1]: big})  # bfloat16 has float32's range
    with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
        got = plain.pull(names)
        shown = {v["name"]: v["version"] for v in plain.variables() if v["name"] in names}
    np.testing.assert_array_equal(got[names[0]], np.zeros(4))
    assert shown == {names[0]: 0, names[1]: 1}
    np.testing.assert_array_equal(got[names[1]], -rounded(big, "bfloat16"))


def test_a_value_beyond_float16_is_a_clear_error_not_an_infinity(fleet2):
    name, other = on_both("over-pull")
    big = np.array([1.0, -1e6], np.float32)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
        plain.init({name: big, other: np.ones(2, np.float32)})
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16") as ps:
        with pytest.raises(BadTensorError) as caught:
            ps.pull([name, other])
        assert repr(name) in str(caught.value) and "float16" in str(caught.value)
        np.testing.assert_array_equal(ps.pull([other])[other], np.ones(2))
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="bfloat16") as ps:
        np.testing.assert_array_equal(ps.pull([name])[name], rounded(big, "bfloat16"))


def test_the_asyncio_client_and_a_poll_use_it_too(fleet2):
    names = on_both("async")
    value = np.linspace(-3, 3, 200, dtype=np.float32)
    ps = OnLoop(AsyncPSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16"))
    try:
        ps.init({n: value for n in names}, optimizer=SGD(lr=1.0))
        got = ps.pull(names)
        for n in names:
            np.testing.assert_array_equal(got[n], rounded(value, "float16"))
        ps.push({names[1]: np.full(200, 0.1, np.float32)})
        newer = ps.pull(names, newer_than="cached", timeout=20)
        assert list(newer) == [names[1]]
        step = np.float32(np.float16(0.1))
        np.testing.assert_array_equal(newer[names[1]], rounded(value - step, "float16"))
    finally:
        ps.close()


def test_bad_wire_dtypes_are_refused_saying_what_is_allowed(fleet2, monkeypatch):
    for bad in ("float8", "f2", 16, True):
        with pytest.raises(ConfigError, match="float16"):
            PSClient(fleet2.urls, wire_dtype=bad)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if it were not installed
    for parsed in (tensors.PARSED, tensors.PARSED_NATIVE):
        monkeypatch.delitem(parsed, tensors.BFLOAT16, raising=False)
    with pytest.raises(ConfigError, match=r"paramshard\[bfloat16\]"):
        PSClient(fleet2.urls, wire_dtype="bfloat16")
    PSClient(fleet2.urls, wire_dtype="float16").close()  # float16 needs nothing more


@pytest.mark.parametrize(
    ("msg", "accept"),
    [
        ({"wire_dtype": "float8"}, True),
        ({"wire_dtype": 2}, True),
        ({"wire_dtype": "float16", "layout": "map"}, True),
        ({"wire_dtype": "float16"}, False),  # no framed reply accepted: no table
    ],
    ids=["unknown", "not-a-string", "map-layout", "not-framed"],
)
@pytest.mark.parametrize("verb", ["pull", "poll"])
def test_the_shard_refuses_a_bad_wire_dtype_naming_the_field(fleet2, msg, accept, verb):
    name = fresh("raw")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({name: np.ones(3, np.float32)})
    url = fleet2.urls[shard_for(name, 2)]
    body = {"names": [name], "layout": "table", **msg}
    if verb == "poll":
        body["timeout"] = 0
    enc = wire.encode(body)
    headers = {"content-type": enc.content_type}
    if accept:
        headers["accept"] = f"{wire.FRAME}, {wire.MSGPACK}"
    r = httpx2.post(f"{url}/v1/{verb}", content=enc.join(), headers=headers, timeout=30)
    reply = wire.unpack(bytearray(r.content), r.headers["content-type"])
    assert r.status_code == 400, reply
    assert reply["error"]["code"] == "bad_request"
    assert reply["error"]["details"]["field"] == "wire_dtype"


def test_narrow_and_widen_round_to_nearest_even():
    # 1 + 2**-11 lies halfway between two float16s: ties to the even one (1.0)
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65504, -65504, 0.0], np.float32)
    f16, text = halves.narrow(x, "float16")
    assert f16.dtype == np.float16 and text == "<f2"
    np.testing.assert_array_equal(halves.widen(f16), [1.0, 1 + 2**-9, 65504, -65504, 0.0])
    with pytest.raises(wire.WireError) as caught:
        halves.narrow(np.array([65520.0], np.float32), "float16", "g")
    assert caught.value.code == "bad_tensor"
    # bfloat16 goes as its bits: the top 16 of the float32's, rounded to nearest even
    y = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -3e38], np.float32)
    bits, text = halves.narrow(y, "bfloat16")
    assert bits.dtype == np.uint16 and text == "<bf2"
    back = halves.widen(bits.view(DTYPES["bfloat16"]))
    np.testing.assert_array_equal(back, [1.0, 1.0, 1 + 2**-6, rounded(y[3:], "bfloat16")[0]])


# -- embedding-table rows -------------------------------------------------------------------


class LoseReply(httpx2.BaseTransport):
    """Real HTTP; the reply to the first push_rows is lost after the shard applied it."""

    def __init__(self) -> None:
        self.inner = httpx2.HTTPTransport()
        self.lost = 0
        self.sent: list[str] = []  # the dtype of each push_rows' grads

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        if request.url.path == "/v1/push_rows":
            msg = wire.unpack(bytearray(request.read()), request.headers["content-type"])
            self.sent.append(msg["grads"]["dtype"])
            if not self.lost:
                self.lost += 1
                response.read()
                raise httpx2.ReadTimeout("the reply was lost", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_table_rows_travel_in_the_wire_dtype_both_ways(fleet2, wire_dtype):
    table = fresh(f"rows-{wire_dtype}")
    rng = np.random.default_rng(4)
    ids = rng.integers(-(2**62), 2**62, 120)
    ids = np.concatenate([ids, ids[:40]])  # repeats; the rows placed on both shards
    grads = (rng.standard_normal((len(ids), 16)) * 3).astype(np.float32)
    whole, half, lossy = Sizes(("/v1/pull_rows",)), Sizes(("/v1/pull_rows",)), LoseReply()
    with PSClient(fleet2.urls, worker_id=fresh("w"), transport=whole) as plain:
        plain.create_table(table, 16, initializer=Normal(std=50.0), optimizer=SGD(lr=1.0))
        first = plain.pull_rows(table, ids)
        with PSClient(
            fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype, transport=half
        ) as hp:
            got = hp.pull_rows(table, ids)
        assert got.dtype == np.float32 and got.shape == (160, 16)
        np.testing.assert_array_equal(got, rounded(first, wire_dtype))
        # 120 rows of 64 bytes of float32 over the 2 shards: about half of it on the wire
        assert all(h < w * 0.6 for h, w in zip(sorted(half.replies), sorted(whole.replies[:2])))
        with PSClient(
            fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype, transport=lossy
        ) as retried:
            result = retried.push_rows(table, ids, grads)
        assert lossy.lost == 1 and result["duplicate"] == 1  # the retry was not applied again
        assert set(lossy.sent) == {halves.narrow(grads[:1], wire_dtype)[1]}
        unique, summed = segment_sum(ids, grads)  # what the SDK sums, then narrows
        where = {int(i): k for k, i in enumerate(ids)}
        before = first[[where[int(i)] for i in unique]]
        after = plain.pull_rows(table, unique)
    np.testing.assert_array_equal(after, before - rounded(summed, wire_dtype))


def test_table_rows_beyond_float16_are_refused_and_nothing_changes(fleet2, http):
    table = fresh("rows-over")
    ids = np.arange(40)  # on both shards
    with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
        plain.create_table(table, 4, optimizer=SGD(lr=1.0))
        before = plain.pull_rows(table, ids)
    ps = OnLoop(AsyncPSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16"))
    try:
        # each gradient fits float16, but id 7's two sum to 8e4: refused before sending
        grads = np.full((41, 4), 4e4, np.float32)
        with pytest.raises(BadTensorError) as caught:
            ps.push_rows(table, np.append(ids, 7), grads)
        assert repr(table) in str(caught.value) and "65504" in str(caught.value)
        versions = [http.get(f"{u}/v1/tables/{table}").json()["version"] for u in fleet2.urls]
        assert versions == [0, 0]
        np.testing.assert_array_equal(ps.pull_rows(table, ids), rounded(before, "float16"))
        with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
            plain.push_rows(table, [3], np.full((1, 4), -1e5, np.float32))  # row 3: ~1e5
            stored = plain.pull_rows(table, ids)
        with pytest.raises(BadTensorError) as caught:
            ps.pull_rows(table, ids)
        assert repr(table) in str(caught.value) and "float16" in str(caught.value)
    finally:
        ps.close()
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="bfloat16") as bf:
        np.testing.assert_array_equal(bf.pull_rows(table, ids), rounded(stored, "bfloat16"))
    bad = wire.encode({"name": table, "ids": ids, "wire_dtype": "float8"})
    r = http.post(
        f"{fleet2.urls[0]}/v1/pull_rows",
        content=bad.join(),
        headers={"content-type": bad.content_type},
    )
    assert r.status_code == 400
    assert wire.unpack(bytearray(r.content), r.headers["content-type"])["error"]["details"] == {
        "field": "wire_dtype"
    }


def test_table_rows_in_a_wire_dtype_need_shards_that_take_it(fleet2):
    table = fresh("rows-old")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as plain:
        plain.create_table(table, 4)
    older = AsIfOlder(False, drop_features=(wire.FEATURE_ROWS_WIRE_DTYPE,))
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype="float16", transport=older) as ps:
        with pytest.raises(ProtocolError, match=wire.FEATURE_ROWS_WIRE_DTYPE):
            ps.pull_rows(table, [1, 2])
        with pytest.raises(ProtocolError, match=wire.FEATURE_ROWS_WIRE_DTYPE):
            ps.push_rows(table, [1, 2], np.ones((2, 4), np.float32))


def test_big_arrays_are_converted_by_several_threads_with_the_same_result(monkeypatch):
    monkeypatch.setattr(halves, "THREADS", 2)
    monkeypatch.setattr(halves, "THREADS_FROM", 1 << 17)
    monkeypatch.setattr(halves, "_BLOCK", 1 << 16)
    x = (np.random.default_rng(5).standard_normal(3 * (1 << 17) + 5) * 1e3).astype(np.float32)
    x[[0, -1]] = [65519.0, np.nan]  # the largest that rounds to 65504; NaN travels as NaN
    f16, _ = halves.narrow(x, "float16")
    assert any(t.name.startswith("paramshard-halves") for t in threading.enumerate())
    np.testing.assert_array_equal(f16.view(np.uint16), x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(halves.widen(f16), x.astype(np.float16).astype(np.float32))
    bits, _ = halves.narrow(x, "bfloat16")
    back = halves.widen(bits.view(DTYPES["bfloat16"]))
    np.testing.assert_array_equal(back, rounded(x, "bfloat16"))
    x[-2] = 65520.0  # in the last slice: rounds to an infinity
    with pytest.raises(wire.WireError, match="65520"):
        halves.narrow(x, "float16")


def _narrow_big_in_a_child(queue) -> None:
    x = np.arange(1 << 18, dtype=np.float32) % 60_000
    try:
        queue.put(bool(np.array_equal(halves.narrow(x, "float16")[0], x.astype(np.float16))))
    except BaseException as exc:
        queue.put(repr(exc))


def test_a_forked_child_converts_big_arrays_on_threads_of_its_own(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(halves, "THREADS", 2)
    monkeypatch.setattr(halves, "THREADS_FROM", 1 << 17)
    monkeypatch.setattr(halves, "_BLOCK", 1 << 16)
    halves.narrow(np.ones(1 << 18, np.float32), "float16")  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_narrow_big_in_a_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


# -- the shard's narrowed values (server/narrowed.py) ---------------------------------------


def cache_of(url: str) -> dict:
    return httpx2.get(f"{url}/v1/cluster", timeout=30).json()["half_cache"]


def test_the_next_puller_of_a_version_gets_the_kept_narrowing_never_an_old_one(fleet1):
    url, name = fleet1.urls[0], fresh("kept")
    rng = np.random.default_rng(6)
    first, second = (rng.standard_normal(300_000).astype(np.float32) for _ in range(2))

    def pull_f16() -> np.ndarray:  # a new worker each time: nothing cached in the SDK
        with PSClient(fleet1.urls, worker_id=fresh("w"), wire_dtype="float16") as hp:
            return hp.pull([name])[name]

    before = cache_of(url)
    with PSClient(fleet1.urls, worker_id=fresh("w")) as plain:
        plain.init({name: first}, optimizer=SGD(lr=1.0))
        for _ in range(2):  # the second pull is served from the kept bytes
            np.testing.assert_array_equal(pull_f16(), rounded(first, "float16"))
        after = cache_of(url)
        assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (1, 1)
        plain.delete([name])  # made again: at version 0, as the first was when kept
        plain.init({name: second}, optimizer=SGD(lr=1.0))
        np.testing.assert_array_equal(pull_f16(), rounded(second, "float16"))
        plain.push({name: np.ones(300_000, np.float32)})  # a new version
        np.testing.assert_array_equal(pull_f16(), rounded(second - 1, "float16"))
    assert cache_of(url)["hits"] == after["hits"]


def test_a_new_version_is_narrowed_into_the_kept_float16_array(fleet1):
    url, name = fleet1.urls[0], fresh("reused")
    value = np.arange(1 << 19, dtype=np.float32) % 1000  # 2 MB: kept narrowed
    before = cache_of(url)
    with (
        PSClient(fleet1.urls, worker_id=fresh("w")) as plain,
        PSClient(fleet1.urls, worker_id=fresh("w"), wire_dtype="float16") as hp,
    ):
        plain.init({name: value}, optimizer=SGD(lr=1.0))
        for step in range(4):
            np.testing.assert_array_equal(hp.pull([name])[name], value - step)
            plain.push({name: np.ones_like(value)})  # a new version for the next pull
    after = cache_of(url)
    assert after["casts"] in ("numkong", "numpy")
    # each new version went into the array of the one before: the replies had been sent
    assert after["reused"] - before["reused"] == 3, (before, after)


def test_the_kept_narrowings_stay_within_half_cache_bytes(fleet_factory):
    fleet = fleet_factory(1, "--half-cache-bytes", "1MiB")
    names = [fresh("lru") for _ in range(3)]
    value = np.ones(300_000, np.float32)  # 600 KB narrowed: one fits in 1 MiB
    with PSClient(fleet.urls, worker_id=fresh("w"), wire_dtype="bfloat16") as ps:
        ps.init({n: value for n in names})
        for n in names:
            ps.pull([n])
    kept = cache_of(fleet.urls[0])
    assert kept["entries"] == 1 and kept["bytes"] == 600_000 <= kept["max_bytes"] == 1 << 20
