"""A fleet spread over hosts, set up exactly as docker-compose.yml sets it up.

Every service runs on a host of its own: ``etcd``, every replica of every shard index (``ps0``,
``ps0b``, ... ``ps3b``) and every worker, each a network namespace with its own address on a
private switch (tests/helpers/netlab.py), reaching the others by name as containers do under
Compose. Each process gets what its container would get: the image's ``ENV`` and entry point
(docker/Dockerfile, the target the service builds), the service's ``environment``
(docker-compose.yml), and a directory of its own where the service mounts its volume. Only
``DIGITS_STEPS`` is pinned here, so that the run's length does not follow edits of the compose
file.

The run: two workers train; the cable of the primary of the index that holds ``global_step`` is
pulled (its backup is elected, and the workers follow it and train on while the cable is still
out: a call stuck on the cut primary leaves it once the heir leads, client_sdk/_stalls.py) and
plugged back in (it rejoins as a backup);
the primary of an index holding only weights is killed (SIGKILL, as ``docker kill``): its backup
takes over and the workers carry on without it; it is started again on its volume and comes
back as the new primary's backup, caught up. The workers must finish on their own, never
restarted, with the right result: every step counted exactly once and the demo's accuracy
reached. Then every service is stopped as ``docker compose stop`` stops it (SIGTERM): the
shards exit 0, their final snapshots written.

Needs root, iproute2 and etcd (CI has them); skipped with the reason otherwise. Everything it
creates (processes, namespaces, cables, the switch, hosts files) is removed at the end, even on
failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client_sdk.placement import shard_for
from tests.helpers import etcd as etcd_server
from tests.helpers import netlab
from tests.helpers.deploy_files import (
    A_TOKEN,
    DOCKERFILE,
    ROOT,
    environment,
    image_env,
    in_stage,
    interpolated,
    load_compose,
    parse_dockerfile,
    replica_groups,
)
from tests.helpers.eventually import eventually

UNAVAILABLE = netlab.available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"multi-host test: {UNAVAILABLE}"),
]

WORKERS = 2
STEPS = 1500
MIN_ACCURACY = 0.85
OUTAGE = 3.0  # seconds the cable stays out at least (the lease TTL is 2 s)
PARAMS = ("layer1/kernel", "layer1/bias", "layer2/kernel", "layer2/bias")
COUNTERS = ("global_step", "digits/workers")


# -- what a container would get -------------------------------------------------------------


def image(stage: str) -> tuple[list[str], dict[str, str]]:
    """The command (ENTRYPOINT + CMD, made runnable from this checkout) and the ENV of one
    target of docker/Dockerfile."""
    dockerfile = parse_dockerfile(DOCKERFILE.read_text())
    env = image_env(dockerfile, stage)
    env.pop("PATH")  # the image's virtualenv; here, this interpreter's
    command: list[str] = []
    for keyword in ("ENTRYPOINT", "CMD"):
        found = in_stage(dockerfile, stage, keyword)
        command += json.loads(found[-1].args) if found else []
    if command[0] == "paramshard":
        command = [sys.executable, "-m", "server.cli", *command[1:]]
    elif command[0] == "etcd":
        command = [etcd_server.require(), *command[1:]]
    elif command[0] == "python":
        script = command[1].replace("/app/", "")
        command = [sys.executable, str(ROOT / script), *command[2:]]
    return command, env


def container_env(
    image_env: dict[str, str], service: dict, volumes: dict[str, Path]
) -> dict[str, str]:
    """The image's ENV, then the service's environment; a path at or under a volume's mount
    point becomes that path in the volume's directory here."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "LANG": "C.UTF-8",
        **image_env,
        **interpolated(environment(service)),
    }

    def here(value: str) -> str:
        for mount, directory in volumes.items():
            if value == mount or value.startswith(mount + "/"):
                return str(directory) + value[len(mount) :]
        return value

    return {k: here(v) for k, v in env.items()}


def service_volumes(service: dict, base: Path) -> dict[str, Path]:
    """mount point -> a directory standing for the named volume."""
    out = {}
    for mount in service.get("volumes", []):
        source, target = mount.split(":")[:2]
        out[target] = base / source
        out[target].mkdir(exist_ok=True)
    return out


# -- the test -------------------------------------------------------------------------------


@pytest.fixture
def lab():
    with netlab.opened("the multi-host test") as lab:
        lab.token = A_TOKEN  # the compose file's ${PARAMSHARD_TOKEN}, as the operator has it
        yield lab


