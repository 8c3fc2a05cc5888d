"""Step groups end to end (``ps.group(names)``, docs/PROTOCOL.md §3, Step groups): the same
values, versions and optimizer state as per-variable pulls and pushes, over several shards;
a retried push applied once; a group the shard forgot registered again unseen (a restart, an
id it does not hold); a deleted variable refused with a clear error, never another's bytes;
bad registrations and bodies refused with nothing applied; a replica group's backup applying
a group push like any push. Real shard processes and HTTP.
"""

from __future__ import annotations

import uuid

import httpx2
import msgpack
import numpy as np
import pytest

from client_sdk import (
    AsyncPSClient,
    BadRequestError,
    BadTensorError,
    ConflictError,
    PSClient,
    ShardUnavailableError,
    StaleGroupError,
    UnknownVariableError,
)
from client_sdk._verbs import group as group_flow
from client_sdk.modes import Sync
from client_sdk.optimizers import SGD, Adam
from client_sdk.wire import groups as group_wire
from tests.conftest import OnLoop, http_json
from tests.helpers.dropproxy import DroppingProxy
from tests.helpers.names import fresh, spread
from tests.helpers.replicas import cluster, start_group

MSGPACK = {"content-type": "application/msgpack"}


def _model(run: str) -> dict[str, np.ndarray]:
    """Float32 variables of several shapes, two on each of 3 shards (a uniform run and not)."""
    names = spread(run, 3, each=3)
    shapes = [(3, 4), (5,), (5,), (2, 2, 2), (7,), (1,), (6,), (6,), (6,)]
    rng = np.random.default_rng(len(run))
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in zip(names, shapes)}


def test_a_group_moves_what_per_variable_calls_move(ps3):
    """Two copies of one model, one trained through a group, one per variable: the same
    values, versions and Adam state (its next steps agree) after every step."""
    a, b = _model(fresh("ga")), _model(fresh("gb"))
    twin = dict(zip(a, b))
    b = {twin[n]: v for n, v in a.items()}  # the same initial values
    ps3.init(a, optimizer=Adam(lr=0.05))
    ps3.init(b, optimizer=Adam(lr=0.05))
    g = ps3.group(list(a))
    assert g.names == list(a) and list(g.views) == list(a)
    rng = np.random.default_rng(0)
    for step in range(3):
        mine = g.pull()
        theirs = ps3.pull(list(b))
        for n in a:
            np.testing.assert_array_equal(mine[n], theirs[twin[n]])
        assert g.versions == {n: step for n in a}
        grads = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in a.items()}
        result = g.push(grads)
        assert result["applied"] == len(a) and result["variables"] == {}
        assert result["versions"] == {n: step + 1 for n in a}
        ps3.push({twin[n]: grad for n, grad in grads.items()})
    final = g.pull()
    theirs = ps3.pull(list(b))
    for n in a:
        np.testing.assert_array_equal(final[n], theirs[twin[n]])
        assert final[n] is g.views[n]  # received into the group's own buffer


def test_a_group_pulls_into_the_callers_buffers_and_pushes_one_flat_array(fleet1):
    names = [f"{fresh('flat')}/v{i}" for i in range(4)]
    with PSClient(fleet1.urls, worker_id=fresh("w")) as ps:
        ps.init({n: np.full(3, float(i), np.float32) for i, n in enumerate(names)}, SGD(lr=1.0))
        g = ps.group(names)
        out = np.zeros(12, np.float32)
        got = g.pull(out=out)
        np.testing.assert_array_equal(out, np.repeat(np.arange(4, dtype=np.float32), 3))
        assert list(got) == names and np.shares_memory(got[names[1]], out)
        np.testing.assert_array_equal(got[names[1]], [1.0, 1.0, 1.0])
        g.push(np.ones(12, np.float32))  # SGD(lr=1): every value - 1
        mine = {n: np.zeros(3, np.float32) for n in names}
        assert g.pull(out=mine) == mine
        for i, n in enumerate(names):
            np.testing.assert_array_equal(mine[n], np.full(3, i - 1.0, np.float32))
        with pytest.raises(BadTensorError):
            g.pull(out=np.zeros(11, np.float32))
        with pytest.raises(BadTensorError):
            g.push(np.ones(12, np.float64))
        with pytest.raises(BadRequestError):
            g.push({names[0]: np.ones(3, np.float32)})  # not every variable of the group
        assert ps.pull(names)[names[0]][0] == -1.0  # nothing of the refused pushes applied
        g.grads[names[2]][...] = 2.0  # the group's own gradient buffer, pushed as it is
        g.push()
        after = ps.pull(names)
        assert [float(after[n][0]) for n in names] == [-1.0, 0.0, -1.0, 2.0]


