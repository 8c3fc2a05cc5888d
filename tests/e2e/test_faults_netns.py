"""A primary cut off by a link cut, then plugged back in: it must rejoin as a backup, and no
write a worker saw acknowledged may be lost (the history checker, tests/helpers/history.py).

The hosts are network namespaces on a private switch (tests/helpers/netlab.py): ``etcd`` (the
leadership's etcd, on a host of its own), ``a`` and ``b`` (the two replicas of shard 0, electing
their primary in that etcd) and ``workers`` (tests/helpers/writers.py run as a program: four
workers pushing and incrementing through ``PSClient('primary|backup')``). Unplugging the
primary's cable at the switch cuts it from its backup, the workers and etcd at once, both
ways: its lease lapses, it stops acknowledging, the backup is elected, the workers follow it.
Plugged back in, the old primary must become the new primary's backup and catch up.

Needs root and iproute2 (CI has both); skipped with the reason otherwise. Everything it starts
(processes, namespaces, cables, hosts files) is removed at the end, even on failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import etcd as etcd_server
from tests.helpers import netlab
from tests.helpers.eventually import eventually
from tests.helpers.writers import read_history

UNAVAILABLE = netlab.available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"link-cut test: {UNAVAILABLE}")

ROOT = Path(__file__).resolve().parents[2]
PORT = 7100  # each host has a network stack of its own: no other process holds its ports
REPLICAS = ("a", "b")
TTL = "2"

_PULL = (
    "import json, sys\n"
    "from tests.helpers.writers import final_state\n"
    "v, counter = final_state(sys.argv[1])\n"
    "print(json.dumps([v.tolist(), counter]))\n"
)


def env() -> dict[str, str]:
    """This interpreter's environment without proxies (the lab has no way out), the
    checkout importable."""
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    out["PYTHONPATH"] = str(ROOT)
    return out


def url(host: str) -> str:
    return f"http://{host}:{PORT}"


class Lab:
    """The lab's hosts and what runs on them (module docstring)."""

    def __init__(self, lab: netlab.Netlab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        lab.add_hosts("etcd", *REPLICAS, "workers")
        data = workdir / "etcd-data"
        peer = "http://127.0.0.1:2380"
        etcd = lab.start(
            "etcd",
            [
                etcd_server.require(),
                *("--name", "lab", "--data-dir", str(data)),
                *("--listen-client-urls", "http://0.0.0.0:2379"),
                *("--advertise-client-urls", "http://etcd:2379"),
                *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
                *("--initial-cluster", f"lab={peer}", "--log-level", "warn"),
            ],
            env(),
            workdir / "etcd.log",
        )
        lab.wait_for("workers", "http://etcd:2379/health", timeout=60, proc=etcd)
        group = "|".join(url(h) for h in REPLICAS)
        for host in REPLICAS:
            proc = lab.start(
                host,
                [
                    sys.executable,
                    *("-m", "server.cli", "serve", "--shard-index", "0", "--num-shards", "1"),
                    *("--host", "0.0.0.0", "--port", str(PORT)),
                    *("--replica-group", group, "--advertise-url", url(host)),
                    *("--etcd", "http://etcd:2379", "--etcd-prefix", "/faults"),
                    *("--lease-ttl", TTL),
                ],
                env(),
                workdir / f"{host}.log",
                cwd=workdir,
            )
            lab.wait_for("workers", url(host) + "/v1/cluster", timeout=60, proc=proc)

    def view(self, host: str) -> dict | None:
        """``host``'s replication view with ``eligible`` (None: no answer from it)."""
        info = self.lab.fetch_json("workers", url(host) + "/v1/cluster", timeout=1.0)
        if info is None:
            return None
        return {**info["replication"], "eligible": info["leadership"]["eligible"]}

    def settled(self, lsn: bool = False) -> str | None:
        """The primary if exactly one replica is, the other its eligible backup at its epoch
        (``lsn``: and at its lsn, once nothing is written); else None. A former primary is
        eligible again once the new primary confirmed it in-sync."""
        views = {h: self.view(h) for h in REPLICAS}
        primaries = [h for h, v in views.items() if v is not None and v["role"] == "primary"]
        if len(primaries) != 1 or any(v is None or not v["eligible"] for h, v in views.items()):
            return None
        p = primaries[0]
        want = ("backup", url(p), views[p]["epoch"], views[p]["lsn"])  # type: ignore[index]
        for h, v in views.items():
            got = (v["role"], v["primary"], v["epoch"], v["lsn"])  # type: ignore[index]
            if h != p and got[: 4 if lsn else 3] != want[: 4 if lsn else 3]:
                return None
        return p

    def state(self, host: str) -> tuple[np.ndarray, int]:
        done = self.lab.python("workers", _PULL, url(host), env=env(), timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        v, counter = json.loads(done.stdout)
        return np.asarray(v, np.float32), int(counter)


def acked(out: Path) -> int:
    return sum(p.read_text().count('"acked"') for p in out.glob("*.jsonl"))


@pytest.fixture
def lab():
    with netlab.opened("the link-cut test") as lab:
        yield lab


def test_a_primary_cut_off_by_a_link_cut_rejoins_as_a_backup_losing_nothing(tmp_path, lab):
    hosts = Lab(lab, tmp_path)
    p = eventually(hosts.settled, "one primary and its eligible backup", timeout=60)
    other = "b" if p == "a" else "a"
    out = tmp_path / "history"
    out.mkdir()
    workers = lab.start(
        "workers",
        [sys.executable, "-m", "tests.helpers.writers", f"{url(p)}|{url(other)}", str(out)],
        env(),
        tmp_path / "workers.log",
        cwd=ROOT,
    )

    def progress(n: int, what: str) -> None:
        target = acked(out) + n
        eventually(lambda: workers.poll() is None and acked(out) >= target, what, timeout=60)

    progress(30, "the workers writing")
    lab.cut(p)
    try:
        eventually(
            lambda: (hosts.view(other) or {}).get("role") == "primary",
            "the backup elected while the primary is cut off",
            timeout=60,
        )
        progress(30, "writes acknowledged by the new primary")
    finally:
        lab.plug(p)
    rejoined = eventually(
        lambda: hosts.settled(), "the old primary rejoined as a backup", timeout=60
    )
    assert rejoined == other
    progress(20, "writes acknowledged with the old primary back")
    (out / "stop").touch()
    assert workers.wait(timeout=90) == 0, (tmp_path / "workers.log").read_text()[-3000:]
    history = read_history(out)
    settled = eventually(lambda: hosts.settled(lsn=True), "the replicas at one lsn", timeout=60)
    assert settled == other
    v, counter = hosts.state(other)
    assert history.check(v, counter) == []
    sent, got = history.count("push")
    assert got >= 20 and sent >= got
    old_v, old_counter = hosts.state(p)
    problems = history.check(old_v, old_counter)
    if old_counter != counter or not (old_v == v).all():
        problems.append("its state differs from the primary's")
    assert problems == [], f"the old primary: {problems}"
