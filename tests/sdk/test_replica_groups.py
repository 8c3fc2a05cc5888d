"""The SDK and replica groups (client_sdk/_replicas.py): the shard list's ``URL|URL`` syntax,
choosing the primary from the replicas' ``/v1/cluster``, and following it with real processes.

A static group (``--replica-group``, no etcd) listed backup first: every verb is refused by the
backup (421 ``not_primary``) and sent again to the primary, sync and asyncio alike. With etcd
(tests/e2e/test_failover.py) the same path rides out a primary's death.
"""

from __future__ import annotations

import json

import pytest

from client_sdk import AsyncPSClient, ConfigError, PSClient
from client_sdk._flow import Reply
from client_sdk._replicas import choose
from client_sdk._settings import load_settings
from tests.conftest import OnLoop, http_json
from tests.helpers.replicas import start_group

A, B, C, D = "http://a:7100", "http://b:7100", "http://c:7100", "http://d:7100"


def test_a_shard_list_takes_a_replica_group_per_index():
    s = load_settings(f"{A}|{B}, {C}", "w", environ={})
    assert s.shards == (A, C) and s.groups == ((A, B), (C,))
    s = load_settings([[A, B], f"{C}|{D}/"], "w", environ={})
    assert s.groups == ((A, B), (C, D))
    s = load_settings(None, "w", environ={"PARAMSHARD_SHARDS": f"{A}|{B},{C}|{D}"})
    assert s.groups == ((A, B), (C, D))


@pytest.mark.parametrize(
    "shards, says",
    [
        (f"{A}|{A}", "twice"),
        (f"{A}|{B},{B}", "twice"),
        ([f"{A}|ftp://x"], "invalid shard URL"),
        ([" | "], "names no URL"),
        ([[]], "names no URL"),
    ],
)
def test_a_bad_replica_group_is_a_config_error_naming_it(shards, says):
    with pytest.raises(ConfigError, match=says):
        load_settings(shards, "w", environ={})


def reply(view) -> Reply:
    body = json.dumps({"shard_index": 0, "replication": view}).encode()
    return Reply(200, {"content-type": "application/json"}, body)


def view(role, epoch, primary):
    return {"role": role, "epoch": epoch, "primary": primary, "url": None, "in_sync": []}


def test_the_primary_is_the_replica_saying_so_at_the_highest_epoch():
    group = (A, B, C)
    # an old primary that has not noticed yet says so too, at a lower epoch
    answers = [reply(view("primary", 3, A)), reply(view("primary", 7, B)), None]
    assert choose(group, answers) == (B, 7)
    # nobody says it is primary: the one a replica of the highest epoch names
    answers = [reply(view("backup", 7, C)), reply(view("unknown", 9, None)), None]
    assert choose(group, answers) == (C, 7)
    # a primary named outside the group is not followed; nothing known: None
    assert choose(group, [reply(view("backup", 7, D)), None, None]) is None
    bad = Reply(200, {}, b"not json")
    assert choose(group, [bad, Reply(503, {}, b"{}"), reply({"epoch": "x"})]) is None


@pytest.fixture(scope="module")
def static_group(tmp_path_factory):
    """Two replicas of a 1-shard fleet, the first primary at epoch 1 (no etcd)."""
    group = start_group(tmp_path_factory.mktemp("static"), 2)
    yield group
    group.close()


def test_a_client_listing_the_backup_first_follows_the_primary(static_group):
    primary, backup = static_group.urls
    assert http_json(backup + "/v1/cluster")["replication"]["role"] == "backup"
    with PSClient(f"{backup}|{primary}", worker_id="w-static", retry_deadline=20) as ps:
        first = ps.increment("static_steps")
        assert ps.increment("static_steps") == first + 1
        ps.init({"static_w": [1.0, 2.0]})
        assert ps.pull(["static_w"])["static_w"].tolist() == [1.0, 2.0]
        assert ps.shards == (primary,)


def test_the_async_client_follows_the_primary_too(static_group):
    primary, backup = static_group.urls
    ps = OnLoop(AsyncPSClient(f"{backup}|{primary}", worker_id="w-static-async"))
    try:
        first = ps.increment("static_async_steps")
        assert ps.increment("static_async_steps") == first + 1
        assert ps.client.shards == (primary,)
    finally:
        ps.close()
