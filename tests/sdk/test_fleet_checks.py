"""Fleet-level behaviour of the SDK: waiting for variables and shards, and refusing a shard
list that disagrees with the fleet (order, size, a fleet restarted in another order)."""

from __future__ import annotations

import threading
import uuid

import httpx2
import numpy as np
import pytest

from client_sdk import FleetMismatchError, NotReadyError, PSClient, ShardUnavailableError, wire
from client_sdk.optimizers import Add
from client_sdk.placement import shard_for
from tests.helpers.eventually import eventually
from tests.helpers.ports import refused_port


def name_on(shard: int, n: int = 2, prefix: str = "v") -> str:
    while True:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        if shard_for(name, n) == shard:
            return name


def long_poll_bytes(url: str) -> int:
    """The bytes of requests in flight on a shard: a long poll counts its body until it answers
    (docs/PROTOCOL.md: ``/v1/cluster``'s ``admission``)."""
    return httpx2.get(url + "/v1/cluster").json()["admission"]["bytes_in_flight"]


class Waiter(threading.Thread):
    """Runs ``wait_ready`` in a thread and keeps its outcome."""

    def __init__(self, client: PSClient, names: list[str], timeout: float) -> None:
        super().__init__(daemon=True)
        self.client, self.names, self.timeout = client, names, timeout
        self.calling = threading.Event()
        self.error: BaseException | None = None
        self.returned = False

    def run(self) -> None:
        self.calling.set()
        try:
            self.client.wait_ready(self.names, timeout=self.timeout)
            self.returned = True
        except BaseException as exc:  # reported by the test
            self.error = exc


# -- wait_ready --------------------------------------------------------------------------------


def test_wait_ready_returns_once_another_worker_inits(fleet2):
    names = [name_on(0, prefix="late"), name_on(1, prefix="late")]
    with (
        PSClient(fleet2.urls, worker_id="waiter") as waiting,
        PSClient(fleet2.urls, worker_id="chief") as chief,
    ):
        idle = [long_poll_bytes(url) for url in fleet2.urls]
        waiter = Waiter(waiting, names, timeout=60)
        waiter.start()
        eventually(
            lambda: all(long_poll_bytes(u) > b for u, b in zip(fleet2.urls, idle)),
            "the waiter's long polls are in on both shards",
        )
        assert waiter.is_alive() and not waiter.returned  # nothing exists yet
        chief.init({names[0]: np.zeros(3)})
        eventually(
            lambda: long_poll_bytes(fleet2.urls[0]) == idle[0], "shard 0 answers its long poll"
        )
        assert long_poll_bytes(fleet2.urls[1]) > idle[1]  # shard 1's goes on
        assert waiter.is_alive() and not waiter.returned  # half of what it waits for
        chief.init({names[1]: np.ones(3)})
        waiter.join(30)
        assert waiter.error is None and waiter.returned
        np.testing.assert_array_equal(waiting.pull(names)[names[1]], np.ones(3))


def test_wait_ready_before_the_shards_are_started(fleet_factory):
    fleet = fleet_factory(2)
    for i in range(2):
        fleet.stop(i)  # the ports are known; nothing listens on them now
    names = [name_on(0), name_on(1)]
    client = PSClient(fleet.urls)  # constructing does no I/O
    waiter = Waiter(client, names, timeout=60)
    waiter.start()
    waiter.calling.wait(10)
    for i in range(2):
        fleet.start(i)  # each takes a while: the waiter meets closed ports first
    eventually(
        lambda: all(long_poll_bytes(url) for url in fleet.urls),
        "the waiter's long polls are in on both shards, once they are up",
    )
    assert waiter.is_alive() and waiter.error is None
    with PSClient(fleet.urls) as chief:
        chief.init({n: np.zeros(2) for n in names})
    waiter.join(60)
    assert waiter.error is None and waiter.returned
    client.close()


def test_not_ready_error_lists_what_is_missing(fleet2):
    present, absent = name_on(0, prefix="here"), name_on(1, prefix="never")
    with PSClient(fleet2.urls) as ps:
        ps.init({present: np.zeros(1)})
        with pytest.raises(NotReadyError) as info:
            ps.wait_ready([present, absent], timeout=0.5)
    assert info.value.missing == [absent]
    assert absent in str(info.value) and present not in str(info.value)
    assert "init" in str(info.value) and fleet2.urls[1] in str(info.value)