def test_a_big_group_is_received_from_the_socket_into_its_buffer(fleet1):
    """320 KB: more than comes with the reply's head, so the values go from the socket into
    the flat buffer (GroupSink), the caller's when given."""
    names = [f"{fresh('big')}/v{i:02d}" for i in range(20)]
    rng = np.random.default_rng(1)
    values = {n: rng.standard_normal(4000).astype(np.float32) for n in names}
    with PSClient(fleet1.urls, worker_id=fresh("w")) as ps:
        ps.init(values)
        g = ps.group(names)
        sink = g._state.parts[0].sink
        got = g.pull()
        assert sink is not None and sink.received is not None  # taken apart by the sink
        for n in names:
            np.testing.assert_array_equal(got[n], values[n])
        out = np.zeros(80_000, np.float32)
        g.pull(out=out)
        assert sink.received is not None and sink.target is out
        np.testing.assert_array_equal(out, np.concatenate([values[n] for n in names]))


def test_a_retried_group_push_is_applied_once(fleet1):
    names = [f"{fresh('retry')}/v{i}" for i in range(3)]
    with PSClient(fleet1.urls, worker_id=fresh("w")) as ps:
        ps.init({n: np.zeros(2, np.float32) for n in names}, SGD(lr=1.0))
        g = ps.group(names)
        grads = {n: np.ones(2, np.float32) for n in names}
        seq = ps._core.next_seq()
        first = ps._drive(group_flow.push(ps._core, g._state, grads, seq=seq))
        again = ps._drive(group_flow.push(ps._core, g._state, grads, seq=seq))
        assert first["applied"] == 3
        assert again["applied"] == 0
        assert {e["status"] for e in again["variables"].values()} == {"duplicate"}
        assert again["versions"] == {n: 1 for n in names}
        for value in ps.pull(names).values():
            np.testing.assert_array_equal(value, [-1.0, -1.0])


def test_a_group_on_one_shard_goes_direct_and_keeps_the_general_rules(fleet1):
    """The direct path (client_sdk/_direct.py) of a group on one http shard: a push whose
    reply is lost is retried with its seq (applied once); a reply that never comes is a
    timeout, retried until the retry deadline, then the general path's error."""
    names = [f"{fresh('direct')}/v{i}" for i in range(3)]
    with DroppingProxy(("127.0.0.1", fleet1.ports[0])) as relay:
        with PSClient([relay.url], worker_id=fresh("w"), timeout=0.5, retry_deadline=1.5) as ps:
            ps.init({n: np.zeros(2, np.float32) for n in names}, SGD(lr=1.0))
            g = ps.group(names)
            assert g._route is not None  # taken
            g.pull()
            relay.drop = lambda method, path, n: path == "/v1/group_push" and n == 1
            again = g.push({n: np.ones(2, np.float32) for n in names})
            assert relay.drops == 1
            assert again["applied"] == 0  # the lost reply's push was the one applied
            assert {e["status"] for e in again["variables"].values()} == {"duplicate"}
            for n, value in g.pull().items():
                np.testing.assert_array_equal(value, [-1.0, -1.0], err_msg=n)
            relay.deliver = lambda sock, method, path, reply: True  # never answers
            with pytest.raises(ShardUnavailableError, match="did not answer group_pull in time"):
                g.pull()
    with PSClient(fleet1.urls, worker_id=fresh("w"), transport=httpx2.HTTPTransport()) as ps:
        assert ps.group(names)._route is None  # an injected transport: the general path


