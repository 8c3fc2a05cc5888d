"""What operators see of a replica group: ``GET /v1/replicas`` (the dashboard's Replicas
table, server/pages/replicas.py), ``paramshard status`` and ``paramshard get`` given the group
as ``a|b`` (server/status.py, server/show.py).

A group of two real replicas electing their primary in a real etcd (tests/helpers/etcd.py):
every replica shows every replica's role, epoch, lsn, lag, in-sync state and etcd state, the
same from either side; ``status`` prints a row per replica and ``get`` reads through the
primary whichever replica is listed first; after the primary is killed, the views say so
(down, exit status 1) and then show the backup as the new primary at a higher epoch.

A fleet of two indexes, the first a static group of two, started with ``--fleet-urls
'p0|b0,s1'``: ``GET /v1/fleet`` shows index 0 by its primary with both replicas' roles, and
by its backup once the primary is killed; ``GET /v1/variables/NAME`` asked of shard 1 for a
name of index 0 is answered by the replica that still answers.
"""

from __future__ import annotations

import httpx2
import numpy as np
import pytest

from client_sdk import PSClient, wire
from client_sdk.placement import shard_for
from server.launcher import LaunchError
from tests.conftest import Fleet
from tests.e2e.test_cli import run_cli
from tests.e2e.test_leadership import elected_group, one_primary
from tests.helpers.eventually import eventually
from tests.helpers.replicas import Group, free_ports, start_group

COLUMNS = "URL SHARD ROLE EPOCH LSN LAG IN-SYNC INCARNATION".split()


