"""Admission and eviction of embedding-table rows on real shards: ``Admission(min_count, ttl,
max_rows)`` in a table's spec (client_sdk/embedding.py, server/embedding/admission.py).

Each rule is checked through what a worker sees (the rows ``pull_rows`` answers and what
``push_rows`` returns) and what ``GET /v1/tables/{name}`` and ``/rows`` show (rows stored,
admitted, evicted, pending and forgotten counts); the bound on pending counts with a small
``--max-pending-ids``; the counts surviving a kill -9 and restart through a checkpoint; bad
admission specs refused before anything changes.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx2
import numpy as np
import pytest

from client_sdk import BadRequestError, ConflictError, PSClient
from client_sdk.embedding import Admission, Constant, TableSpec, Zeros
from client_sdk.optimizers import SGD, SpecError
from tests.shard.test_embedding_requests import post

_NAMES = itertools.count()


def fresh(prefix: str) -> str:
    return f"adm/{prefix}-{next(_NAMES)}"


def info(url: str, name: str) -> dict[str, Any]:
    r = httpx2.get(f"{url}/v1/tables/{name}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def stored(url: str, name: str, ids) -> list[bool]:
    query = ",".join(str(int(i)) for i in ids)
    r = httpx2.get(f"{url}/v1/tables/{name}/rows", params={"ids": query}, timeout=10)
    assert r.status_code == 200, r.text
    return [row["stored"] for row in r.json()["rows"]]


def ones(n: int, dim: int = 4) -> np.ndarray:
    return np.ones((n, dim), np.float32)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    from tests.conftest import Fleet

    fleet = Fleet(1, tmp_path_factory.mktemp("admission"))
    yield fleet
    fleet.close()


def test_an_id_gets_a_row_on_the_push_that_reaches_min_count(one):
    url, name = one.urls[0], fresh("min")
    with PSClient(one.urls, worker_id="w-min") as ps:
        ps.create_table(
            name,
            4,
            initializer=Constant(0.5),
            optimizer=SGD(lr=1.0),
            admission=Admission(min_count=3),
        )
        first = ps.push_rows(name, np.array([7, 8, 8]), ones(3))  # 8 twice: counted once
        assert (first["rows"], first["created"], first["counted"]) == (0, 0, 2)
        ps.push_rows(name, np.array([7]), ones(1))
        assert np.all(ps.pull_rows(name, np.array([7, 8])) == 0.5)  # the initializer's rows
        table = info(url, name)
        assert table["rows"] == 0
        assert table["admission"] == {
            "min_count": 3,
            "ttl": None,
            "max_rows": None,
            "admitted": 0,
            "evicted": 0,
            "pending": 2,
            "forgotten": 0,
            "max_pending": table["admission"]["max_pending"],
        }
        third = ps.push_rows(name, np.array([7, 8]), ones(2))  # 7's third push, 8's second
        assert (third["rows"], third["created"], third["counted"]) == (1, 1, 1)
        rows = ps.pull_rows(name, np.array([7, 8]))
        assert np.all(rows[0] == -0.5) and np.all(rows[1] == 0.5)  # only the admitting push
        assert stored(url, name, [7, 8]) == [True, False]
        adm = info(url, name)["admission"]
        assert (adm["admitted"], adm["pending"]) == (1, 1)
        ps.push_rows(name, np.array([7, 8]), ones(2))
        rows = ps.pull_rows(name, np.array([7, 8]))
        assert np.all(rows[0] == -1.5) and np.all(rows[1] == -0.5)
        adm = info(url, name)["admission"]
        assert (adm["admitted"], adm["pending"]) == (2, 0)


def test_rows_unseen_for_ttl_updates_are_evicted(one):
    url, name = one.urls[0], fresh("ttl")
    with PSClient(one.urls, worker_id="w-ttl") as ps:
        ps.create_table(
            name, 4, initializer=Zeros(), optimizer=SGD(lr=1.0), admission=Admission(ttl=8)
        )
        ps.push_rows(name, np.array([1, 2]), ones(2))  # update 1
        for _ in range(7):  # updates 2..8: row 1 is 7 updates old
            ps.push_rows(name, np.array([2]), ones(1))
        assert stored(url, name, [1, 2]) == [True, True]
        ps.push_rows(name, np.array([2]), ones(1))  # update 9: row 1 is 8 old
        assert stored(url, name, [1, 2]) == [False, True]
        rows = ps.pull_rows(name, np.array([1, 2]))
        assert np.all(rows[0] == 0) and np.all(rows[1] == -9)
        table = info(url, name)
        assert table["rows"] == 1 and table["admission"]["evicted"] == 1
        ps.push_rows(name, np.array([1]), ones(1))  # starts again from the initializer
        assert np.all(ps.pull_rows(name, np.array([1])) == -1)


def test_past_max_rows_the_least_recently_updated_rows_are_evicted(one):
    url, name = one.urls[0], fresh("lru")
    with PSClient(one.urls, worker_id="w-lru") as ps:
        ps.create_table(
            name, 4, initializer=Zeros(), optimizer=SGD(lr=1.0), admission=Admission(max_rows=32)
        )
        for start in range(0, 32, 8):  # ids 0..31, 8 per update
            ps.push_rows(name, np.arange(start, start + 8), ones(8))
        ps.push_rows(name, np.arange(8), ones(8))  # ids 8..15 are now the least recent
        assert info(url, name)["rows"] == 32
        # 4 new rows: room for them plus 32 // 16 = 2 more, so 6 of 8..15 go
        ps.push_rows(name, np.arange(100, 104), ones(4))
        kept = stored(url, name, range(40))
        assert kept[:8] == [True] * 8 and kept[16:32] == [True] * 16
        assert sum(kept[8:16]) == 2
        assert stored(url, name, range(100, 104)) == [True] * 4
        table = info(url, name)
        assert table["rows"] == 30 and table["admission"]["evicted"] == 6
        assert np.all(ps.pull_rows(name, np.arange(8)) == -2)  # untouched by the eviction
        # more new rows in one push than max_rows: nothing to evict them for; refused whole
        with pytest.raises(BadRequestError, match=r"admission\.max_rows"):
            ps.push_rows(name, np.arange(1000, 1033), ones(33))
        assert info(url, name)["rows"] == 30 and stored(url, name, [1000]) == [False]


def test_pending_counts_are_bounded_and_forget_the_least_recent(fleet_factory):
    fleet = fleet_factory(1, "--max-pending-ids", "64")
    url, name = fleet.urls[0], fresh("bound")
    with PSClient(fleet.urls, worker_id="w-bound") as ps:
        ps.create_table(name, 4, admission=Admission(min_count=2))
        for k in range(4):  # 200 ids, 50 per push, each seen once
            assert ps.push_rows(name, np.arange(50 * k, 50 * k + 50), ones(50))["counted"] == 50
        adm = info(url, name)["admission"]
        assert adm["pending"] <= 64 and adm["max_pending"] == 64
        assert adm["pending"] + adm["forgotten"] == 200
        # the latest ids are remembered: their second push admits them
        assert ps.push_rows(name, np.arange(150, 200), ones(50))["created"] == 50
        # the first ones were forgotten: counted from 0 again
        assert ps.push_rows(name, np.arange(0, 10), ones(10))["counted"] == 10


def test_counts_and_evictions_survive_a_restart(fleet_factory):
    fleet = fleet_factory(1, data=True)
    url, name = fleet.urls[0], fresh("restart")
    with PSClient(fleet.urls, worker_id="w-restart") as ps:
        ps.create_table(
            name,
            4,
            initializer=Zeros(),
            optimizer=SGD(lr=1.0),
            admission=Admission(min_count=2, ttl=4),
        )
        ps.push_rows(name, np.array([1, 2]), ones(2))  # counted
        ps.push_rows(name, np.array([1]), ones(1))  # 1 admitted, update 2
        for _ in range(4):
            ps.push_rows(name, np.array([3]), ones(1))  # 3 admitted at update 4
        before = info(url, name)
        assert before["admission"]["evicted"] == 1  # row 1, at update 6
        ps.checkpoint()
    fleet.kill(0)
    fleet.start(0)
    after = info(url, name)
    for key in ("admitted", "evicted", "pending", "forgotten", "min_count", "ttl"):
        assert after["admission"][key] == before["admission"][key], key
    assert after["rows"] == before["rows"] == 1
    with PSClient(fleet.urls, worker_id="w-restart-2") as ps:
        # 2's count (1) came back: its second push admits it
        assert ps.push_rows(name, np.array([2]), ones(1))["created"] == 1
        assert np.all(ps.pull_rows(name, np.array([2, 3])) == [[-1] * 4, [-3] * 4])


@pytest.mark.parametrize(
    "admission, field",
    [
        ({"min_count": 0}, "admission.min_count"),
        ({"min_count": "3"}, "admission.min_count"),
        ({"ttl": 0}, "admission.ttl"),
        ({"max_rows": -1}, "admission.max_rows"),
        ({"max_rows": True}, "admission.max_rows"),
        ({"lru": 5}, "admission.lru"),
        ([1, 2], "admission"),
    ],
)
def test_a_bad_admission_is_refused_naming_the_field(one, admission, field):
    url, name = one.urls[0], fresh("bad")
    spec = {"dim": 4, "admission": admission}
    status, reply = post(url, "create_table", {"name": name, "spec": spec})
    assert status == 400 and reply["error"]["details"]["field"] == field, reply
    assert httpx2.get(f"{url}/v1/tables/{name}", timeout=10).status_code == 404
    if isinstance(admission, dict) and "lru" not in admission:  # the SDK says it first
        with pytest.raises(SpecError) as exc:
            Admission(**admission)
        assert exc.value.field == field


def test_another_admission_on_re_create_is_a_conflict_naming_it(one):
    name = fresh("again")
    with PSClient(one.urls, worker_id="w-again") as ps:
        assert ps.create_table(name, 4, admission=Admission(min_count=2)) is True
        assert ps.create_table(name, 4, admission=Admission(min_count=2)) is False
        with pytest.raises(ConflictError) as exc:
            ps.create_table(name, 4, admission=Admission(min_count=3))
        assert exc.value.details["field"] == "admission"
    assert TableSpec(4).admission.off and not Admission(ttl=3).off
