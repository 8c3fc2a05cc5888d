"""A fleet spread over hosts, set up exactly as docker-compose.yml sets it up.

Every shard (``ps0``..``ps3``) and every worker runs on a host of its own: a network namespace
with its own address on a private switch (tests/helpers/netlab.py), reaching the others by name as
containers do under Compose. Each process gets what its container would get: the image's
``ENV`` and entry point (docker/Dockerfile), the service's ``environment`` (docker-compose.yml),
and a directory of its own where the service mounts its volume. Only ``DIGITS_STEPS`` is pinned
here, so that the run's length does not follow edits of the compose file.

The run: two workers train; the cable of the shard that holds ``global_step`` is pulled for a few
seconds and plugged back in; a shard holding only weights is killed (SIGKILL, as ``docker kill``)
and started again on its volume; the workers must finish on their own with the right result:
every step counted exactly once and the demo's accuracy reached. Then the shards are stopped as
``docker compose stop`` stops them (SIGTERM) and must exit 0, their final snapshots written.

Needs root and iproute2 (CI has both); skipped with the reason otherwise. Everything it creates
(processes, namespaces, cables, the switch, hosts files) is removed at the end, even on failure.
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
    shard_services,
)

UNAVAILABLE = netlab.available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"multi-host test: {UNAVAILABLE}"),
]

WORKERS = 2
STEPS = 1000
MIN_ACCURACY = 0.85
OUTAGE = 3.0  # seconds the cable stays out
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
    elif command[0] == "python":
        script = command[1].replace("/app/", "")
        command = [sys.executable, str(ROOT / script), *command[2:]]
    return command, env


def container_env(
    image_env: dict[str, str], service: dict, volumes: dict[str, Path]
) -> dict[str, str]:
    """The image's ENV, then the service's environment; a value naming a volume's mount point
    becomes that volume's directory here."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "LANG": "C.UTF-8",
        **image_env,
        **interpolated(environment(service)),
    }
    return {k: str(volumes[v]) if v in volumes else v for k, v in env.items()}


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
    netlab.sweep_stale()
    lab = netlab.Netlab()
    lab.token = A_TOKEN  # the compose file's ${PARAMSHARD_TOKEN}, as the operator has it
    try:
        yield lab
    finally:
        lab.close()
        left = lab.leftovers()
        assert not left, f"the multi-host test left {left} behind"