def test_not_ready_error_when_a_shard_never_comes_up():
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        with PSClient([url]) as ps:
            with pytest.raises(NotReadyError, match="not reachable") as info:
                ps.wait_ready(["w"], timeout=1.0)
    assert info.value.missing == ["w"] and url in str(info.value)


# -- the shard list against the fleet ------------------------------------------------------------


def test_misrouted_request_is_refused_with_421(fleet2):
    name = name_on(1)
    body = wire.encode({"names": [name]}).join()
    headers = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}
    with httpx2.Client() as http:
        # to the shard that does not own the name
        r = http.post(fleet2.urls[0] + "/v1/pull", content=body, headers=headers)
        assert r.status_code == 421
        err = wire.unpack(r.content, r.headers["content-type"])["error"]
        assert err["code"] == "not_owner" and err["details"]["owners"] == {name: 1}
        # to the right shard, but saying it is meant for another one
        r = http.post(
            fleet2.urls[1] + "/v1/pull",
            content=body,
            headers={**headers, "x-paramshard-fleet": "0/2"},
        )
        assert r.status_code == 421
        assert (
            wire.unpack(r.content, r.headers["content-type"])["error"]["code"] == "fleet_mismatch"
        )


def test_shard_list_in_the_wrong_order_is_refused(fleet2):
    name = name_on(0, prefix="wrongorder")
    with PSClient(list(reversed(fleet2.urls))) as ps:
        with pytest.raises(FleetMismatchError) as info:
            ps.init({name: np.zeros(2)})
    message = str(info.value)
    assert "reports index 1 of 2 but is listed at position 0" in message
    assert "--shard-index" in message and fleet2.urls[1] in message
    with PSClient(fleet2.urls) as ps:
        assert name not in {s["name"] for s in ps.variables()}  # nothing was created


def test_shard_list_of_the_wrong_length_is_refused(fleet2):
    with PSClient(fleet2.urls[:1]) as ps:
        with pytest.raises(FleetMismatchError, match="fleet of 2 shards but 1 are listed"):
            ps.pull(["w"])
    with (
        refused_port() as port,
        PSClient([*fleet2.urls, f"http://127.0.0.1:{port}"], retry_deadline=1.0) as ps,
    ):
        with pytest.raises(FleetMismatchError, match="fleet of 2 shards but 3 are listed"):
            ps.increment("steps")


def test_fleet_restarted_in_another_order_is_caught(fleet_factory):
    fleet = fleet_factory(2)
    name = name_on(0)
    with PSClient(fleet.urls) as ps:
        ps.init({name: np.zeros(2)})
        ps.pull([name])
        for i in range(2):
            fleet.stop(i)
        # Restart the fleet with the shard processes on each other's ports.
        fleet.ports.reverse()
        fleet.urls.reverse()
        for i in range(2):
            fleet.start(i)
        with pytest.raises(FleetMismatchError, match="--shard-index"):
            ps.pull([name])
        with pytest.raises(FleetMismatchError):  # and again: never half-wrong
            ps.push({name: np.ones(2)})


