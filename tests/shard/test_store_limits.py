"""Hostile or unlucky input to the store, over real HTTP to real shard processes: statistics of
huge values, tensors that point outside a msgpack body, seqs that would lock a worker out, the
dedup table's bounds, updates whose result is not finite, optimizer settings that divide by
zero, and requests big enough to block the event loop (docs/PROTOCOL.md, "Limits").
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Any

import httpx2
import msgpack
import numpy as np
import pytest

from client_sdk import wire
from tests.helpers.names import fresh


@pytest.fixture(scope="module")
def shard(fleet1):
    """One shard (it owns every name), shared by the tests that only add unique names."""
    return fleet1.urls[0]


def post(http, url: str, verb: str, msg: Any, *, frame: bool = False) -> tuple[int, Any]:
    enc = wire.encode(msg, frame=frame)
    r = http.post(
        f"{url}/v1/{verb}", content=enc.join(), headers={"content-type": enc.content_type}
    )
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"])


def post_raw(http, url: str, verb: str, body: bytes) -> tuple[int, Any]:
    r = http.post(f"{url}/v1/{verb}", content=body, headers={"content-type": wire.MSGPACK})
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"])


def refused(reply: tuple[int, Any], status: int, code: str) -> dict[str, Any]:
    got, msg = reply
    assert got == status, (got, msg)
    err = msg["error"]
    assert err["code"] == code, err
    assert err["message"]
    return err


def init(http, url: str, name: str, value: np.ndarray, optimizer: dict | None = None) -> None:
    entry: dict[str, Any] = {"value": value}
    if optimizer is not None:
        entry["optimizer"] = optimizer
    status, msg = post(http, url, "init", {"variables": {name: entry}})
    assert status == 200, msg


def stats(http, url: str, name: str) -> dict[str, Any]:
    r = http.get(f"{url}/v1/variables/{name}")
    assert r.status_code == 200, r.text
    return r.json()


def value(http, url: str, name: str) -> np.ndarray:
    status, msg = post(http, url, "pull", {"names": [name]})
    assert status == 200, msg
    return wire.decode_tensor(msg["variables"][name]["value"]).copy()


def assert_healthy(http, url: str) -> None:
    r = http.get(url + "/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# -- statistics ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        np.full(1000, 1e200),  # the sum of squares overflows float64
        np.array([1e308, 1e308, -1e308]),  # so does the plain sum
        np.array([3e38, -3e38], np.float32),
        np.array([1e-300, 2e-300]),
    ],
)
def test_statistics_of_huge_finite_values_are_numbers(shard, http, values):
    name = fresh()
    init(http, shard, name, values)
    got = stats(http, shard, name)
    exact = values.astype(np.float64)
    assert got["min"] == exact.min() and got["max"] == exact.max()
    mean = float(np.mean(exact / exact.size) * exact.size)
    assert got["mean"] == pytest.approx(mean, rel=1e-9)
    scale = np.abs(exact).max()
    assert got["l2_norm"] == pytest.approx(scale * np.sqrt(np.sum((exact / scale) ** 2)), rel=1e-9)
    r = http.get(f"{shard}/v1/variables/{name}", params={"values": "true"})
    assert r.status_code == 200 and r.json()["values"] == exact.tolist()


def test_a_statistic_past_float64_is_null(shard, http):
    name = fresh()
    init(http, shard, name, np.full(4, 1.7e308))  # its l2 norm, 3.4e308, is no float64
    got = stats(http, shard, name)
    assert got["l2_norm"] is None and got["max"] == 1.7e308 and got["mean"] == 1.7e308


# -- tensors by offset in a msgpack body -------------------------------------------------------


@pytest.mark.parametrize("verb", ["init", "push", "assign"])
def test_a_msgpack_tensor_by_offset_is_refused(shard, http, verb):
    """Offsets point into a framed body; in a msgpack body one would read the message's own
    bytes as a tensor."""
    name = fresh()
    init(http, shard, name, np.zeros(4, np.float32))
    by_offset = {"dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 16}
    other = fresh()
    msg = {
        "init": {"variables": {other: {"value": by_offset}}},
        "push": {"worker_id": fresh("w"), "seq": 1, "grads": {name: by_offset}},
        "assign": {"values": {name: by_offset}},
    }[verb]
    err = refused(post_raw(http, shard, verb, msgpack.packb(msg)), 422, "bad_tensor")
    assert "framed" in err["message"]
    assert value(http, shard, name).tolist() == [0, 0, 0, 0]
    assert stats(http, shard, name)["version"] == 0
    refused(post(http, shard, "pull", {"names": [other]}), 404, "not_found")


# -- seqs and the dedup table -----------------------------------------------------


def increment(http, url: str, name: str, worker: str, seq: int) -> tuple[int, Any]:
    return post(http, url, "increment", {"name": name, "worker_id": worker, "seq": seq})


def workers(http, url: str) -> dict[str, dict[str, Any]]:
    r = http.get(url + "/v1/workers")
    assert r.status_code == 200, r.text
    return {w["worker_id"]: w for w in r.json()["workers"]}


def test_one_poisoned_seq_cannot_lock_a_worker_out(fleet_factory, http):
    """A seq past a signed 64-bit int is refused and changes nothing; one that is valid but far
    above the worker's own (someone else's write under its id) leaves the worker's next writes,
    and its retries, working: also after a restart."""
    fleet = fleet_factory(1, data=True)
    url = fleet.urls[0]
    name, real = fresh("step"), fresh("w")
    base = 1_700_000_000_000_000  # the SDK's first seq is the clock in microseconds
    assert increment(http, url, name, real, base)[1]["value"] == 1
    for poison in (2**64 - 1, 2**63):
        err = refused(increment(http, url, name, real, poison), 400, "bad_request")
        assert "seq" in err["message"]
    assert workers(http, url)[real]["high_seq"] == base
    assert value(http, url, name).item() == 1
    # a valid seq far above (the highest a seq may be): applied, as any write
    assert increment(http, url, name, real, 2**63 - 1)[1]["status"] == "applied"
    # the worker goes on from its own counter, and its retries are still recognised
    status, msg = increment(http, url, name, real, base + 1)
    assert status == 200 and msg["status"] == "applied" and msg["value"] == 3, msg
    assert increment(http, url, name, real, base)[1]["status"] == "duplicate"
    fleet.stop(0)
    fleet.start(0)
    assert increment(http, url, name, real, base + 1)[1] == {
        "value": 3,
        "version": 3,
        "status": "duplicate",
    }
    status, msg = increment(http, url, name, real, base + 2)
    assert status == 200 and msg["status"] == "applied" and msg["value"] == 4, msg
    assert increment(http, url, name, real, 2**63 - 1)[1]["status"] == "duplicate"


def test_the_dedup_table_is_bounded_and_its_snapshot_small(fleet_factory, http, tmp_path):
    """Many fresh worker ids, each with two seqs a window apart (the widest bitmap): the
    table keeps at most --dedup-max-workers of them, and the snapshot holds what it keeps in
    a few bytes each."""
    fleet = fleet_factory(1, "--dedup-max-workers", "40", data=True)
    url = fleet.urls[0]
    name = fresh("c")
    ids = [fresh("w") for _ in range(60)]
    for w in ids:
        for seq in (0, 65535):
            assert increment(http, url, name, w, seq)[0] == 200
    kept = workers(http, url)
    assert len(kept) == 40 and set(kept) == set(ids[20:])  # the least recently seen went first
    status, msg = post(http, url, "snapshot", {})
    assert status == 200, msg
    manifests = list(fleet.data_dirs[0].glob("snapshot-*.json"))
    assert len(manifests) == 1, manifests
    size = manifests[0].stat().st_size
    assert size < 40 * 1024, size  # 16 KB a worker as a hex bitmap
    fleet.stop(0)
    fleet.start(0)
    assert set(workers(http, url)) == set(ids[20:])
    assert increment(http, url, name, ids[-1], 0)[1]["status"] == "duplicate"


def test_idle_workers_are_forgotten(fleet_factory, http):
    fleet = fleet_factory(1, "--dedup-idle-seconds", "1")
    url = fleet.urls[0]
    name, old, new = fresh("c"), fresh("w"), fresh("w")
    assert increment(http, url, name, old, 5)[0] == 200
    time.sleep(1.5)  # idle for longer than --dedup-idle-seconds: the scenario, not a wait
    assert increment(http, url, name, new, 5)[0] == 200
    assert set(workers(http, url)) == {new}
    # the forgotten worker's next write starts a new record
    assert increment(http, url, name, old, 6)[1]["status"] == "applied"
    assert set(workers(http, url)) == {old, new}


# -- updates whose result is not finite, and settings that divide by zero --------------------


def push(
    http, url: str, grads: dict[str, np.ndarray], *, frame: bool = False, table: bool = False
) -> tuple[int, Any]:
    msg: dict[str, Any] = {"worker_id": fresh("w"), "seq": 1}
    if not table:
        return post(http, url, "push", {**msg, "grads": grads}, frame=frame)
    cols = {"names": list(grads)}
    body = wire.encode_table(
        {**msg, "layout": "table", "grads": cols}, cols, list(grads.values())
    ).join()
    r = http.post(f"{url}/v1/push", content=body, headers={"content-type": wire.FRAME})
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"])


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"type": "adagrad", "epsilon": 0.0, "initial_accumulator_value": 0.0}, "epsilon"),
        ({"type": "sgd", "lr": 1e308}, "lr"),
        ({"type": "adagrad", "lr": float("inf")}, "lr"),
        ({"type": "sgd", "weight_decay": 1e7}, "weight_decay"),
    ],
)
def test_optimizer_settings_out_of_range_are_refused_at_init(shard, http, spec, field):
    name = fresh()
    err = refused(
        post(
            http,
            shard,
            "init",
            {"variables": {name: {"value": np.zeros(3, np.float32), "optimizer": spec}}},
        ),
        400,
        "bad_request",
    )
    assert field in err["message"]
    refused(post(http, shard, "pull", {"names": [name]}), 404, "not_found")


def test_an_adagrad_epsilon_that_is_zero_in_the_variables_dtype_is_refused(shard, http):
    spec = {"type": "adagrad", "epsilon": 1e-10, "initial_accumulator_value": 0.0}
    name = fresh()
    err = refused(
        post(
            http,
            shard,
            "init",
            {"variables": {name: {"value": np.zeros(3, np.float16), "optimizer": spec}}},
        ),
        400,
        "bad_request",
    )
    assert "epsilon" in err["message"] and "<f2" in err["message"]
    init(http, shard, name, np.zeros(3, np.float32), spec)  # 1e-10 is a float32


def test_the_sdk_refuses_such_settings_at_construction():
    from client_sdk.optimizers import SGD, Adagrad

    with pytest.raises(ValueError, match="epsilon"):
        Adagrad(epsilon=0.0, initial_accumulator_value=0.0)
    with pytest.raises(ValueError, match="lr"):
        SGD(lr=1e308)
    Adagrad(epsilon=0.0, initial_accumulator_value=0.1)
    SGD(lr=1e6)


@pytest.mark.parametrize("way", ["msgpack", "frame", "table", "big"])
def test_an_update_whose_result_is_not_finite_is_refused_whole(shard, http, way):
    """float32 3e38 plus 3e38 is inf: the push is refused (422) and changes no variable,
    whichever way the store applies it (in place on the loop, one update of a whole slab,
    off the loop)."""
    n = 5_000_000 if way == "big" else 4  # 20 MB: applied off the event loop
    ok, bad = fresh("ok"), fresh("bad")
    status, msg = post(
        http,
        shard,
        "init",
        {
            "variables": {
                ok: {"value": np.zeros(n, np.float32), "optimizer": {"type": "add"}},
                bad: {"value": np.full(n, 3e38, np.float32), "optimizer": {"type": "add"}},
            }
        },
    )
    assert status == 200, msg
    grads = {ok: np.ones(n, np.float32), bad: np.full(n, 3e38, np.float32)}
    err = refused(
        push(http, shard, grads, frame=way != "msgpack", table=way == "table"), 422, "bad_tensor"
    )
    assert err["details"]["variable"] == bad and "infinite" in err["message"]
    for name, expected in ((ok, 0.0), (bad, np.float32(3e38))):
        got = stats(http, shard, name)
        assert got["version"] == 0 and got["min"] == got["max"] == expected
    # a push that stays finite goes through
    grads = {ok: np.ones(n, np.float32), bad: np.full(n, -3e38, np.float32)}
    status, msg = push(http, shard, grads, frame=way != "msgpack", table=way == "table")
    assert status == 200 and {r["status"] for r in msg["variables"].values()} == {"applied"}
    assert stats(http, shard, bad)["max"] == 0.0 and stats(http, shard, ok)["max"] == 1.0


def test_the_bounds_of_every_optimizer_take_any_float_without_raising():
    """Whatever the variable's bounds and the gradient's squares (huge, infinite, NaN), each
    rule answers (a bound, or None: compute and check), as a push on the loop needs."""
    from server.store.bounds import LIMITS, bounds_for
    from tests.shard.test_optimizers import CASES

    extremes = [0.0, 1.0, 1e150, 1e300, math.inf, math.nan]
    for opt in CASES:
        for bound, slot, squares in itertools.product(extremes, repeat=3):
            for limit in LIMITS.values():
                after = bounds_for(opt, bound, slot, squares, limit)
                assert after is None or all(0 <= b <= limit for b in after), (opt, after)


@pytest.mark.parametrize(
    "spec, start, grad",
    [
        ({"type": "sgd", "lr": 1e6}, 0.0, 1e33),  # lr * grad overflows float32
        ({"type": "adagrad", "lr": 0.1}, 1.0, 1e20),  # grad**2 overflows the accumulator
        ({"type": "sgd", "lr": 1.0, "weight_decay": 1e6}, 1e34, 0.0),  # value * (1 - lr*wd)
        ({"type": "sgd", "lr": 1e6, "momentum": 0.9}, 0.0, 1e33),  # lr * momentum buffer
        ({"type": "adam", "lr": 0.1}, 1.0, 1e20),  # grad**2 overflows the second moment
        ({"type": "adamw", "lr": 1.0, "weight_decay": 1e6}, 1e34, 0.0),  # the decoupled decay
        ({"type": "rmsprop", "lr": 0.1, "centered": True}, 1.0, 1e20),  # grad**2
        ({"type": "ftrl", "lr": 1.0}, 1.0, 1e20),  # grad**2 overflows the accumulator
    ],
)
def test_optimizer_updates_that_overflow_are_refused(shard, http, spec, start, grad):
    name = fresh()
    init(http, shard, name, np.full(3, start, np.float32), spec)
    err = refused(push(http, shard, {name: np.full(3, grad, np.float32)}), 422, "bad_tensor")
    assert err["details"]["variable"] == name
    got = stats(http, shard, name)
    assert got["version"] == 0 and got["max"] == np.float32(start)
    if "weight_decay" not in spec:  # (those overflow whatever the gradient)
        status, msg = push(http, shard, {name: np.full(3, 1.0, np.float32)})  # and goes on
        assert status == 200, msg


# -- requests big enough to block the event loop ---------------------------------------------


def _msgpack_names(key: bytes, count: int) -> bytes:
    """``{key: ["a", "a", ...]}`` (``count`` names) as raw msgpack, built without packing."""
    return (
        b"\x81"
        + bytes([0xA0 | len(key)])
        + key
        + b"\xdd"
        + count.to_bytes(4, "big")
        + b"\xa1a" * count
    )


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _hostile_bodies() -> list[tuple[str, str, bytes, str]]:
    """The issue's four requests: (what, verb, body, content type)."""
    names = [f"n{i}" for i in range(100_000)]
    init = msgpack.packb(
        {
            "variables": {
                n: {"value": {"dtype": "<f4", "shape": [1], "data": bytes(4)}} for n in names
            }
        }
    )
    rows = 2_000_000
    header = msgpack.packb(
        {
            "worker_id": "w",
            "seq": 1,
            "layout": "table",
            "grads": {
                "names": [f"g{i}" for i in range(rows)],
                "uniform": {"dtype": "<f4", "shape": [1]},
            },
        }
    )
    frame = wire.FRAME_MAGIC + len(header).to_bytes(4, "little") + header
    maps = (
        b"\x81\xa5names\xdc"
        + (1250).to_bytes(2, "big")
        + (b"\xdc" + (4000).to_bytes(2, "big") + b"\x80" * 4000) * 1250
    )
    return [
        ("init of 100k variables", "init", init, wire.MSGPACK),
        ("pull of 5M names", "pull", _msgpack_names(b"names", 5_000_000), wire.MSGPACK),
        ("push table of 2M rows", "push", frame, wire.FRAME),
        ("5 MB of empty maps", "pull", maps, wire.MSGPACK),
    ]


