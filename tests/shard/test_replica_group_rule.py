"""The one rule for a replica group's primary and each replica's lag
(server/replication/group.py), which ``paramshard status``, ``GET /v1/fleet`` and
``GET /v1/replicas`` all apply: reports as replicas' ``GET /v1/cluster`` give them, in any
order, always name the same primary and the same lag. (tests/e2e/test_replica_views.py shows
the three views on real groups; this covers the cases a live group shows only by chance: two
reports claiming the primary, a backup the primary does not list, answers missing.)"""

from __future__ import annotations

import itertools

from server.replication.group import in_sync, lag, primary_of


def report(role: str, epoch: int | None, lsn: int | None, url: str, **extra: object) -> dict:
    return {"role": role, "epoch": epoch, "lsn": lsn, "url": url, **extra}


def test_the_primary_is_the_one_saying_so_at_the_highest_epoch_in_any_order():
    old = report("primary", 3, 90, "http://a")
    new = report("primary", 4, 40, "http://b")
    backup = report("backup", 4, 40, "http://c")
    for reports in itertools.permutations([old, new, backup, None, {}]):
        assert reports[primary_of(reports)] is new  # type: ignore[index]


def test_two_at_one_epoch_show_the_one_holding_more_writes_then_the_first_listed():
    behind = report("primary", 5, 10, "http://a")
    ahead = report("primary", 5, 12, "http://b")
    for reports in itertools.permutations([behind, ahead]):
        assert reports[primary_of(reports)] is ahead  # type: ignore[index]
    twin = report("primary", 5, 12, "http://c")
    assert primary_of([ahead, twin]) == 0
    assert primary_of([twin, ahead]) == 0


def test_no_primary_when_none_says_so_with_an_epoch():
    assert primary_of([]) is None
    assert primary_of([None, {}, report("backup", 2, 5, "http://a")]) is None
    assert primary_of([report("primary", None, 5, "http://a"), {"role": "primary"}]) is None
    assert primary_of([report("primary", True, 5, "http://a")]) is None  # type: ignore[arg-type]


def test_lag_is_the_primarys_count_for_a_backup_it_forwards_to():
    backup = report("backup", 4, 97, "http://adv-b")
    primary = report(
        "primary",
        4,
        100,
        "http://a",
        backups=[{"url": "http://adv-b", "lag": 7}],
        in_sync=["http://adv-b"],
    )
    # The primary's figure, not the lsn difference (3): it decides what is acknowledged.
    assert lag(primary, backup, "http://listed-b") == 7
    assert in_sync(primary, backup, "http://listed-b")
    assert lag(primary, primary, "http://a") == 0


def test_lag_of_a_backup_the_primary_does_not_count_is_the_lsn_difference():
    primary = report("primary", 4, 100, "http://a", backups=[{"url": "http://b", "lag": None}])
    counted_none = report("backup", 4, 96, "http://b")
    unlisted = report("backup", 4, 90, "")  # no advertised URL: matched by the listed one
    ahead = report("backup", 4, 120, "http://d")
    assert lag(primary, counted_none, "http://b") == 4
    assert lag(primary, unlisted, "http://c") == 10
    assert lag(primary, ahead, "http://d") == 0
    assert not in_sync(primary, unlisted, "http://c")
    assert lag(primary, report("backup", 4, None, "http://e"), "http://e") is None
    assert lag(report("primary", 4, None, "http://a"), counted_none, "http://b") is None
