"""Embedding tables on real shards over raw HTTP (docs/PROTOCOL.md §3: create_table,
pull_rows, push_rows; the JSON ``/v1/tables`` endpoints): what each reply says, a retry
answered ``duplicate``, and every bad input refused with its status and code and nothing
changed (the rows and the table's version read back the same). The same verbs through the
SDK, against numpy references and across shard counts, are in
tests/e2e/test_embedding_tables.py.
"""

from __future__ import annotations

from typing import Any

import httpx2
import numpy as np
import pytest

from client_sdk import wire
from client_sdk.embedding import TableSpec, initial_rows
from client_sdk.optimizers import SGD
from client_sdk.placement import row_shard
from tests.conftest import Fleet
from tests.helpers.names import fresh

DIM = 4
SPEC = TableSpec(dim=DIM, optimizer=SGD(lr=0.5)).to_wire()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    fleet = Fleet(
        1,
        tmp_path_factory.mktemp("embedding-requests"),
        ("--max-table-ids", "64", "--max-table-rows", "100"),
    )
    yield fleet.urls[0]
    fleet.close()


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory):
    fleet = Fleet(2, tmp_path_factory.mktemp("embedding-requests-2"))
    yield fleet
    fleet.close()


_WORKER = ["w"]


@pytest.fixture(autouse=True)
def _fresh_worker():
    """Each test writes as a worker of its own (the shards' dedup tables outlive a test)."""
    _WORKER[0] = fresh("w")


def worker() -> str:
    return _WORKER[0]


def post(url: str, verb: str, msg: dict[str, Any], frame: bool = False) -> tuple[int, Any]:
    enc = wire.encode(msg, frame=frame)
    r = httpx2.post(
        f"{url}/v1/{verb}",
        content=enc.join(),
        headers={"content-type": enc.content_type, "accept": wire.MSGPACK},
        timeout=30.0,
    )
    body = bytearray(r.content)
    reply = wire.unpack(body, r.headers.get("content-type", ""))
    if r.status_code == 200 and "rows" in reply and isinstance(reply["rows"], dict):
        reply["rows"] = wire.decode_tensor(reply["rows"], body)
    return r.status_code, reply


def ok(url: str, verb: str, msg: dict[str, Any], frame: bool = False) -> Any:
    status, reply = post(url, verb, msg, frame)
    assert status == 200, reply
    return reply


def refused(url: str, verb: str, msg: dict[str, Any], status: int, code: str) -> dict[str, Any]:
    got, reply = post(url, verb, msg)
    assert (got, reply["error"]["code"]) == (status, code), reply
    return reply["error"]


def made(url: str, spec: dict[str, Any] = SPEC) -> str:
    name = fresh("t")
    assert ok(url, "create_table", {"name": name, "spec": spec}) == {"created": True, "version": 0}
    return name


def rows(url: str, name: str, ids: list[int]) -> np.ndarray:
    return ok(url, "pull_rows", {"name": name, "ids": np.array(ids, np.int64)})["rows"]


def push(url: str, name: str, ids: Any, grads: Any, worker: str, seq: int) -> Any:
    return post(
        url,
        "push_rows",
        {"name": name, "ids": ids, "grads": grads, "worker_id": worker, "seq": seq},
    )


def table(url: str, name: str) -> dict[str, Any]:
    r = httpx2.get(f"{url}/v1/tables/{name}", timeout=30.0)
    assert r.status_code == 200, r.text
    return r.json()


def test_create_pull_push_and_a_retry(url):
    name = made(url)
    again = ok(url, "create_table", {"name": name, "spec": SPEC})
    assert again == {"created": False, "version": 0}
    ids = np.array([7, -3, 7, 2**62], np.int64)
    first = rows(url, name, ids.tolist())
    expected = initial_rows(TableSpec(dim=DIM), name, ids)
    np.testing.assert_array_equal(first, expected)  # the initializer's rows, nothing stored
    assert table(url, name)["rows"] == 0
    grads = np.ones((4, DIM), np.float32)
    status, reply = push(url, name, ids, grads, worker(), 5)
    assert status == 200
    assert reply == {"status": "applied", "version": 1, "rows": 3, "created": 3, "counted": 0}
    after = rows(url, name, ids.tolist())
    np.testing.assert_allclose(after[0], expected[0] - 0.5 * 2)  # id 7 twice: summed
    np.testing.assert_allclose(after[1], expected[1] - 0.5)
    np.testing.assert_array_equal(after[0], after[2])
    status, reply = push(url, name, ids, grads, worker(), 5)
    assert reply["status"] == "duplicate"
    np.testing.assert_array_equal(rows(url, name, ids.tolist()), after)
    info = table(url, name)
    assert (info["rows"], info["version"], info["dim"]) == (3, 1, DIM)
    assert info["hottest"][0]["updates"] == 1
    # A framed request (big bodies come framed) gives the same
    status, reply = post(
        url,
        "push_rows",
        {"name": name, "ids": ids[:1], "grads": grads[:1], "worker_id": worker(), "seq": 6},
        frame=True,
    )
    assert (status, reply["status"]) == (200, "applied")


