"""The worker SDK end to end against real shards (``fleet2``), plus its retry policy.

Most tests talk real HTTP to two shard processes. The retry tests at the end use
``httpx2.MockTransport``: a real shard cannot be made to answer 429 or to time out on cue.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx2
import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadRequestError,
    BadTensorError,
    ConfigError,
    ConflictError,
    OverloadedError,
    ProtocolError,
    PSClient,
    PSError,
    PushError,
    ShardUnavailableError,
    UnknownVariableError,
    wire,
)
from client_sdk._verbs.pull import plan as pull_plan
from client_sdk.optimizers import SGD, Adagrad
from client_sdk.placement import shard_for
from tests.conftest import HTTP_MODES, start_fleet2
from tests.helpers.ports import refused_port


@pytest.fixture(scope="module", params=HTTP_MODES)
def fleet2(request, tmp_path_factory):
    """This module's 2-shard fleet, once for each way a shard serves (server/upstream.py)."""
    fleet = start_fleet2(tmp_path_factory, request.param)
    yield fleet
    fleet.close()


_ids = itertools.count()


def unique(prefix: str) -> str:
    """fleet2 is shared by the module: every test uses its own variable names."""
    return f"{prefix}{next(_ids)}"


def two_shard_names(prefix: str, n: int = 2) -> list[str]:
    """Names that land on both shards of a 2-shard fleet."""
    names: list[str] = []
    seen: set[int] = set()
    while len(names) < n or len(seen) < 2:
        name = unique(prefix)
        seen.add(shard_for(name, 2))
        names.append(name)
    return names