class Fleet:
    """The compose file's services, running on the lab's hosts."""

    def __init__(self, lab: netlab.Netlab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        compose = load_compose()
        #: the replicas of each shard index, index 0's first
        self.groups = [[name for name, _ in group] for group in replica_groups(compose)]
        self.shards = {name: svc for group in replica_groups(compose) for name, svc in group}
        self.names = list(self.shards)
        self.etcd_service = compose["services"]["etcd"]
        self.worker_service = compose["services"]["worker"]
        self.workers = [f"worker{i + 1}" for i in range(WORKERS)]  # --scale worker=2
        self.port = int(environment(self.shards["ps0"])["PARAMSHARD_PORT"])
        self.procs: dict[str, subprocess.Popen] = {}
        self.shard_cmd, self.shard_image_env = image("runtime")
        self.worker_cmd, self.worker_image_env = image("demo")
        self.etcd_cmd, self.etcd_image_env = image("etcd")
        lab.add_hosts("etcd", *self.names, *self.workers, "ops")

    def url(self, shard: str, path: str) -> str:
        return f"http://{shard}:{self.port}{path}"

    def start_etcd(self) -> None:
        """The etcd service, as its container runs it; waits for its compose health check."""
        svc = self.etcd_service
        env = container_env(self.etcd_image_env, svc, service_volumes(svc, self.workdir))
        self.procs["etcd"] = self.lab.start(
            "etcd", self.etcd_cmd, env, self.workdir / "etcd.log", cwd=self.workdir
        )
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "python"], test
        self.wait_passes("etcd", [sys.executable, *test[2:]], env)

    def shard_env(self, name: str) -> dict[str, str]:
        svc = self.shards[name]
        return container_env(self.shard_image_env, svc, service_volumes(svc, self.workdir))

    def start_shard(self, name: str) -> None:
        self.procs[name] = self.lab.start(
            name,
            self.shard_cmd,
            self.shard_env(name),
            self.workdir / f"{name}.log",
            cwd=self.workdir,
        )

    def wait_healthy(self, name: str, timeout: float = 60.0) -> None:
        """Run the compose healthcheck in the shard's "container" until it passes."""
        test = self.shards[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "paramshard"]
        command = [sys.executable, "-m", "server.cli", *test[2:]]
        self.wait_passes(name, command, self.shard_env(name), timeout)

    def wait_passes(
        self, host: str, command: list[str], env: dict[str, str], timeout: float = 60.0
    ) -> None:
        cmd = ["ip", "netns", "exec", self.lab.namespace(host), *command]
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[host]
            assert proc.poll() is None, f"{host} exited with {proc.returncode}:\n{self.log(host)}"
            if subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode == 0:
                return
            assert time.monotonic() < deadline, f"{host} not healthy:\n{self.log(host)}"
            time.sleep(0.2)

    def start_workers(self) -> None:
        env = container_env(self.worker_image_env, self.worker_service, {})
        env["DIGITS_STEPS"] = str(STEPS)
        for host in self.workers:
            self.procs[host] = self.lab.start(
                host, self.worker_cmd, env, self.workdir / f"{host}.log", cwd=self.workdir
            )

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"

    def cluster(self, shard: str) -> dict | None:
        return self.lab.fetch_json("ops", self.url(shard, "/v1/cluster"), timeout=1.0)

    def group(self, name: str) -> list[str]:
        """The replicas of the shard index that owns variable ``name`` (placement)."""
        return self.groups[shard_for(name, len(self.groups))]

    def primary(self, replicas: list[str]) -> str | None:
        """The replica that says it is primary, if exactly one of ``replicas`` does."""
        roles = {s: ((self.cluster(s) or {}).get("replication") or {}) for s in replicas}
        found = [s for s, r in roles.items() if r.get("role") == "primary"]
        return found[0] if len(found) == 1 else None

    def wait_primary(self, replicas: list[str], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while (found := self.primary(replicas)) is None:
            assert time.monotonic() < deadline, f"no primary among {replicas}"
            time.sleep(0.2)
        return found

    def counter(self, name: str) -> int | None:
        """The counter's value on the primary of its index (None: no primary answers)."""
        owner = self.primary(self.group(name))
        if owner is None:
            return None
        answer = self.lab.fetch_json(
            "ops", self.url(owner, f"/v1/variables/{name}?values=true"), timeout=1.0
        )
        return None if answer is None else int(answer["values"])

    def versions(self, shard: str) -> dict[str, int]:
        answer = self.lab.fetch_json("ops", self.url(shard, "/v1/variables"), timeout=2.0)
        assert answer is not None, f"{shard} does not answer"
        return {v["name"]: v["version"] for v in answer["variables"]}

    def checkpoint(self) -> str:
        """A fleet checkpoint, asked for by an operator's SDK on the ops host. Its requests go
        to the replica the SDK takes for each index's primary, the first listed until a refusal
        says otherwise, and a backup takes them too: each group is listed primary first, so
        that the primaries write it."""
        leads = [self.primary(group) for group in self.groups]
        shards = ",".join(
            "|".join(self.url(s, "") for s in sorted(group, key=lambda s: s != lead))
            for group, lead in zip(self.groups, leads)
        )
        env = {
            **container_env(self.worker_image_env, self.worker_service, {}),
            "PARAMSHARD_WORKER_ID": "ops",
            "PARAMSHARD_SHARDS": shards,
        }
        done = self.lab.python(
            "ops",
            "from client_sdk import PSClient\nwith PSClient() as ps: print(ps.checkpoint())",
            env=env,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    @contextlib.contextmanager
    def workers_paused(self) -> Iterator[None]:
        """The workers stopped (SIGSTOP) for what the block does, then continued (SIGCONT).

        The test's own steps (a checkpoint through a fresh interpreter, polls through ``ip netns
        exec``) can take seconds on a loaded machine while the workers' steps take milliseconds:
        without the pause, the workers could finish all their steps before the fault they are
        meant to ride out. A stopped worker's connections stay open, as in a stalled container.
        """
        for host in self.workers:
            self.procs[host].send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for host in self.workers:
                self.procs[host].send_signal(signal.SIGCONT)

    def wait_for_step(self, at_least: int, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            for host in self.workers:
                proc = self.procs[host]
                assert proc.poll() is None, (
                    f"{host} ended (status {proc.returncode}) before step {at_least}:\n"
                    f"{self.log(host)}"
                )
            step = self.counter("global_step")
            if step is not None and step >= at_least:
                return step
            assert time.monotonic() < deadline, f"global_step stuck at {step}"
            time.sleep(0.2)


def test_fleet_across_hosts_rides_out_a_cut_cable_and_a_killed_primary(lab, tmp_path):
    fleet = Fleet(lab, tmp_path)
    n = len(fleet.groups)
    owner = {name: shard_for(name, n) for name in PARAMS + COUNTERS}
    counters = {owner[c] for c in COUNTERS}
    weights_only = sorted({owner[p] for p in PARAMS} - counters)
    assert weights_only, f"placement leaves no shard index with weights only: {owner}"
    victims = fleet.groups[weights_only[0]]  # its replicas

    fleet.start_etcd()
    for name in fleet.names:
        fleet.start_shard(name)
    for name in fleet.names:
        fleet.wait_healthy(name)
    for index, group in enumerate(fleet.groups):
        assert {fleet.cluster(s)["shard_index"] for s in group} == {index}
        fleet.wait_primary(group)
    fleet.start_workers()

    # 1. training is under way; pull the cable of the global_step index's primary: its lease
    #    lapses, its backup is elected, and the workers follow it (a call stuck on the cut
    #    primary leaves it once the heir leads) and train on while the
    #    cable is still out; plug it back in: it rejoins as a backup
    fleet.wait_for_step(WORKERS * 100)
    cut_group = fleet.group("global_step")  # every step of every worker goes through it
    cut = fleet.wait_primary(cut_group)
    (heir,) = [s for s in cut_group if s != cut]
    before = fleet.cluster(cut)
    lab.cut(cut)
    cut_at = time.monotonic()
    assert lab.fetch("ops", fleet.url(cut, "/healthz"), timeout=1.0) is None, (
        f"{cut} still answers with its cable out"
    )
    assert fleet.wait_primary([heir]) == heir  # elected while the old primary is cut off
    moved = fleet.wait_for_step(1)
    fleet.wait_for_step(moved + WORKERS * 20)  # through the new primary: the old one is cut
    with fleet.workers_paused():  # the rest of the outage spends none of the steps left
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - cut_at)))
    lab.plug(cut)
    after = lab.wait_for("ops", fleet.url(cut, "/v1/cluster"), timeout=30)
    assert after["incarnation"] == before["incarnation"], "the shard itself never stopped"
    healed_at = fleet.wait_for_step(1)
    fleet.wait_for_step(healed_at + WORKERS * 50)
    assert fleet.primary(cut_group) == heir

    def follows_heir() -> bool:
        view = (fleet.cluster(cut) or {}).get("replication") or {}
        return (view.get("role"), view.get("primary")) == ("backup", fleet.url(heir, ""))

    eventually(follows_heir, f"{cut} back as {heir}'s backup", timeout=60)

    # 2. checkpoint the fleet, train on, then kill (SIGKILL, as `docker kill`) the primary of
    #    an index holding weights but no counter: its backup takes over and the workers carry
    #    on without it; start it again on its volume: it comes back as the new primary's
    #    backup (the workers paused while the test does its slow parts, so that they are still
    #    training when the primary dies)
    mine = [p for p in PARAMS if owner[p] == weights_only[0]]
    with fleet.workers_paused():
        fleet.wait_primary(victims)
        # written by one replica of each index, the primary (a backup's volume holds only its
        # periodic snapshots): the victim is the replica that wrote it
        checkpoint = fleet.checkpoint()
        views = {s: fleet.cluster(s) or {} for s in victims}
        held = [s for s, v in views.items() if checkpoint in str(v.get("last_snapshot"))]
        assert len(held) == 1, f"{checkpoint}: written by {held} of {victims}: {views}"
        (victim,) = held
        assert views[victim]["replication"]["role"] == "primary", views
        (backup,) = [s for s in victims if s != victim]
        before_checkpoint = fleet.versions(victim)
        old = views[victim]
    fleet.wait_for_step(fleet.counter("global_step") + WORKERS * 50)
    with fleet.workers_paused():  # they go on against a dead primary, then follow its backup
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait(10)
        at_kill = fleet.counter("global_step")
    assert fleet.wait_primary([backup]) == backup
    fleet.wait_for_step(at_kill + WORKERS * 50)  # the weights' pushes go to the new primary
    fleet.start_shard(victim)
    fleet.wait_healthy(victim)
    new = fleet.cluster(victim)
    assert new["incarnation"] != old["incarnation"]
    restored_from = new["restored"]
    assert restored_from is not None, f"{victim} came back empty:\n{fleet.log(victim)}"
    assert (tmp_path / f"{victim}-data" / restored_from["path"]).is_file()  # its volume's
    assert restored_from["checkpoint"] in (checkpoint, None), restored_from  # None: periodic

    def in_sync() -> bool:  # back as a backup, caught up: in the new primary's in-sync set
        view = (fleet.cluster(backup) or {}).get("replication") or {}
        return fleet.url(victim, "") in view.get("in_sync", [])

    eventually(in_sync, f"{victim} back in {backup}'s in-sync set", timeout=60)
    assert fleet.cluster(victim)["replication"]["role"] == "backup"
    versions = fleet.versions(victim)
    for p in mine:  # what its volume held, then what it was sent
        assert p in versions, f"{victim} came back without {p}"
        assert versions[p] >= before_checkpoint[p] > 0, (p, before_checkpoint, versions)

    # 3. the workers finish by themselves, never restarted, with every step counted once and
    #    a model that works
    outputs = {}
    for host in fleet.workers:
        proc = fleet.procs[host]
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{host} did not finish:\n{fleet.log(host)}")
        outputs[host] = fleet.log(host)
        assert proc.returncode == 0, f"{host} failed:\n{outputs[host]}"
    claimed = sorted(
        int(re.search(r"claimed worker index (\d+)", out).group(1)) for out in outputs.values()
    )
    assert claimed == list(range(WORKERS))
    for out in outputs.values():
        m = re.search(r"done: (\d+) steps .* accuracy of the fleet's weights ([0-9.]+)", out)
        assert m, out
        assert int(m.group(1)) == STEPS
        assert float(m.group(2)) >= MIN_ACCURACY, out
    assert fleet.counter("global_step") == WORKERS * STEPS
    assert fleet.cluster(cut)["incarnation"] == before["incarnation"]
    for name in fleet.names:
        assert fleet.procs[name].poll() is None, f"{name} died:\n{fleet.log(name)}"

    # 4. `docker compose stop`: SIGTERM; each shard drains, writes its final snapshot, exits 0
    for name in fleet.names:
        fleet.procs[name].send_signal(signal.SIGTERM)
    for name in fleet.names:
        assert fleet.procs[name].wait(30) == 0, f"{name} did not stop cleanly:\n{fleet.log(name)}"
    fleet.procs["etcd"].send_signal(signal.SIGTERM)  # etcd ends by the signal itself (-15)
    assert fleet.procs["etcd"].wait(30) in (0, -signal.SIGTERM), fleet.log("etcd")