def test_a_forgotten_group_is_registered_again_unseen(fleet_factory):
    fleet = fleet_factory(1, data=True)
    names = [f"again/v{i}" for i in range(3)]
    with PSClient(fleet.urls, worker_id="w-again", retry_deadline=30) as ps:
        ps.init({n: np.zeros(2, np.float32) for n in names}, SGD(lr=1.0))
        g = ps.group(names)
        g.push({n: np.ones(2, np.float32) for n in names})
        before = g._state.parts[0].gid
        ps.checkpoint(timeout=60)
        assert fleet.stop(0) == 0
        fleet.start(0)
        values = g.pull()  # the restarted shard holds no group: registered again
        assert g._state.parts[0].gid != before
        assert g.versions == {n: 1 for n in names}
        for n in names:
            np.testing.assert_array_equal(values[n], [-1.0, -1.0])
        g._state.parts[0].gid = "not-a-group"  # an id the shard never gave
        assert g.push({n: np.ones(2, np.float32) for n in names})["applied"] == 3
        assert g.pull()[names[0]][0] == -2.0


def test_a_deleted_variable_makes_the_group_stale_never_wrong(ps3):
    names = spread(fresh("stale"), 3, each=1)
    ps3.init({n: np.zeros(4, np.float32) for n in names})
    g = ps3.group(names)
    g.pull()
    ps3.delete([names[1]])
    with pytest.raises(StaleGroupError) as refused:
        g.pull()
    assert "make the group again" in str(refused.value)
    ps3.init({names[1]: np.ones(4, np.float32)})  # made again, same shape
    with pytest.raises(StaleGroupError) as refused:
        g.push({n: np.ones(4, np.float32) for n in names})
    assert "applied" in str(refused.value)  # by the other two shards, and it says so
    with pytest.raises(StaleGroupError):
        g.pull()
    assert ps3.pull([names[1]])[names[1]][0] == 1.0  # nothing applied on the refusing shard
    g = ps3.group(names)
    np.testing.assert_array_equal(g.pull()[names[1]], np.ones(4, np.float32))
    ps3.delete([names[2]])
    ps3.init({names[2]: np.ones(5, np.float32)})  # made again with another shape
    with pytest.raises(StaleGroupError):
        g.pull()


def _post(url: str, verb: str, msg: dict) -> httpx2.Response:
    return httpx2.post(f"{url}/v1/{verb}", content=msgpack.packb(msg), headers=MSGPACK)


def _code(reply: httpx2.Response) -> str:
    return msgpack.unpackb(reply.content)["error"]["code"]