def test_restarted_shard_is_checked_again_and_its_cached_values_dropped(fleet_factory):
    fleet = fleet_factory(1)
    rec: list[str] = []

    class Recording(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            rec.append(request.url.path)
            return super().handle_request(request)

    old, new = np.zeros(4), np.arange(4.0)
    with PSClient(fleet.urls, transport=Recording()) as ps, PSClient(fleet.urls) as other:
        ps.init({"w": old})
        np.testing.assert_array_equal(ps.pull(["w"])["w"], old)  # cached at version 0
        fleet.stop(0)
        fleet.start(0)
        created = other.init({"w": new})["w"]["created"]
        expected = new if created else old  # a shard that restores snapshots keeps "old"
        rec.clear()
        got = ps.pull(["w"])["w"]
        np.testing.assert_array_equal(got, expected)
        assert got.shape == (4,)
        # The new incarnation, seen on the reply, triggers a fresh cluster check next call.
        ps.pull(["w"])
        assert "/v1/cluster" in rec


def test_direct_pull_after_a_restart_pulls_again_what_the_cache_cannot_stand_for(fleet_factory):
    # The shard comes back without state and the variable is made again at the version the
    # client holds: the reply says "not modified" from another incarnation, so the pull
    # (the direct path's: native connections, one shard) must ask again without versions.
    fleet = fleet_factory(1)
    old, new = np.zeros(4), np.arange(4.0)
    with PSClient(fleet.urls) as ps, PSClient(fleet.urls) as other:
        ps.init({"w": old})
        ps.pull(["w"])  # the shard checked, "w" cached at version 0
        np.testing.assert_array_equal(ps.pull(["w"])["w"], old)
        fleet.stop(0)
        fleet.start(0)
        assert other.init({"w": new})["w"] == {"version": 0, "created": True}
        np.testing.assert_array_equal(ps.pull(["w"])["w"], new)
        np.testing.assert_array_equal(ps.pull(["w"])["w"], new)


def test_direct_pull_of_a_variable_deleted_and_made_again_by_another_worker(fleet1):
    # Made again at the version this client holds: only the reply's deletions header says
    # that its value is another, so the repeated pulls' shortcut past re-checking the
    # headers must not be taken for it.
    name = f"again_{uuid.uuid4().hex[:8]}"
    old, new = np.zeros(4), np.arange(4.0)
    with PSClient(fleet1.urls) as ps, PSClient(fleet1.urls) as other:
        ps.init({name: old})
        for _ in range(2):
            np.testing.assert_array_equal(ps.pull([name])[name], old)
        assert other.delete([name]) == [name]
        assert other.init({name: new})[name] == {"version": 0, "created": True}
        np.testing.assert_array_equal(ps.pull([name])[name], new)


def test_direct_pull_of_one_name_takes_a_reply_with_its_value_in_one_pass(fleet1, monkeypatch):
    # A reply with the one row's value is taken without the general decode and take, into
    # what they would give (a read-only view, cached at the reply's version); any other reply
    # (a row the cache stands for, a matrix) goes through them.
    from client_sdk import _direct

    vec, mat = (f"one_{k}_{uuid.uuid4().hex[:8]}" for k in "vm")
    taken = []

    def counted(*args):
        taken.append(args)
        return take(*args)

    take = _direct.take
    monkeypatch.setattr(_direct, "take", counted)
    with PSClient(fleet1.urls) as ps:
        ps.init({vec: np.arange(5, dtype=np.float32), mat: np.ones((2, 2))}, Add())
        for step in range(3):
            got = ps.pull([vec])[vec]
            np.testing.assert_array_equal(got, np.arange(5) + step)
            assert not got.flags.writeable and got.dtype == np.float32
            assert ps._core.cache.entries[vec][1:] == (step, got)
            ps.push({vec: np.ones(5, np.float32)})
        assert taken == []
        np.testing.assert_array_equal(ps.pull([vec])[vec], np.arange(5) + 3)
        assert ps.pull([vec])[vec] is ps._core.cache.entries[vec][2]  # not sent again
        assert len(taken) == 1
        np.testing.assert_array_equal(ps.pull([mat])[mat], np.ones((2, 2)))
        assert len(taken) == 2


def test_a_pull_answers_in_the_callers_order_whichever_values_changed(fleet1):
    # The reply puts the values that changed before those the cache stands for.
    a, b = (f"order_{k}_{uuid.uuid4().hex[:8]}" for k in "ab")
    with PSClient(fleet1.urls) as ps:
        ps.init({a: np.zeros(4), b: np.zeros(4)}, Add())
        assert list(ps.pull([a, b])) == [a, b]
        ps.push({b: np.ones(4)})
        pulled = ps.pull([a, b])
        assert list(pulled) == [a, b]
        np.testing.assert_array_equal(pulled[b], np.ones(4))


def test_a_pull_from_one_shard_still_checks_every_shard_first(fleet_factory):
    # As every verb does: a shard of the list that was never checked (it is down) fails the
    # pull even of names on another one, the direct path's (one shard) included.
    fleet = fleet_factory(2)
    name = name_on(0)
    with PSClient(fleet.urls) as other:
        other.init({name: np.zeros(2)})
    fleet.stop(1)
    with PSClient(fleet.urls, retry_deadline=0.3) as ps:
        for _ in range(2):  # the first checks shard 0, which the second then finds checked
            with pytest.raises(ShardUnavailableError):
                ps.pull([name])


def test_wait_ready_fails_fast_on_a_wrong_shard_list(fleet2):
    with PSClient(list(reversed(fleet2.urls))) as ps:
        with pytest.raises(FleetMismatchError):  # not a NotReadyError after the timeout
            ps.wait_ready(["x"], timeout=60)