def replicas(url: str) -> dict:
    r = httpx2.get(url + "/v1/replicas", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def rows(stdout: str) -> list[dict[str, str]]:
    """The status table's rows as ``{column: cell}`` for the first columns."""
    out, starts = [], []
    for line in stdout.splitlines():
        if line.startswith("URL "):
            starts = [line.index(c) for c in COLUMNS]
            continue
        if line.strip() and starts:
            bounds = [*starts[1:], None]
            out.append({c: line[a:b].strip() for c, a, b in zip(COLUMNS, starts, bounds)})
    return out


def test_the_group_as_its_replicas_the_cli_and_the_dashboard_show_it(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, view = one_primary(group)
        b = 1 - p
        primary, backup = group.urls[p], group.urls[b]
        with PSClient(f"{primary}|{backup}", worker_id="w-views") as ps:
            for _ in range(4):
                ps.increment("views_steps")
        lsn = httpx2.get(primary + "/v1/cluster", timeout=30).json()["replication"]["lsn"]

        for asked in (primary, backup):  # the same view from either side
            seen = replicas(asked)
            assert seen["replicated"] and seen["etcd"] and seen["primary"] == primary
            by = {r["url"]: r for r in seen["replicas"]}
            assert by[asked]["self"] and not by[group.urls[1 - group.urls.index(asked)]]["self"]
            assert (by[primary]["role"], by[backup]["role"]) == ("primary", "backup")
            assert by[primary]["epoch"] == by[backup]["epoch"] == seen["epoch"] == view["epoch"]
            assert by[primary]["lsn"] == by[backup]["lsn"] == lsn
            assert (by[backup]["lag"], by[backup]["in_sync"]) == (0, True)
            assert by[backup]["primary"] == primary
            assert by[primary]["etcd"]["holds_lease"] and by[backup]["etcd"]["eligible"]
        page = httpx2.get(backup + "/", timeout=30).text
        assert 'id="replicas"' in page and '"/v1/replicas"' in page

        done = run_cli("status", "--shards", f"{backup}|{primary}", "--interval", "0.2")
        assert done.returncode == 0, done.stdout + done.stderr
        table = {r["URL"]: r for r in rows(done.stdout)}
        assert table[primary]["ROLE"] == "primary" and table[backup]["ROLE"] == "backup"
        assert table[backup]["EPOCH"] == str(view["epoch"])
        assert (table[backup]["LAG"], table[backup]["IN-SYNC"]) == ("0", "yes")
        assert table[backup]["LSN"] == table[primary]["LSN"] == str(lsn)

        got = run_cli("get", "views_steps", "--shards", f"{backup}|{primary}")
        assert got.returncode == 0, got.stdout + got.stderr
        assert "value: 4" in got.stdout
        assert f"{backup}: backup at epoch {view['epoch']}, lsn {lsn}, lag 0, in-sync yes" in (
            got.stdout
        )

        group.kill(p)
        down = run_cli("status", "--shards", f"{primary}|{backup}", "--interval", "0.2")
        assert down.returncode == 1, down.stdout + down.stderr
        assert {r["URL"]: r for r in rows(down.stdout)}[primary]["ROLE"] == "-"

        def took_over():
            seen = replicas(backup)
            return seen if seen["primary"] == backup else None

        seen = eventually(took_over, "the backup shown as the new primary", timeout=30)
        assert seen["epoch"] > view["epoch"]
        gone = {r["url"]: r for r in seen["replicas"]}[primary]
        assert gone["up"] is False and gone["error"]
        got = run_cli("get", "views_steps", "--shards", f"{primary}|{backup}")
        assert got.returncode == 0 and "value: 4" in got.stdout, got.stdout + got.stderr
        assert f"{primary}: down" in got.stdout
    finally:
        group.close()


def test_a_shard_without_replicas_lists_itself(fleet_factory):
    url = fleet_factory(1).urls[0]
    seen = replicas(url)
    assert not seen["replicated"] and not seen["etcd"]
    (me,) = seen["replicas"]
    assert me["self"] and me["role"] == "standalone"


@pytest.mark.parametrize("shards", ["http://a:1|ftp://b:2", "http://a:1|http://a:1", "x|"])
def test_bad_replica_lists_are_usage_errors(shards):
    done = run_cli("status", "--shards", shards)
    assert done.returncode == 2 and "--shards" in done.stderr, done.stderr


class Listed(Group):
    """A group whose replicas are started with ``--fleet-urls fleet``."""

    fleet = ""

    def serve_args(self, i: int) -> list[str]:
        return [*super().serve_args(i), "--fleet-urls", self.fleet]


class Single(Fleet):
    """Shard 1 of 2 alone, on port ``port``, with ``--fleet-urls Listed.fleet``."""

    port = 0

    def serve_args(self, i: int) -> list[str]:
        args = super().serve_args(i)
        args[args.index("--shard-index") + 1] = "1"
        args[args.index("--num-shards") + 1] = "2"
        args[args.index("--port") + 1] = str(self.port)
        return [*args, "--fleet-urls", Listed.fleet]


def test_the_fleet_view_and_inspection_take_replica_groups(tmp_path):
    for attempt in range(4):
        ports = free_ports(3)
        p0, b0, s1 = (f"http://127.0.0.1:{p}" for p in ports)
        Listed.fleet = f"{p0}|{b0},{s1}"
        Single.port = ports[2]
        made = []
        try:
            for k in range(2):
                where = tmp_path / f"a{attempt}-{k}"
                where.mkdir()
                made.append(
                    Listed(2, where, ports[:2], (), shard=(0, 2)) if k == 0 else Single(1, where)
                )
            break
        except LaunchError:
            for g in made:
                g.close()
    else:
        pytest.fail("the fleet did not start")
    group, single = made
    try:
        name = next(f"v{k}" for k in range(99) if shard_for(f"v{k}", 2) == 0)
        with PSClient(f"{p0}|{b0},{s1}", worker_id="w-fleet") as ps:
            ps.init({name: np.full(2, 4.0, np.float32)})
        view = httpx2.get(s1 + "/v1/fleet", timeout=30).json()
        first = view["shards"][0]
        assert first["url"] == p0 and first["up"] and first["role"] == "primary"
        assert [(r["url"], r["role"]) for r in first["replicas"]] == [
            (p0, "primary"),
            (b0, "backup"),
        ]
        from_backup = httpx2.get(b0 + "/v1/fleet", timeout=30).json()["shards"][0]
        assert [r["role"] for r in from_backup["replicas"]] == ["primary", "backup"]
        group.kill(0)

        def seen_down():  # the view is cached for FLEET_CACHE_SECONDS: ask until it is new
            shown = httpx2.get(s1 + "/v1/fleet", timeout=30).json()["shards"][0]
            return shown if shown["replicas"][0]["up"] is False else None

        view = eventually(seen_down, "the fleet view showing the killed replica down")
        assert view["url"] == b0 and view["role"] == "backup"  # the first that answers
        assert [r["up"] for r in view["replicas"]] == [False, True]
        # a variable of index 0 asked of shard 1: the owner's replicas asked in turn
        got = httpx2.get(f"{s1}/v1/variables/{name}", params={"values": "true"}, timeout=30)
        assert got.status_code == 200, got.text
        assert got.json()["values"] == [4.0, 4.0]
        assert got.headers[wire.HEADER_OWNER] == "0/2"
    finally:
        group.close()
        single.close()


def test_status_matches_replicas_by_the_urls_they_advertise(tmp_path):
    """Listed under other URLs than the ones they advertise (published ports, a port-forward:
    here ``localhost`` for ``127.0.0.1``), the backups are still matched with the primary's
    in-sync set."""
    group = start_group(tmp_path, 2)
    try:
        listed = [u.replace("127.0.0.1", "localhost") for u in group.urls]
        with PSClient(group.urls[0], worker_id="w-listed") as ps:
            ps.increment("listed_steps")
        done = run_cli("status", "--shards", "|".join(listed), "--interval", "0.2")
        assert done.returncode == 0, done.stdout + done.stderr
        table = {r["URL"]: r for r in rows(done.stdout)}
        assert table[listed[1]]["ROLE"] == "backup"
        assert (table[listed[1]]["LAG"], table[listed[1]]["IN-SYNC"]) == ("0", "yes")
    finally:
        group.close()