def test_rest_lists_tables_and_shows_rows(url):
    name = made(url)
    push(url, name, np.array([1, 2, 2], np.int64), np.ones((3, DIM), np.float32), worker(), 1)
    listed = httpx2.get(f"{url}/v1/tables").json()["tables"]
    assert any(t["name"] == name and t["rows"] == 2 for t in listed)
    cluster = httpx2.get(f"{url}/v1/cluster").json()
    assert cluster["tables"] == len(listed)
    assert cluster["table_bytes"] == sum(t["bytes"] for t in listed) > 0
    assert (cluster["max_table_ids"], cluster["max_table_rows"]) == (64, 100)
    info = table(url, name)
    assert info["hottest"][:2] == [{"id": 1, "updates": 1}, {"id": 2, "updates": 1}]
    r = httpx2.get(f"{url}/v1/tables/{name}/rows", params={"ids": "2,99"})
    assert r.status_code == 200, r.text
    shown = r.json()["rows"]
    assert [(row["id"], row["stored"]) for row in shown] == [(2, True), (99, False)]
    np.testing.assert_allclose(shown[0]["values"], rows(url, name, [2])[0])
    for bad in ("", "1,x", ",".join(map(str, range(1001))), str(2**63)):
        r = httpx2.get(f"{url}/v1/tables/{name}/rows", params={"ids": bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    r = httpx2.get(f"{url}/v1/tables/{fresh('t')}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_bad_pushes_change_nothing(url):
    name = made(url)
    ids = np.array([1, 2], np.int64)
    push(url, name, ids, np.ones((2, DIM), np.float32), worker(), 1)
    before = rows(url, name, [1, 2, 3])
    version = table(url, name)["version"]
    w = {"worker_id": worker(), "seq": 2}
    nan = np.ones((2, DIM), np.float32)
    nan[1, 2] = np.nan
    cases = [
        ({"ids": ids.astype(np.float64), "grads": np.ones((2, DIM))}, 422, "bad_tensor"),
        ({"ids": ids.reshape(2, 1), "grads": np.ones((2, DIM))}, 422, "bad_tensor"),
        ({"ids": ids, "grads": np.ones((2, DIM + 1), np.float32)}, 422, "bad_tensor"),
        ({"ids": ids, "grads": np.ones((3, DIM), np.float32)}, 422, "bad_tensor"),
        ({"ids": ids, "grads": np.ones((2, DIM), np.int32)}, 422, "bad_tensor"),
        ({"ids": ids, "grads": nan}, 422, "bad_tensor"),
        ({"ids": ids, "grads": np.full((2, DIM), 1e300)}, 422, "bad_tensor"),
        ({"ids": np.arange(65, dtype=np.int64), "grads": np.ones((65, DIM))}, 413, "too_large"),
        ({"ids": ids}, 400, "bad_request"),
        ({"grads": np.ones((2, DIM))}, 400, "bad_request"),
    ]
    for fields, status, code in cases:
        refused(url, "push_rows", {"name": name, **w, **fields}, status, code)
    refused(
        url, "push_rows", {"name": name, "ids": ids, "grads": np.ones((2, DIM))}, 400, "bad_request"
    )
    np.testing.assert_array_equal(rows(url, name, [1, 2, 3]), before)
    assert table(url, name)["version"] == version
    # An update whose result is not finite: refused whole
    huge = TableSpec(dim=DIM, optimizer=SGD(lr=1e6)).to_wire()
    big = made(url, huge)
    refused(
        url,
        "push_rows",
        {"name": big, "ids": ids, "grads": np.full((2, DIM), 1e36, np.float32), **w},
        422,
        "bad_tensor",
    )
    assert table(url, big)["rows"] == 0


def test_rows_past_the_limit_are_refused_whole(url):
    name = made(url)
    ok_ids = np.arange(60, dtype=np.int64)
    assert push(url, name, ok_ids, np.ones((60, DIM), np.float32), worker(), 1)[1]["created"] == 60
    more = np.arange(100, 141, dtype=np.int64)  # 60 + 41 > 100
    error = refused(
        url,
        "push_rows",
        {"name": name, "ids": more, "grads": np.ones((41, DIM)), "worker_id": worker(), "seq": 2},
        413,
        "too_large",
    )
    assert error["details"]["limit"] == 100
    assert table(url, name)["rows"] == 60


def test_names_are_a_variable_or_a_table(url):
    name = made(url)
    error = refused(url, "init", {"variables": {name: {"value": np.zeros(2)}}}, 409, "conflict")
    assert "embedding table" in error["message"]
    refused(url, "pull", {"names": [name]}, 409, "conflict")
    refused(
        url,
        "push",
        {"grads": {name: np.zeros(2)}, "worker_id": worker(), "seq": 9},
        409,
        "conflict",
    )
    var = fresh("v")
    ok(url, "init", {"variables": {var: {"value": np.zeros(2)}}})
    for verb, msg in (
        ("create_table", {"name": var, "spec": SPEC}),
        ("pull_rows", {"name": var, "ids": np.array([1], np.int64)}),
        (
            "push_rows",
            {
                "name": var,
                "ids": np.array([1]),
                "grads": np.ones((1, DIM)),
                "worker_id": worker(),
                "seq": 1,
            },
        ),
    ):
        error = refused(url, verb, msg, 409, "conflict")
        assert "dense variable" in error["message"]
    refused(url, "pull_rows", {"name": fresh("t"), "ids": np.array([1])}, 404, "not_found")
    refused(url, "pull_rows", {"name": "bad name!", "ids": np.array([1])}, 400, "bad_request")


def test_create_with_another_spec_names_the_field(url):
    name = made(url)
    for field, spec, code, status in (
        ("dim", {**SPEC, "dim": DIM + 1}, "conflict", 409),
        ("optimizer", {**SPEC, "optimizer": {"type": "adam", "lr": 0.1}}, "conflict", 409),
        ("initializer", {**SPEC, "initializer": {"type": "zeros"}}, "conflict", 409),
        ("seed", {**SPEC, "seed": 5}, "conflict", 409),
        ("dim", {**SPEC, "dim": 0}, "bad_request", 400),
        ("dtype", {**SPEC, "dtype": "int8"}, "bad_request", 400),
        ("optimizer.lr", {**SPEC, "optimizer": {"type": "sgd", "lr": -1}}, "bad_request", 400),
        (
            "initializer.std",
            {**SPEC, "initializer": {"type": "normal", "std": -1}},
            "bad_request",
            400,
        ),
        (
            "optimizer.schedule",
            {
                **SPEC,
                "optimizer": {
                    "type": "sgd",
                    "lr": 0.1,
                    "schedule": {"type": "step", "every": 10, "gamma": 0.5},
                },
            },
            "bad_request",
            400,
        ),
        ("colour", {**SPEC, "colour": 1}, "bad_request", 400),
    ):
        error = refused(url, "create_table", {"name": name, "spec": spec}, status, code)
        assert error["details"]["field"] == field, error
        if code == "conflict" and field == "optimizer":
            assert "fixed when it is made" in error["message"]
    assert table(url, name)["dim"] == DIM


def test_a_row_of_another_shard_is_421(fleet2):
    name = fresh("t")
    for u in fleet2.urls:
        ok(u, "create_table", {"name": name, "spec": SPEC})
    ids = np.arange(40, dtype=np.int64)
    owners = row_shard(name, ids, 2)
    mine, theirs = ids[owners == 0], ids[owners == 1]
    error = refused(fleet2.urls[0], "pull_rows", {"name": name, "ids": ids}, 421, "not_owner")
    assert error["details"]["rows"][str(int(theirs[0]))] == 1
    grads = np.ones((len(ids), DIM), np.float32)
    refused(
        fleet2.urls[0],
        "push_rows",
        {"name": name, "ids": ids, "grads": grads, "worker_id": worker(), "seq": 1},
        421,
        "not_owner",
    )
    assert table(fleet2.urls[0], name)["rows"] == 0
    assert ok(fleet2.urls[0], "pull_rows", {"name": name, "ids": mine})["rows"].shape == (
        len(mine),
        DIM,
    )


def test_the_sdk_splits_a_batch_by_the_shards_max_table_ids(url):
    """This shard takes 64 ids per request (--max-table-ids): the SDK sends 200 in 4."""
    from client_sdk import PSClient

    name = made(url)
    ids = np.arange(-100, 100, dtype=np.int64)
    with PSClient([url], worker_id=worker()) as ps:
        np.testing.assert_array_equal(
            ps.pull_rows(name, ids), initial_rows(TableSpec(dim=DIM), name, ids)
        )
        result = ps.push_rows(name, ids[:80], np.ones((80, DIM), np.float32))
        assert result == {"rows": 80, "created": 80, "counted": 0, "duplicate": 0}
    assert table(url, name)["rows"] == 80
