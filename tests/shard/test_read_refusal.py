"""Which replica answers which data-plane read (server/replication/reads.py), role by role.

The rule is a pure function of the replica's role, what its leadership in etcd says of it, and
whether the read allows a backup; each case below is one line of docs/PROTOCOL.md §6 (Who
answers what, Reads from a backup). The real shards and the SDK around it are
tests/e2e/test_backup_reads.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.replication.reads import allows_backup, refusal
from server.replication.role import Role

A, B = "http://a:7100", "http://b:7100"


def role(kind: str) -> Role:
    r = Role(B, replicated=kind != "standalone")
    if kind == "primary":
        r.become_primary(3, [A])
    elif kind == "backup":
        r.become_backup(A, 3)
    elif kind == "lapsed":  # a primary whose lease ran out
        r.become_primary(3, [A])
        r.hold_until(0.0)
    return r


IN_SYNC = SimpleNamespace(eligible=True)
NOT_IN_SYNC = SimpleNamespace(eligible=False)


@pytest.mark.parametrize(
    "kind, leadership, allow, answered",
    [
        ("standalone", None, False, True),
        ("primary", None, False, True),
        ("primary", NOT_IN_SYNC, False, True),
        ("backup", None, False, False),  # a static backup, a plain read
        ("backup", None, True, True),  # ... a read that allows a backup
        ("backup", IN_SYNC, True, True),  # etcd lists it in-sync
        ("backup", NOT_IN_SYNC, True, False),  # etcd does not (restarted, resyncing)
        ("unknown", None, True, False),  # stepped down, or not told its primary yet
        ("lapsed", None, False, False),
        ("lapsed", None, True, False),
    ],
)
def test_who_answers_a_read(kind, leadership, allow, answered):
    got = refusal(role(kind), leadership, allow)
    if answered:
        assert got is None
        return
    assert got is not None and got.code == "not_primary" and got.status == 421
    if kind in ("backup", "lapsed"):
        assert got.details["primary"] == (A if kind == "backup" else B)
    if leadership is NOT_IN_SYNC:
        assert got.details["in_sync"] is False and A in got.message
    elif not allow:
        assert "x-paramshard-allow-backup" in got.message


@pytest.mark.parametrize(
    "value, allows",
    [(None, False), (b"1", True), ("1", True), (b" 1 ", True), (b"0", False), (b"yes", False)],
)
def test_only_1_allows_a_backup(value, allows):
    assert allows_backup(value) is allows
