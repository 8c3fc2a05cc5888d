"""The rule that leaves a primary that stopped answering (client_sdk/_stalls.py), on answers
made up here: which ``GET /v1/cluster`` answers move a stalled exchange to another replica, and
which leave it waiting. The whole of it, against real replicas frozen under workers, is
tests/e2e/test_failover_stalled.py."""

from __future__ import annotations

import json
import time

from client_sdk._flow import Reply
from client_sdk._replicas import Replicas
from client_sdk._stalls import Stalls

A, B = "http://a:7100", "http://b:7100"


def answer(role: str, epoch: int, primary: str | None = None, ttl: int | None = 2) -> Reply:
    info = {
        "replication": {"role": role, "epoch": epoch, "primary": primary},
        "leadership": {"lease_ttl": ttl} if ttl is not None else None,
    }
    return Reply(200, {"content-type": "application/json"}, json.dumps(info).encode())


def stalls() -> Stalls:
    s = Stalls(Replicas([[A, B]]))
    s.note_cluster(0, json.loads(bytes(answer("primary", 7).content)))  # the fleet check: A
    return s


def due(s: Stalls, url: str = A):
    watched = s.begin(0, url)
    assert watched is not None
    watched.due = time.monotonic() - 1  # no answer for a lease TTL
    return watched


def test_a_stalled_exchange_moves_to_another_replica_leading_at_a_higher_epoch():
    s = stalls()
    w = due(s)
    began = time.monotonic()
    assert s.settle(0, [None, answer("primary", 9)], began)  # A says nothing: frozen
    assert w.superseded and w.abort.fired.is_set()
    assert s.replicas.current[0] == B and s.replicas.epochs[0] == 9


def test_a_primary_still_named_by_the_group_is_not_left():
    s = stalls()
    w = due(s)
    began = time.monotonic()
    assert not s.settle(0, [None, answer("backup", 7, primary=A)], began)  # the lease holds
    assert not s.settle(0, [answer("primary", 7), answer("backup", 7, A)], began)  # slow
    assert not w.superseded and s.replicas.current[0] == A
    assert w.due > began  # checked again one lease TTL later


def test_a_replica_at_a_lower_epoch_is_not_followed_and_answers_so_far_decide_only_above():
    s = stalls()
    w = due(s)
    began = time.monotonic()
    assert not s.settle(0, [None, answer("primary", 5)], began)  # a stale primary
    assert not w.superseded
    stalled = {A}
    assert s.verdict(0, stalled, [None, answer("primary", 8)], whole=False) == (B, 8)
    assert s.verdict(0, stalled, [None, answer("primary", 7)], whole=False) is None


def test_a_group_without_leadership_is_not_watched_and_the_lease_ttl_is_learnt():
    s = Stalls(Replicas([[A, B], [A + "0"]]))
    assert s.begin(1, A + "0") is None  # one replica: nothing to follow
    s.note_cluster(0, {"leadership": {"lease_ttl": 5}})
    assert s.ttls[0] == 5.0
    s.note_cluster(0, {"leadership": None})  # a static group: nobody is ever elected
    assert s.begin(0, A) is None