def test_requests_too_big_to_process_are_refused_and_health_answers(fleet_factory, http):
    """Each of the issue's requests is refused (413, saying how to split it) without the
    shard's memory growing by more than a fraction of what decoding them cost, and /healthz
    keeps answering meanwhile, also while the largest allowed init and pull are served."""
    fleet = fleet_factory(1)
    url = fleet.urls[0]
    pid = fleet.procs[0].pid
    bodies = _hostile_bodies()
    before = _rss(pid)
    slowest = 0.0
    done = threading.Event()

    def poll_health() -> None:
        nonlocal slowest
        with httpx2.Client(timeout=30.0) as own:
            while not done.is_set():
                started = time.monotonic()
                assert own.get(url + "/healthz").status_code == 200
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        for what, verb, body, ctype in bodies:
            r = http.post(f"{url}/v1/{verb}", content=body, headers={"content-type": ctype})
            assert r.status_code == 413, (what, r.status_code, r.content[:200])
            err = wire.unpack(bytearray(r.content), r.headers["content-type"])["error"]
            assert err["code"] == "too_large" and "split" in err["message"], (what, err)
            assert err["details"]["limit"] == wire.MAX_REQUEST_NAMES
        # the largest allowed requests are served, and health still answers
        names = [f"big/{i}" for i in range(wire.MAX_REQUEST_NAMES)]
        status, msg = post(
            http,
            url,
            "init",
            {"variables": {n: {"value": np.zeros(1, np.float32)} for n in names}},
            frame=True,
        )
        assert status == 200, msg
        status, msg = post(http, url, "pull", {"names": names})
        assert status == 200 and len(msg["variables"]) == len(names)
        refused(post(http, url, "pull", {"names": [*names, "one-more"]}), 413, "too_large")
    finally:
        done.set()
        poller.join()
    # a bound against a blocked event loop (these requests held it for 6-17 s when decoded on
    # it), with room for a loaded machine; not a speed goal
    assert slowest < 5.0, slowest
    assert _rss(pid) - before < 200 << 20  # the maps alone decoded to ~320 MiB
    assert_healthy(http, url)


def test_the_sdk_splits_batches_above_the_shards_limit(fleet_factory):
    """A worker with more variables per shard than one request may hold: init, wait_ready,
    pull, push and assign all work, each sent as several requests."""
    from client_sdk import PSClient
    from client_sdk.optimizers import Add

    fleet = fleet_factory(2, "--max-request-names", "100")
    names = [f"many/{i}" for i in range(450)]
    with PSClient(fleet.urls) as ps:
        ps.init({n: np.full(2, i, np.float32) for i, n in enumerate(names)}, optimizer=Add())
        ps.wait_ready(names, timeout=10)
        assert [v[0] for v in ps.pull(names).values()] == list(range(450))
        ps.push({n: np.ones(2, np.float32) for n in names})
        assert [v[0] for v in ps.pull(names).values()] == list(range(1, 451))
        ps.push({n: np.ones(2, np.float32) for n in names})  # a second step: new seqs
        ps.assign({n: np.zeros(2, np.float32) for n in names})
        assert all(not v.any() for v in ps.pull(names).values())