class Fleet:
    """The compose file's services, running on the lab's hosts."""

    def __init__(self, lab: netlab.Netlab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        compose = load_compose()
        self.shards = dict(shard_services(compose))
        self.names = list(self.shards)
        self.worker_service = compose["services"]["worker"]
        self.workers = [f"worker{i + 1}" for i in range(WORKERS)]  # --scale worker=2
        self.port = int(environment(self.shards["ps0"])["PARAMSHARD_PORT"])
        self.procs: dict[str, subprocess.Popen] = {}
        self.shard_cmd, self.shard_image_env = image("runtime")
        self.worker_cmd, self.worker_image_env = image("demo")
        lab.add_hosts(*self.names, *self.workers, "ops")

    def url(self, shard: str, path: str) -> str:
        return f"http://{shard}:{self.port}{path}"

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
        cmd = [
            "ip",
            "netns",
            "exec",
            self.lab.namespace(name),
            sys.executable,
            "-m",
            "server.cli",
            *test[2:],
        ]
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.log(name)}"
            if (
                subprocess.run(
                    cmd, env=self.shard_env(name), capture_output=True, timeout=30
                ).returncode
                == 0
            ):
                return
            assert time.monotonic() < deadline, f"{name} not healthy:\n{self.log(name)}"
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

    def counter(self, name: str) -> int | None:
        owner = self.names[shard_for(name, len(self.names))]
        answer = self.lab.fetch_json(
            "ops", self.url(owner, f"/v1/variables/{name}?values=true"), timeout=1.0
        )
        return None if answer is None else int(answer["values"])

    def versions(self, shard: str) -> dict[str, int]:
        answer = self.lab.fetch_json("ops", self.url(shard, "/v1/variables"), timeout=2.0)
        assert answer is not None, f"{shard} does not answer"
        return {v["name"]: v["version"] for v in answer["variables"]}

    def checkpoint(self) -> str:
        """A fleet checkpoint, asked for by an operator's SDK on the ops host."""
        env = {
            **container_env(self.worker_image_env, self.worker_service, {}),
            "PARAMSHARD_WORKER_ID": "ops",
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


def test_fleet_across_hosts_rides_out_a_cut_cable_and_a_killed_shard(lab, tmp_path):
    fleet = Fleet(lab, tmp_path)
    n = len(fleet.names)
    owner = {name: fleet.names[shard_for(name, n)] for name in PARAMS + COUNTERS}
    cut = owner["global_step"]  # every step of every worker goes through it
    victims = [
        s
        for s in fleet.names
        if s in {owner[p] for p in PARAMS} and s not in {owner[c] for c in COUNTERS}
    ]
    assert victims, f"placement leaves no shard with weights only: {owner}"
    victim = victims[0]

    for name in fleet.names:
        fleet.start_shard(name)
    for name in fleet.names:
        fleet.wait_healthy(name)
    assert [fleet.cluster(s)["shard_index"] for s in fleet.names] == list(range(n))
    fleet.start_workers()

    # 1. training is under way; pull the cable of the global_step shard, then plug it back in
    fleet.wait_for_step(WORKERS * 100)
    before = fleet.cluster(cut)
    lab.cut(cut)
    cut_at = time.monotonic()
    assert lab.fetch("ops", fleet.url(cut, "/healthz"), timeout=1.0) is None, (
        f"{cut} still answers with its cable out"
    )
    time.sleep(max(0.0, OUTAGE - (time.monotonic() - cut_at)))
    lab.plug(cut)
    after = lab.wait_for("ops", fleet.url(cut, "/v1/cluster"), timeout=30)
    assert after["incarnation"] == before["incarnation"], "the shard itself never stopped"
    healed_at = fleet.wait_for_step(1)
    fleet.wait_for_step(healed_at + WORKERS * 50)

    # 2. checkpoint the fleet, train on, then kill (SIGKILL, as `docker kill`) a shard that
    #    holds weights but no counter, and start it again on its volume
    #    (the workers paused while the test does its slow parts, so that they are still
    #    training when the shard dies)
    mine = [p for p in PARAMS if owner[p] == victim]
    with fleet.workers_paused():
        before_checkpoint = fleet.versions(victim)
        checkpoint = fleet.checkpoint()
        old = fleet.cluster(victim)
    fleet.wait_for_step(fleet.counter("global_step") + WORKERS * 50)
    with fleet.workers_paused():  # they go on against a dead shard until it is back
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait(10)
    fleet.start_shard(victim)
    fleet.wait_healthy(victim)
    new = fleet.cluster(victim)
    assert new["incarnation"] != old["incarnation"]
    restored_from = new["restored"]
    assert restored_from is not None, f"{victim} came back empty:\n{fleet.log(victim)}"
    assert (tmp_path / f"{victim}-data" / restored_from["path"]).is_file()  # its volume's
    assert restored_from["checkpoint"] in (checkpoint, None), restored_from  # None: periodic
    versions = fleet.versions(victim)
    for p in mine:  # back from the snapshot, not created anew (that would be version 0)
        assert p in versions, f"{victim} came back without {p}"
        assert versions[p] >= before_checkpoint[p] > 0, (p, before_checkpoint, versions)

    # 3. the workers finish by themselves, with every step counted once and a model that works
    outputs = {}
    for host in fleet.workers:
        proc = fleet.procs[host]
        try:
            proc.wait(120)
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
