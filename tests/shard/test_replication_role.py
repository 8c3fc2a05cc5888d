"""A replica's role (server/replication/role.py) and the flags that set it statically.

The role object is driven directly (leadership calls it the same way); the flags are checked
through :class:`~server.config.ShardConfig`, and one real shard started with a replica group
shows its role in ``GET /v1/cluster``. What a role makes a shard do with writes is
tests/shard/test_replication.py's.
"""

from __future__ import annotations

import time

import pytest

from client_sdk import NotPrimaryError, ShardUnavailableError
from client_sdk._exceptions import error_for_status
from client_sdk.wire import ERROR_STATUS
from server.config import InvalidSetting, ShardConfig
from server.errors import ShardError
from server.replication import BACKUP, PRIMARY, STANDALONE, UNKNOWN, Role
from tests.conftest import http_json

A, B, C = "http://a:7100", "http://b:7100", "http://c:7100"


def test_without_a_group_a_shard_is_standalone_and_takes_writes():
    role = Role.from_config((), None)
    assert role.kind == STANDALONE and role.epoch == 0 and role.acknowledges
    role.check_writable()
    with pytest.raises(RuntimeError):
        role.become_primary(1)


def test_the_groups_first_url_is_primary_at_epoch_1_and_the_others_its_backups():
    primary = Role.from_config((A, B, C), A)
    assert (primary.kind, primary.epoch, primary.primary, primary.in_sync) == (
        PRIMARY,
        1,
        A,
        (B, C),
    )
    backup = Role.from_config((A, B, C), C)
    assert (backup.kind, backup.epoch, backup.primary, backup.in_sync) == (BACKUP, 1, A, ())
    with pytest.raises(ShardError) as refused:
        backup.check_writable()
    assert refused.value.code == "not_primary" and refused.value.status == 421
    assert refused.value.details == {"role": BACKUP, "epoch": 1, "primary": A}


def test_leadership_changes_are_told_to_listeners_and_epochs_never_go_down():
    role = Role(B, replicated=True)
    assert role.kind == UNKNOWN and not role.acknowledges
    seen = []
    role.subscribe(lambda old, new: seen.append((old.kind, new.kind, new.epoch)))
    role.become_backup(A, 3)
    role.become_primary(5, [A, B, C])
    assert role.in_sync == (A, C)  # never itself
    role.set_in_sync([C])
    role.step_down()
    assert not role.acknowledges and role.epoch == 5 and role.primary is None
    with pytest.raises(ShardError) as refused:
        role.check_writable()
    assert refused.value.details["primary"] is None
    with pytest.raises(ValueError):
        role.become_primary(4)
    with pytest.raises(RuntimeError):
        role.set_in_sync([A])  # not primary
    assert seen == [
        (UNKNOWN, BACKUP, 3),
        (BACKUP, PRIMARY, 5),
        (PRIMARY, PRIMARY, 5),
        (PRIMARY, UNKNOWN, 5),
    ]


def test_forwarded_entries_of_a_lower_epoch_are_refused_and_a_higher_one_demotes_a_primary():
    role = Role.from_config((A, B), A)
    role.become_primary(4, [B])
    for epoch in (3, 4):  # below, or its own epoch as primary
        with pytest.raises(ShardError) as refused:
            role.accept_forwarded(epoch, B)
        assert refused.value.code == "stale_epoch" and refused.value.status == 409
        assert role.kind == PRIMARY
    role.accept_forwarded(7, B)
    assert (role.kind, role.epoch, role.primary) == (BACKUP, 7, B)
    role.accept_forwarded(7, B)
    with pytest.raises(ShardError):
        role.accept_forwarded(6, A)
    standalone = Role.from_config((), None)
    with pytest.raises(ShardError) as refused:
        standalone.accept_forwarded(1, A)
    assert refused.value.code == "conflict"