class Recording(httpx2.BaseTransport):
    """Real HTTP, recording (method, path, response Content-Length) of every exchange."""

    def __init__(self) -> None:
        self.inner = httpx2.HTTPTransport()
        self.log: list[tuple[str, str, int]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        size = int(response.headers.get("content-length", -1))
        self.log.append((request.method, request.url.path, size))
        return response

    def close(self) -> None:
        self.inner.close()


# -- the API block of the issue ----------------------------------------------------------------


def test_api_block_sync(fleet2):
    w0 = np.ones((4, 3), np.float32)
    b0 = np.zeros(3, np.float32)
    gw = np.full((4, 3), 0.5, np.float32)
    gb = np.full(3, 0.25, np.float32)
    w, b, step_name = unique("api_w"), unique("api_b"), unique("api_step")
    with PSClient(fleet2.urls, worker_id="w0") as ps:
        created = ps.init({w: w0, b: b0}, optimizer=Adagrad(lr=0.1))
        assert created == {w: {"version": 0, "created": True}, b: {"version": 0, "created": True}}
        ps.wait_ready([w, b], timeout=60)
        params = ps.pull([w, b])
        assert set(params) == {w, b}
        np.testing.assert_array_equal(params[w], w0)
        np.testing.assert_array_equal(params[b], b0)
        assert params[w].dtype == np.float32 and params[w].shape == (4, 3)

        result = ps.push({w: gw, b: gb})
        assert result[w]["status"] == "applied" and result[w]["version"] == 1
        assert result[b]["status"] == "applied" and result[b]["version"] == 1

        fut = ps.push_async({w: gw})
        ps.flush()
        assert fut.done() and fut.result()[w]["version"] == 2

        assert ps.increment(step_name) == 1
        assert ps.increment(step_name) == 2

        new_w = np.full((4, 3), 7.0, np.float32)
        assert ps.assign({w: new_w})[w]["version"] == 3
        np.testing.assert_array_equal(ps.pull([w])[w], new_w)
        summaries = {s["name"]: s for s in ps.variables()}
        assert summaries[w]["shape"] == [4, 3] and summaries[w]["version"] == 3
        assert summaries[w]["shard"] == shard_for(w, 2)
        assert summaries[b]["optimizer"]["type"] == "adagrad"
        # Adagrad moved b against its gradient.
        assert (ps.pull([b])[b] < 0).all()


def test_api_block_async(fleet2):
    w, b, step_name = unique("aapi_w"), unique("aapi_b"), unique("aapi_step")
    w0 = np.arange(6, dtype=np.float64).reshape(2, 3)
    b0 = np.zeros(3)

    async def main() -> None:
        async with AsyncPSClient(fleet2.urls, worker_id="aw0") as ps:
            await ps.init({w: w0, b: b0}, optimizer=SGD(lr=1.0))
            await ps.wait_ready([w, b], timeout=60)
            params = await ps.pull([w, b])
            np.testing.assert_array_equal(params[w], w0)
            await ps.push({w: np.ones((2, 3)), b: np.ones(3)})
            task = await ps.push_async({w: np.ones((2, 3))})
            assert isinstance(task, asyncio.Task)
            await ps.flush()
            assert task.done() and task.result()[w]["version"] == 2
            values = await asyncio.gather(*(ps.increment(step_name) for _ in range(10)))
            assert sorted(values) == list(range(1, 11))
            await ps.assign({b: np.full(3, 5.0)})
            params = await ps.pull([w, b])
            np.testing.assert_array_equal(params[w], w0 - 2)
            np.testing.assert_array_equal(params[b], np.full(3, 5.0))
            names = {s["name"] for s in await ps.variables()}
            assert {w, b, step_name} <= names

    asyncio.run(main())


# -- pull and the version cache ------------------------------------------------------------------


def test_second_pull_of_unchanged_variables_transfers_no_values(fleet2):
    names = two_shard_names("cache", 2)
    values = {
        n: np.random.default_rng(i).random(250_000).astype(np.float32) for i, n in enumerate(names)
    }
    rec = Recording()
    with PSClient(fleet2.urls, transport=rec) as ps:
        ps.init(values)
        first = ps.pull(names)
        rec.log.clear()
        second = ps.pull(names)
        pulls = [size for method, path, size in rec.log if path == "/v1/pull"]
        assert len(pulls) == 2  # one request per shard
        assert all(0 < size < 1000 for size in pulls), pulls  # versions only, no values
        for n in names:
            assert second[n] is first[n]  # the cached array
            np.testing.assert_array_equal(second[n], values[n])

        # A changed variable is sent again (and only that one).
        changed = names[0]
        ps.assign({changed: np.zeros(250_000, np.float32)})
        rec.log.clear()
        third = ps.pull(names)
        sizes = [size for _, path, size in rec.log if path == "/v1/pull"]
        assert max(sizes) > 1_000_000 and min(sizes) < 1000
        assert third[changed] is not first[changed]
        np.testing.assert_array_equal(third[changed], 0)
        assert third[names[1]] is first[names[1]]


class AsIfOlder(httpx2.BaseTransport):
    """Real HTTP to real shards, recording the layout of every push and pull reply. With
    ``older=True`` the shards act as shards that predate tensor tables: ``features`` is taken
    out of ``/v1/cluster`` and ``"layout"`` out of every pull (so they answer in the map
    layout, one map per variable)."""

    def __init__(
        self, older: bool, drop: tuple[str, ...] = (), drop_features: tuple[str, ...] = ()
    ) -> None:
        self.inner = httpx2.HTTPTransport()
        self.older = older
        self.drop_features = drop_features  # taken out of /v1/cluster's features
        self.drop = ("layout", *drop) if older else drop  # fields taken out of every pull
        self.pushes: list[str] = []
        self.push_tables: list[dict] = []  # each push table's columns, but its names
        self.pulls: list[set] = []
        self.tables: list[set] = []  # the columns of each pull reply's table
        self.uniforms: list[dict | None] = []  # and its uniform map

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path in ("/v1/pull", "/v1/push"):
            msg = wire.unpack(bytearray(request.read()), request.headers["content-type"])
            if path == "/v1/push":
                self.pushes.append(msg.get("layout", "map"))
                if msg.get("layout") == "table":
                    self.push_tables.append({k: v for k, v in msg["grads"].items() if k != "names"})
            elif self.drop:
                assert msg["layout"] == "table"  # what the SDK asks for
                for key in self.drop:
                    msg.pop(key, None)
                headers = {k: v for k, v in request.headers.items() if k != "content-length"}
                request = httpx2.Request(
                    "POST",
                    request.url,
                    headers=headers,
                    content=wire.encode(msg, tensors=False).join(),
                )
        response = self.inner.handle_request(request)
        if path == "/v1/pull":
            response.read()
            reply = wire.unpack(bytearray(response.content), response.headers["content-type"])
            self.pulls.append(set(reply))
            if "table" in reply:
                self.tables.append(set(reply["table"]))
                self.uniforms.append(reply["table"].get("uniform"))
        elif path == "/v1/cluster" and (self.older or self.drop_features):
            info = json.loads(response.read())
            if self.older:
                info.pop("features")
            else:
                info["features"] = [f for f in info["features"] if f not in self.drop_features]
            response = httpx2.Response(
                response.status_code, headers=response.headers, content=json.dumps(info).encode()
            )
        return response

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("older", [False, True], ids=["tables", "older-shards"])
def test_pull_and_push_use_tables_where_the_shard_has_them(fleet2, older):
    """The SDK asks for tables: shards that list the feature get gradient tables and answer
    pulls in tables; shards that predate them get and give one map per tensor, with the same
    results (version cache included)."""
    names = two_shard_names(f"layout-{older}", 4)
    values = {n: np.full((3, 50), i, np.float32) for i, n in enumerate(names)}
    values[names[0]] = np.random.default_rng(9).random(40_000)  # framed in either layout
    transport = AsIfOlder(older)
    with PSClient(fleet2.urls, transport=transport) as ps:
        ps.init(values, optimizer=SGD(lr=1.0))
        first = ps.pull(names)
        assert list(first) == names
        for n in names:
            np.testing.assert_array_equal(first[n], values[n])
            assert not first[n].flags.writeable
        second = ps.pull(names)
        assert all(second[n] is first[n] for n in names)  # unchanged: from the cache
        ps.push({names[1]: np.ones((3, 50), np.float32), names[0]: np.ones(40_000)})
        third = ps.pull(list(reversed(names)))
        assert list(third) == list(reversed(names))
        np.testing.assert_array_equal(third[names[1]], values[names[1]] - 1)
        np.testing.assert_array_equal(third[names[0]], values[names[0]] - 1)
        assert all(third[n] is first[n] for n in names[2:])
    assert transport.pushes and set(transport.pushes) == {"map" if older else "table"}
    assert transport.pulls and all(
        r == ({"variables"} if older else {"table"}) for r in transport.pulls
    )


@pytest.mark.parametrize(
    ("verb", "call"),
    [
        ("set_optimizer", lambda ps, names: ps.set_optimizer(names, SGD(lr=0.5))),
        ("set_optimizer", lambda ps, names: ps.set_optimizer(names[0][:4], SGD(lr=0.5))),
        ("delete", lambda ps, names: ps.delete(names)),
        ("delete", lambda ps, names: ps.delete(names[0][:4])),
        ("poll", lambda ps, names: ps.pull(names, newer_than="cached", timeout=1)),
        ("poll", lambda ps, names: ps.pull(names, min_version=0, timeout=1)),
    ],
    ids=["set_optimizer", "set_optimizer-prefix", "delete", "delete-prefix", "newer", "min"],
)
def test_a_verb_a_shard_lacks_is_refused_naming_the_shard_before_anything_is_sent(
    fleet2, verb, call
):
    """A shard whose /v1/cluster does not list a verb's feature (an older shard) gets no such
    request: the call raises ProtocolError naming that shard and saying to upgrade, and the
    variables are as they were on every shard."""
    names = two_shard_names(f"lacks-{verb}-")
    transport = AsIfOlder(False, drop_features=(verb,))
    with PSClient(fleet2.urls, transport=transport) as ps:
        ps.init({n: np.ones(2, np.float32) for n in names}, optimizer=SGD(lr=1.0))
        ps.pull(names)
        with pytest.raises(ProtocolError) as caught:
            call(ps, names)
        assert caught.value.shard == fleet2.urls[0]
        assert fleet2.urls[0] in str(caught.value) and "upgrade" in str(caught.value)
        assert repr(verb) in str(caught.value)
    with PSClient(fleet2.urls) as ps:  # every shard still has them, as they were
        shown = {v["name"]: v for v in ps.variables() if v["name"] in names}
    assert sorted(shown) == sorted(names)
    assert all(v["optimizer"]["lr"] == 1.0 and v["optimizer_version"] == 0 for v in shown.values())


@pytest.mark.parametrize("packing", [True, False])  # False: a shard that predates it
def test_a_pull_of_same_shaped_variables_gets_their_dtype_and_shape_once(fleet2, packing):
    """The SDK asks for `uniform` tables, packed: a pull whose every row holds a tensor of
    one dtype and shape gets them once, the rows one right after the other (or padded, from
    a shard that ignores `packed`); any other pull the columns; the values are the same."""
    on_shard0 = (n for n in (unique("uniform") for _ in range(1000)) if shard_for(n, 2) == 0)
    names = [next(on_shard0) for _ in range(4)]
    values = {n: np.full((2, 5), i, np.float32) for i, n in enumerate(names)}
    odd = next(on_shard0)
    transport = AsIfOlder(False, drop=() if packing else ("packed",))
    with PSClient(fleet2.urls, transport=transport) as ps:
        ps.init({**values, odd: np.arange(3.0)}, optimizer=SGD(lr=1.0))
        first = ps.pull(names)
        ps.push({names[0]: np.ones((2, 5), np.float32)})
        second = ps.pull([*names, odd])
    assert transport.tables == [{"versions", "uniform"}, {"versions", "dtype", "shape"}]
    assert transport.uniforms[0] == {
        "dtype": "<f4",
        "shape": [2, 5],
        **({"packed": True} if packing else {}),
    }
    for i, n in enumerate(names):
        np.testing.assert_array_equal(first[n], values[n])
        np.testing.assert_array_equal(second[n], values[n] - (i == 0))
        assert not first[n].flags.writeable
    np.testing.assert_array_equal(second[odd], np.arange(3.0))


@pytest.mark.parametrize("packed", [True, False])  # False: a shard that predates it
def test_same_shaped_gradients_go_as_a_packed_uniform_table(fleet2, packed):
    """To a shard that lists "packed", a push of gradients of one dtype and shape is one
    uniform table with its rows packed; to one that does not, the columns; other pushes the
    columns either way. The results are the same."""
    on_shard0 = (n for n in (unique("packpush") for _ in range(1000)) if shard_for(n, 2) == 0)
    names = [next(on_shard0) for _ in range(3)]
    odd = next(on_shard0)
    transport = AsIfOlder(False, drop_features=() if packed else ("packed",))
    with PSClient(fleet2.urls, transport=transport) as ps:
        ps.init(
            {**{n: np.zeros((2, 5), np.float32) for n in names}, odd: np.zeros(3)},
            optimizer=SGD(lr=1.0),
        )
        ps.push({n: np.full((2, 5), i, np.float32) for i, n in enumerate(names)})
        ps.push({names[0]: np.ones((2, 5), np.float32), odd: np.ones(3)})
        got = ps.pull([*names, odd])
    uniform = {"dtype": "<f4", "shape": [2, 5], "packed": True}
    assert transport.push_tables[0] == (
        {"uniform": uniform} if packed else {"dtype": ["<f4"] * 3, "shape": [[2, 5]] * 3}
    )
    assert set(transport.push_tables[1]) == {"dtype", "shape"}
    for i, n in enumerate(names):
        np.testing.assert_array_equal(got[n], np.full((2, 5), -i - (i == 0), np.float32))
    np.testing.assert_array_equal(got[odd], -np.ones(3))


@pytest.mark.parametrize("changed", ["all", "first"])
def test_a_pull_never_caches_over_a_newer_value(fleet2, changed):
    """A pull's values are cached unless the cache already holds a newer version of the same
    shard incarnation (another thread's pull that finished first, here while this one was
    under way): the caller gets what was pulled, the cache keeps the newer. A reply whose
    every row carries a value takes a shorter way through the SDK than one with rows the
    cache already has, and a shorter one still when nothing was cached meanwhile; all keep
    the rule."""
    names = [unique("newer") for _ in range(6)]
    pushed = names if changed == "all" else names[:1]
    with PSClient(fleet2.urls) as ps:
        ps.init({n: np.zeros(8, np.float32) for n in names}, optimizer=SGD(lr=1.0))
        before = ps.pull(names)
        versions = ps._core.cache
        cache = versions.entries
        newer = (cache[names[0]][0], cache[names[0]][1] + 5, np.full(8, 9.0))
        read = versions.held

        def read_then_another_pull_caches(group, incarnation):
            held = read(group, incarnation)
            if names[0] in group:  # the other pull's reply is cached first
                versions.store([names[0]], [newer[1]], [newer[2]], newer[0])
            return held

        versions.held = read_then_another_pull_caches
        ps.push({n: np.ones(8, np.float32) for n in pushed})
        pulled = ps.pull(names)
        del versions.held
        for n in names:
            np.testing.assert_array_equal(pulled[n], -np.ones(8) if n in pushed else 0)
        assert cache[names[0]] == newer
        for n in names[1:]:
            assert cache[n][2] is pulled[n]
            assert n in pushed or pulled[n] is before[n]


def test_pulled_arrays_are_read_only(fleet2):
    small, big = unique("ro_small"), unique("ro_big")
    with PSClient(fleet2.urls) as ps:
        ps.init({small: np.ones(3), big: np.ones(100_000)})  # inline and framed replies
        for value in ps.pull([small, big]).values():
            assert not value.flags.writeable
            with pytest.raises(ValueError):
                value[0] = 5
            mine = value.copy()
            mine[0] = 5  # the documented way


def test_push_math_with_sgd_lr1_is_exact(fleet2):
    names = two_shard_names("sgd", 3)
    w0 = {n: np.linspace(-1, 1, 12).reshape(3, 4) * (i + 1) for i, n in enumerate(names)}
    grads = {n: np.full((3, 4), 0.125 * (i + 1)) for i, n in enumerate(names)}
    with PSClient(fleet2.urls) as ps:
        ps.init(w0, optimizer=SGD(lr=1.0))
        ps.push(grads)
        ps.push(grads)
        got = ps.pull(names)
    for n in names:
        np.testing.assert_array_equal(got[n], w0[n] - 2 * grads[n])


def test_push_sends_the_versions_last_pulled(fleet2):
    w = unique("stale")
    with PSClient(fleet2.urls) as ps:
        ps.init({w: np.zeros(4)}, optimizer=SGD(lr=1.0))
        ps.pull([w])  # version 0
        assert ps.push({w: np.ones(4)})[w]["staleness"] == 0
        assert ps.push({w: np.ones(4)})[w]["staleness"] == 1  # still computed on version 0
        ps.pull([w])  # version 2
        assert ps.push({w: np.ones(4)})[w]["staleness"] == 0
        assert ps.push({w: np.ones(4)}, versions={w: 0})[w]["staleness"] == 3


def test_big_framed_variables_round_trip(fleet2):
    names = two_shard_names("big", 2)
    rng = np.random.default_rng(0)
    values = {n: rng.random(3_000_000).astype(np.float32) for n in names}
    grad = np.full(3_000_000, 0.5, np.float32)
    sent: list[httpx2.Request] = []

    class Recording(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            sent.append(request)
            return super().handle_request(request)

    with PSClient(fleet2.urls, transport=Recording()) as ps:
        ps.init(values, optimizer=SGD(lr=1.0))
        got = ps.pull(names)
        for n in names:
            np.testing.assert_array_equal(got[n], values[n])
        ps.push({n: grad for n in names})
        got = ps.pull(names)
        for n in names:
            np.testing.assert_array_equal(got[n], values[n] - grad)

    class AsyncRecording(httpx2.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            sent.append(request)
            return await super().handle_async_request(request)

    async def main() -> None:
        async with AsyncPSClient(fleet2.urls, transport=AsyncRecording()) as aps:
            await aps.push({names[0]: grad})
            got = await aps.pull(names)
            np.testing.assert_array_equal(got[names[0]], (values[names[0]] - grad) - grad)
            np.testing.assert_array_equal(got[names[1]], values[names[1]] - grad)

    asyncio.run(main())
    framed = [r for r in sent if r.headers.get("content-type") == wire.FRAME]
    assert {r.url.path for r in framed} == {"/v1/init", "/v1/push"}
    for r in framed:  # written from the arrays' memory, with a length, not chunked
        assert "transfer-encoding" not in r.headers
        assert int(r.headers["content-length"]) > 12_000_000


def test_values_may_be_array_likes_and_other_byte_orders(fleet2):
    lst, be = unique("list"), unique("bigendian")
    with PSClient(fleet2.urls) as ps:
        ps.init(
            {lst: [[1.5, 2.5], [3.5, 4.5]], be: np.arange(5, dtype=">f4")}, optimizer=SGD(lr=1.0)
        )
        ps.push({lst: [[1.0, 1.0], [1.0, 1.0]], be: np.ones(5, dtype=">f4")})
        got = ps.pull([lst, be])
    np.testing.assert_array_equal(got[lst], [[0.5, 1.5], [2.5, 3.5]])
    assert got[be].dtype.isnative and got[be].dtype.kind == "f"
    np.testing.assert_array_equal(got[be], np.arange(5) - 1)


def test_one_request_per_shard_per_call(fleet2):
    names = two_shard_names("batch", 10)
    rec = Recording()
    with PSClient(fleet2.urls, transport=rec) as ps:
        ps.init({n: np.zeros(2) for n in names})
        ps.push({n: np.ones(2) for n in names})
        ps.pull(names)
    paths = [path for _, path, _ in rec.log]
    assert paths.count("/v1/cluster") == 2  # the first-contact check, once per shard
    assert paths.count("/v1/init") == paths.count("/v1/push") == paths.count("/v1/pull") == 2


# -- push_async --------------------------------------------------------------------------------


def test_push_async_failure_surfaces_on_future_flush_and_close(fleet2):
    w = unique("async_fail")
    with PSClient(fleet2.urls) as other:  # so that ps does not know the variable's shape
        other.init({w: np.zeros((2, 2))})
    ps = PSClient(fleet2.urls)
    bad = ps.push_async({w: np.ones(3)})  # wrong shape: 422 from the shard
    good = ps.push_async({w: np.ones((2, 2))})
    with pytest.raises(PushError) as info:
        ps.flush()
    assert len(info.value.errors) == 1
    assert isinstance(info.value.errors[0], BadTensorError)
    assert w in str(info.value)
    assert isinstance(bad.exception(), BadTensorError)
    assert good.result()[w]["status"] == "applied"
    ps.flush()  # each failure is raised by one flush only

    ps.push_async({w: np.ones(5)})  # never flushed: close() raises it
    with pytest.raises(PushError) as info:
        ps.close()
    assert isinstance(info.value.errors[0], BadTensorError)
    with pytest.raises(PSError, match="closed"):
        ps.pull([w])


def test_push_async_refuses_at_the_call_a_gradient_that_cannot_fit(fleet2):
    """A gradient of another shape than its variable's (or of an int dtype) is a BadTensorError
    raised by push_async itself when the client knows the variable from its init or its last
    pull: nothing is queued, so the next flush has nothing to report."""
    w, v, unknown = unique("fit_w"), unique("fit_v"), unique("fit_unknown")
    with PSClient(fleet2.urls) as other:
        other.init({v: np.zeros(3, np.float32), unknown: np.zeros(3, np.float32)})
    with PSClient(fleet2.urls) as ps:
        ps.init({w: np.zeros((2, 2), np.float32)})
        with pytest.raises(BadTensorError, match=r"\[4\].*\[2, 2\]") as info:
            ps.push_async({w: np.ones(4, np.float32)})
        assert info.value.details["variable"] == w
        with pytest.raises(BadTensorError, match="float"):
            ps.push_async({w: np.ones((2, 2), np.int64)})
        ps.pull([v])  # known from a pull too
        with pytest.raises(BadTensorError, match=r"\[3\]"):
            ps.push_async({v: np.ones(5, np.float32), w: np.ones((2, 2), np.float32)})
        ps.flush()  # nothing was queued
        assert ps.push_async({w: np.ones((2, 2), np.float32)}).result()[w]["status"] == "applied"
        # a variable it does not know goes to the shard, which says what is wrong
        future = ps.push_async({unknown: np.ones(5, np.float32)})
        with pytest.raises(PushError):
            ps.flush()
        assert isinstance(future.exception(), BadTensorError)

    async def main() -> None:
        async with AsyncPSClient(fleet2.urls) as aps:
            await aps.pull([w])
            with pytest.raises(BadTensorError, match=r"\[7\]"):
                await aps.push_async({w: np.ones(7, np.float32)})
            await aps.flush()

    asyncio.run(main())


def test_push_async_is_bounded_and_snapshots_gradients(fleet2):
    w = unique("async_bound")
    with PSClient(fleet2.urls, max_inflight=2) as ps:
        ps.init({w: np.zeros(1000)}, optimizer=SGD(lr=1.0))
        grad = np.ones(1000)
        futures = []
        for _ in range(20):
            futures.append(ps.push_async({w: grad}))
            assert ps._pusher.inflight <= 2
            grad[:] = 1.0  # reusing the buffer at once must be safe...
        grad[:] = 100.0  # ...even for the pushes still in flight
        ps.flush()
        assert all(f.result()[w]["status"] == "applied" for f in futures)
        versions = sorted(f.result()[w]["version"] for f in futures)
        assert versions == list(range(1, 21))
        np.testing.assert_array_equal(ps.pull([w])[w], np.full(1000, -20.0))


def test_async_client_push_async_failure(fleet2):
    w = unique("aasync_fail")

    with PSClient(fleet2.urls) as other:  # so that ps does not know the variable's shape
        other.init({w: np.zeros(2)})

    async def main() -> None:
        ps = AsyncPSClient(fleet2.urls)
        task = await ps.push_async({w: np.ones(7)})
        with pytest.raises(PushError) as info:
            await ps.flush()
        assert isinstance(info.value.errors[0], BadTensorError)
        assert isinstance(task.exception(), BadTensorError)
        await ps.push_async({w: np.ones(7)})
        with pytest.raises(PushError):
            await ps.close()

    asyncio.run(main())


# -- errors ------------------------------------------------------------------------------------


def test_error_classes_for_404_409_422(fleet2):
    w, missing = unique("err"), unique("nope")
    with PSClient(fleet2.urls) as ps:
        ps.init({w: np.zeros((2, 2), np.float32)})
        with pytest.raises(UnknownVariableError) as info:
            ps.pull([w, missing])
        err = info.value
        assert err.status == 404 and err.code == "not_found"
        assert err.shard == fleet2.urls[shard_for(missing, 2)] and err.shard in str(err)
        assert missing in str(err)

        with pytest.raises(ConflictError) as info:
            ps.init({w: np.zeros((3, 3), np.float32)})
        assert info.value.status == 409 and info.value.shard in str(info.value)

        with pytest.raises(BadTensorError) as info:
            ps.push({w: np.ones(3, np.float32)})
        assert info.value.status == 422

        with pytest.raises(BadTensorError):
            ps.init({unique("nan"): np.array([1.0, np.nan])})
        with pytest.raises(UnknownVariableError):
            ps.assign({missing: np.zeros(2)})
        np.testing.assert_array_equal(ps.pull([w])[w], 0)  # nothing was changed


def test_a_push_refused_by_one_shard_says_where_it_was_applied(fleet2):
    names = two_shard_names("partial", 2)
    by_shard = {shard_for(n, 2): n for n in names}
    good, bad = by_shard[0], by_shard[1]
    with PSClient(fleet2.urls) as ps:
        ps.init({good: np.zeros(2), bad: np.zeros(2)}, optimizer=SGD(lr=1.0))
        with pytest.raises(BadTensorError) as info:
            ps.push({good: np.ones(2), bad: np.ones(3)})
        assert info.value.shard == fleet2.urls[1]
        assert f"nevertheless applied on {fleet2.urls[0]}" in str(info.value)
        assert info.value.details["applied_on"] == [fleet2.urls[0]]
        got = ps.pull([good, bad])
    np.testing.assert_array_equal(got[good], -np.ones(2))
    np.testing.assert_array_equal(got[bad], np.zeros(2))


def test_a_body_above_the_shard_limit_is_a_bad_request(fleet_factory):
    fleet = fleet_factory(1, "--max-request-bytes", "64KiB")
    with PSClient(fleet.urls) as ps:
        with pytest.raises(BadRequestError, match="max-request-bytes") as info:
            ps.init({"big": np.zeros(5_000_000, np.float32)})  # refused before it is read
        assert info.value.status == 413
        ps.init({"small": np.zeros(10, np.float32)})  # the connection pool is still fine
        with pytest.raises(UnknownVariableError):
            ps.pull(["big"])


def test_bad_arguments_are_refused_before_sending(fleet2):
    rec = Recording()
    with PSClient(fleet2.urls, transport=rec) as ps:
        with pytest.raises(BadTensorError, match="complex"):
            ps.init({"c": np.ones(2, complex)})
        with pytest.raises(BadTensorError, match="dtype"):
            ps.push({"o": np.array([object()])})
        with pytest.raises(BadTensorError):
            ps.push_async({"s": ["a", "b"]})
        with pytest.raises(BadRequestError, match="invalid variable name"):
            ps.pull(["bad name"])
        with pytest.raises(BadRequestError, match="list of variable names"):
            ps.pull("w")
        with pytest.raises(BadRequestError):
            ps.increment("c", delta="1")
        with pytest.raises(BadRequestError, match="optimizer"):
            ps.init({"x": np.ones(2)}, optimizer="sgd")
    assert rec.log == []


def test_unreachable_shard_is_reported_after_the_retry_deadline():
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        with PSClient([url], retry_deadline=0.5) as ps:
            with pytest.raises(ShardUnavailableError, match="cannot connect") as info:
                ps.pull(["w"])
    assert info.value.shard == url


def test_a_service_that_is_not_a_shard_is_a_protocol_error():
    import http.server
    import threading

    class NotAShard(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html>nothing here</html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotAShard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with PSClient([f"http://127.0.0.1:{server.server_address[1]}"]) as ps:
            with pytest.raises(ProtocolError, match="paramshard shard"):
                ps.pull(["w"])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# -- configuration -----------------------------------------------------------------------------


def test_configuration_from_environment(fleet2, monkeypatch):
    monkeypatch.setenv("PARAMSHARD_SHARDS", " , ".join(fleet2.urls))
    monkeypatch.setenv("PARAMSHARD_WORKER_ID", "env-worker-7")
    monkeypatch.setenv("PARAMSHARD_TOKEN", "s3cret")
    w = unique("env")
    seen: list[httpx2.Request] = []

    class Recording(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            seen.append(request)
            return super().handle_request(request)

    with PSClient(transport=Recording()) as ps:
        assert ps.shards == tuple(fleet2.urls)
        assert ps.worker_id == "env-worker-7"
        ps.init({w: np.zeros(2)})
        ps.push({w: np.ones(2)})
        summary = next(s for s in ps.variables() if s["name"] == w)
    assert summary["last_writer"] == "env-worker-7"
    assert seen and all(r.headers["authorization"] == "Bearer s3cret" for r in seen)
    data = [r for r in seen if r.url.path.startswith("/v1/") and r.method == "POST"]
    assert data
    for r in data:  # every data-plane request says which shard it is meant for
        assert r.headers["x-paramshard-fleet"] == f"{fleet2.ports.index(r.url.port)}/2"


def test_no_shards_is_a_config_error(monkeypatch):
    monkeypatch.delenv("PARAMSHARD_SHARDS", raising=False)
    with pytest.raises(ConfigError, match="PARAMSHARD_SHARDS"):
        PSClient()
    with pytest.raises(ConfigError, match="PARAMSHARD_SHARDS"):
        PSClient([])
    monkeypatch.setenv("PARAMSHARD_SHARDS", "localhost:7100")
    with pytest.raises(ConfigError, match="http://host:port"):
        PSClient()
    with pytest.raises(ConfigError, match="invalid"):
        PSClient(["ftp://127.0.0.1:7100"])
    with pytest.raises(ConfigError, match="twice"):
        PSClient(["http://a:1", "http://a:1/"])
    with pytest.raises(ConfigError, match="max_inflight"):
        PSClient(["http://a:1"], max_inflight=0)
    with pytest.raises(ConfigError, match="worker_id"):
        PSClient(["http://a:1"], worker_id="")


def test_threads_may_share_a_client(fleet2):
    import concurrent.futures

    names = two_shard_names("threads", 4)
    with PSClient(fleet2.urls) as ps:
        ps.init({n: np.zeros(8) for n in names}, optimizer=SGD(lr=1.0))

        def work(i: int) -> None:
            for _ in range(10):
                ps.pull(names)
                ps.push({n: np.ones(8) for n in names})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(work, range(4)))
        for value in ps.pull(names).values():
            np.testing.assert_array_equal(value, np.full(8, -40.0))


# -- retries (MockTransport: a real shard cannot be made to fail on cue) -----------------------


def scripted_shard(script: list):
    """A one-shard fleet whose data-plane replies follow ``script``: each item is an int
    status (answered with an error payload), an exception to raise, or "ok". ``calls`` records
    (path, decoded body) of each data-plane request."""
    calls: list[str] = []
    headers = {
        "x-paramshard-shard": "0/1",
        "x-paramshard-incarnation": "abc",
        "x-paramshard-protocol": "1",
    }

    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/v1/cluster":
            return httpx2.Response(
                200,
                headers=headers,
                json={
                    "shard_index": 0,
                    "num_shards": 1,
                    "incarnation": "abc",
                    "protocol_version": 1,
                },
            )
        body = request.read()
        ctype = request.headers.get("content-type", wire.MSGPACK)
        calls.append((request.url.path, wire.unpack(bytearray(body), ctype) if body else None))
        step = script.pop(0) if script else "ok"
        if isinstance(step, Exception):
            raise step
        if step == "ok":
            msg = {
                "value": 1,
                "version": 1,
                "ready": ["w"],
                "missing": [],
                "variables": {"w": {"status": "applied", "version": 1, "staleness": 0}},
            }
            return httpx2.Response(
                200,
                headers={**headers, "content-type": wire.MSGPACK},
                content=wire.encode(msg).join(),
            )
        code = {429: "overloaded", 503: "unavailable"}.get(step, "bad_request")
        body = wire.encode(wire.error_payload(code, "busy, retry")).join()
        return httpx2.Response(
            step,
            content=body,
            headers={**headers, "content-type": wire.MSGPACK, "retry-after": "0"},
        )

    return httpx2.MockTransport(handler), calls


def test_429_and_503_are_retried_for_every_verb():
    transport, calls = scripted_shard([429, 503, "ok", 429, "ok"])
    with PSClient(["http://shard0"], transport=transport) as ps:
        assert ps.increment("c") == 1
        assert ps.push({"w": np.ones(2)})["w"]["status"] == "applied"
    assert [path for path, _ in calls] == ["/v1/increment"] * 3 + ["/v1/push"] * 2


def test_overload_past_the_deadline_raises_overloaded():
    transport, calls = scripted_shard([429] * 1000)
    with PSClient(["http://shard0"], transport=transport, retry_deadline=0.3) as ps:
        with pytest.raises(OverloadedError, match="429"):
            ps.increment("c")
    assert len(calls) > 1


def test_writes_are_retried_after_any_transport_error_with_the_same_seq():
    transport, calls = scripted_shard(
        [
            httpx2.ReadTimeout("slow"),
            httpx2.RemoteProtocolError("gone"),
            "ok",
            httpx2.WriteError("reset"),
            "ok",
        ]
    )
    with PSClient(["http://shard0"], transport=transport, worker_id="w") as ps:
        assert ps.push({"w": np.ones(2)})["w"]["status"] == "applied"
        assert ps.increment("c") == 1
    assert [path for path, _ in calls] == ["/v1/push"] * 3 + ["/v1/increment"] * 2
    seqs = [msg["seq"] for _, msg in calls]
    assert seqs[0] == seqs[1] == seqs[2] < seqs[3] == seqs[4]  # a retry repeats its seq
    assert {msg["worker_id"] for _, msg in calls} == {"w"}


def test_a_write_that_keeps_failing_says_it_was_applied_at_most_once():
    transport, calls = scripted_shard([httpx2.ReadTimeout("slow")] * 1000)
    with PSClient(["http://shard0"], transport=transport, retry_deadline=0.3) as ps:
        with pytest.raises(ShardUnavailableError, match="applied at most once"):
            ps.push({"w": np.ones(2)})
    assert len(calls) > 1


def test_read_only_calls_are_retried_after_any_transport_error():
    transport, calls = scripted_shard(
        [httpx2.ReadTimeout("slow"), httpx2.RemoteProtocolError("gone"), "ok"]
    )

    async def main() -> None:
        async with AsyncPSClient(["http://shard0"], transport=transport) as ps:
            await ps.wait_ready(["w"], timeout=5)

    asyncio.run(main())
    assert [path for path, _ in calls] == ["/v1/wait"] * 3


def test_a_pull_plan_is_kept_per_list_of_names(fleet2):
    """The same list pulled again skips checking and placing its names (the plan is kept);
    another list, or the same names in another order or with repeats, gets its own; a bad
    list is refused each time, a plan or not; the kept plans stay bounded."""
    names = two_shard_names("plan", 4)
    with PSClient(fleet2.urls) as ps:
        ps.init({n: np.full(2, i, np.float32) for i, n in enumerate(names)})
        plans = ps._core.pull_plans
        first = ps.pull(names)
        assert list(first) == names and len(plans) == 1
        assert ps.pull(tuple(names)).keys() == first.keys() and len(plans) == 1  # same key
        backwards = ps.pull(names[::-1])
        assert list(backwards) == names[::-1] and len(plans) == 2
        twice = ps.pull([names[0], names[0], names[1]])  # repeats dropped, order kept
        assert list(twice) == names[:2]
        for i, n in enumerate(names):
            np.testing.assert_array_equal(backwards[n], np.full(2, i))
        for bad in ([names[0], 7], [names[0], ["x"]], [names[0], "bad name!"]):
            for _ in range(2):
                with pytest.raises(BadRequestError):
                    ps.pull(bad)
        for k in range(200):
            pull_plan(ps._core, [names[k % 4], names[(k + 1) % 4], f"plan-extra-{k}"])
        assert 0 < len(plans) <= 64