def test_bad_groups_and_bodies_are_refused_changing_nothing(fleet_factory):
    fleet = fleet_factory(1, "--max-request-names", "8")
    url = fleet.urls[0]
    with PSClient(fleet.urls, worker_id="w-bad") as ps:
        ps.init({"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}, SGD(lr=1.0))
        ps.init({"d": np.zeros(2, np.float64)})
        ps.create_table("emb", 4)
        with pytest.raises(UnknownVariableError):
            ps.group(["a", "nope"])
        with pytest.raises(BadRequestError):
            ps.group(["a", "a"])
        with pytest.raises(ConflictError):
            ps.group(["a", "emb"])
        with pytest.raises(BadRequestError, match="one dtype"):
            ps.group(["a", "d"])
        assert _code(_post(url, "groups", {"names": ["a", "a"]})) == "bad_request"
        assert _code(_post(url, "groups", {"names": []})) == "bad_request"
        assert _code(_post(url, "groups", {"names": "a"})) == "bad_request"
        too_many = _post(url, "groups", {"names": [f"v{i}" for i in range(9)]})
        assert too_many.status_code in (400, 413) and _code(too_many) in (
            "bad_request",
            "too_large",
        )
        assert _post(url, "group_pull", {"group": "nope"}).status_code == 404
        assert _code(_post(url, "group_pull", {"group": "nope"})) == "unknown_group"
        assert _code(_post(url, "group_pull", {"group": 7})) == "bad_request"
        made = msgpack.unpackb(_post(url, "groups", {"names": ["a", "b"]}).content)
        assert made["shapes"] == [[2], [3]] and made["nbytes"] == 20
        gid = made["group"]
        assert msgpack.unpackb(_post(url, "groups", {"names": ["a", "b"]}).content)["group"] == gid

        def push(
            grads: np.ndarray, versions: np.ndarray | None = None, **fields
        ) -> httpx2.Response:
            msg = {"group": gid, "worker_id": "w-raw", "seq": 1, **fields}
            body = group_wire.encode(
                msg, versions, "grads", grads.dtype.str, [grads.data.cast("B")], grads.nbytes
            )
            return httpx2.post(
                f"{url}/v1/group_push",
                content=body.join(),
                headers={"content-type": body.content_type},
            )

        assert push(np.ones(4, np.float32)).status_code == 422  # 4 elements, not 5
        assert push(np.ones(5, np.float64)).status_code == 422
        assert push(np.array([1, 1, np.nan, 1, 1], np.float32)).status_code == 422
        assert push(np.ones(5, np.float32), np.zeros(3, np.int64)).status_code == 400
        assert push(np.ones(5, np.float32), seq="x").status_code == 400
        plain = _post(url, "group_push", {"group": gid, "worker_id": "w", "seq": 2, "grads": 1})
        assert plain.status_code == 400
        assert ps.pull(["a", "b"])["a"][0] == 0.0
        assert http_json(f"{url}/v1/variables/a")["version"] == 0
        ok = push(np.ones(5, np.float32), np.zeros(2, np.int64))
        assert ok.status_code == 200, ok.content
        assert msgpack.unpackb(ok.content)["versions"] == [1, 1]


def test_a_group_push_to_sync_variables_joins_their_rounds(fleet1):
    """A group push is a push: a sync variable's gradient joins its round (``accepted``, not
    counted as applied) and the round applies the mean once it is full."""
    names = [f"{fresh('sync')}/v{i}" for i in range(2)]
    with (
        PSClient(fleet1.urls, worker_id=fresh("w")) as ps,
        PSClient(fleet1.urls, worker_id=fresh("w")) as other,
    ):
        ps.init({n: np.zeros(2, np.float32) for n in names}, SGD(lr=1.0), sync=Sync(replicas=2))
        mine, theirs = ps.group(names), other.group(names)
        mine.pull()
        theirs.pull()
        first = mine.push({n: np.ones(2, np.float32) for n in names})
        assert first["applied"] == 0
        assert {e["status"] for e in first["variables"].values()} == {"accepted"}
        assert first["versions"] == {n: 0 for n in names}
        second = theirs.push({n: np.full(2, 3.0, np.float32) for n in names})
        assert second["versions"] == {n: 1 for n in names}
        for value in mine.pull().values():
            np.testing.assert_array_equal(value, [-2.0, -2.0])  # the mean of 1 and 3


def test_a_group_on_an_async_client(fleet1):
    names = [f"{fresh('async')}/v{i}" for i in range(3)]
    client = OnLoop(AsyncPSClient(fleet1.urls, worker_id=fresh("w")))
    try:
        client.init({n: np.zeros(2, np.float32) for n in names}, optimizer=SGD(lr=1.0))
        g = client.group(names)
        loop = client.loop
        loop.run_until_complete(g.push({n: np.ones(2, np.float32) for n in names}))
        values = loop.run_until_complete(g.pull())
        assert [float(values[n][0]) for n in names] == [-1.0, -1.0, -1.0]
    finally:
        client.close()


def test_a_backup_applies_a_group_push_as_its_primary_did(tmp_path):
    group = start_group(tmp_path / "replicas", 2)
    try:
        primary, backup = group.urls
        names = [f"rep/v{i}" for i in range(4)]
        with PSClient(f"{primary}|{backup}", worker_id="w-rep") as ps:
            ps.init({n: np.arange(3, dtype=np.float32) for n in names}, Adam(lr=0.1))
            g = ps.group(names)
            for _ in range(2):
                g.pull()
                g.push({n: np.ones(3, np.float32) for n in names})
            mine = {n: v.copy() for n, v in g.pull().items()}
        assert cluster(backup)["lsn"] == cluster(primary)["lsn"]
        with PSClient([backup], worker_id="r-" + uuid.uuid4().hex[:6]) as pb:
            theirs = pb.pull(names, allow_backup=True)
        for n in names:
            np.testing.assert_array_equal(theirs[n], mine[n])
            assert http_json(f"{backup}/v1/variables/{n}")["version"] == 2
    finally:
        group.close()