def test_the_sdk_raises_not_primary_as_an_unavailable_shard_naming_the_primary():
    assert ERROR_STATUS["not_primary"] == 421 and ERROR_STATUS["stale_epoch"] == 409
    cls = error_for_status(421, "not_primary")
    assert cls is NotPrimaryError and issubclass(cls, ShardUnavailableError)
    exc = cls("x", status=421, code="not_primary", details={"primary": A, "epoch": 2})
    assert exc.primary == A
    assert cls("x", details={"primary": None}).primary is None


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        ({"replica_group": f"{A}|{B}"}, "--advertise-url"),
        ({"replica_group": f"{A}|{B}", "advertise_url": C}, "--advertise-url"),
        ({"replica_group": f"{A}|{A}", "advertise_url": A}, "--replica-group"),
        ({"replica_group": A, "advertise_url": A}, "--replica-group"),
        ({"replica_group": f"{A}|ftp://b", "advertise_url": A}, "--replica-group"),
        ({"advertise_url": "b:7100"}, "--advertise-url"),
        ({"replication_log_bytes": "12"}, "--replication-log-bytes"),
    ],
)
def test_bad_replication_flags_are_refused_naming_the_flag(flags, key):
    with pytest.raises(InvalidSetting) as exc:
        ShardConfig.from_sources(flags, {})
    assert exc.value.key.startswith(key)


def test_the_flags_and_their_variables_give_the_group():
    config = ShardConfig.from_sources(
        {"advertise_url": B + "/"},
        {"PARAMSHARD_REPLICA_GROUP": f" {A} | {B}/ ", "PARAMSHARD_REPLICATION_LOG_BYTES": "1MiB"},
    )
    assert config.replica_group == (A, B) and config.advertise_url == B
    assert config.replication_log_bytes == 1 << 20


def test_index_in_the_group_and_the_own_url_is_the_shard_index(monkeypatch):
    """One pod spec for every pod of a StatefulSet: ``{index}`` is the index from the flag or,
    with ``auto``, from the host name's ordinal (docker/k8s/shards.yaml)."""
    group = "http://ps-a-{index}.ps:7100|http://ps-b-{index}.ps:7100"
    env = {"PARAMSHARD_REPLICA_GROUP": group, "PARAMSHARD_NUM_SHARDS": "4"}
    config = ShardConfig.from_sources(
        {"shard_index": "2", "advertise_url": "http://ps-b-{index}.ps:7100"}, env
    )
    assert config.replica_group == ("http://ps-a-2.ps:7100", "http://ps-b-2.ps:7100")
    assert config.advertise_url == "http://ps-b-2.ps:7100"
    monkeypatch.setattr("server.config.socket.gethostname", lambda: "ps-a-3")
    env |= {
        "PARAMSHARD_SHARD_INDEX": "auto",
        "PARAMSHARD_ADVERTISE_URL": "http://ps-a-{index}.ps:7100",
    }
    config = ShardConfig.from_sources({}, env)
    assert config.shard_index == 3 and config.advertise_url == "http://ps-a-3.ps:7100"
    assert config.replica_group == ("http://ps-a-3.ps:7100", "http://ps-b-3.ps:7100")


def test_a_shard_shows_its_role_in_cluster(fleet_factory):
    fleet = fleet_factory(1, "--replica-group", f"{A}|{B}", "--advertise-url", B)
    shown = http_json(fleet.urls[0] + "/v1/cluster")["replication"]
    assert {k: shown[k] for k in ("role", "epoch", "url", "primary", "in_sync", "lsn")} == {
        "role": BACKUP,
        "epoch": 1,
        "url": B,
        "primary": A,
        "in_sync": [],
        "lsn": 0,
    }
    alone = fleet_factory(1)
    shown = http_json(alone.urls[0] + "/v1/cluster")["replication"]
    assert shown["role"] == STANDALONE and shown["epoch"] == 0


def test_a_primary_past_its_lease_deadline_takes_no_write():
    role = Role.from_config((A, B), A)
    role.hold_until(time.monotonic() + 60)
    role.check_writable()
    role.hold_until(time.monotonic() - 0.001)
    assert not role.acknowledges and role.kind == PRIMARY
    with pytest.raises(ShardError) as refused:
        role.check_writable()
    assert refused.value.code == "not_primary"
    role.hold_until(None)
    assert role.acknowledges
