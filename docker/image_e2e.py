"""The images and the compose fleet, run for real with a container engine (`make test-image`).

    .venv/bin/python docker/image_e2e.py [--keep] [--steps N]

What a user of docker/Dockerfile and docker-compose.yml does, checked step by step, with a log
of every command. It owns nothing the product uses; `make test` checks the same files statically
(tests/e2e/test_deploy_files.py, test_k8s_manifests.py) and this script runs them:

 1. the engine: docker if its daemon answers, else podman (docker/images.py); when neither can
    run and this is root, installs podman, runc and debootstrap with apt-get (podman-compose comes
    from the ``image`` extra, `make test-image` installs it);
 2. builds both images (`make image`'s way: a local base when no registry is reachable) and
    looks at them: non-root user, health check, OCI version and revision labels, size;
 3. one shard container: seconds from `run` to ``/readyz`` answering 200, then SIGTERM (`stop`):
    exit status 0, and a new container on the same volume restores what it held;
 4. the compose fleet (etcd, and each shard index a replica group of two), from a copy of
    docker-compose.yml that differs only by its project name, free loopback host ports and a
    longer worker run (``DIGITS_STEPS``): waits for every replica's ``/readyz`` and for each
    index to have elected its primary; while the worker trains, takes a fleet checkpoint, kills
    the primary of the index holding ``layer1/kernel`` with SIGKILL: its other replica takes over
    (the seconds from the kill to its saying primary, and to the worker's next 100 steps, are
    reported) and the worker carries on in the same run (its container never restarted); the
    killed replica is started again and comes back as a backup of the new primary, caught up;
    the worker exits 0 with every step counted once (``global_step``) and a held-out accuracy of
    at least 0.9;
 5. inspects a variable over REST from the host (the published port);
 6. stops the fleet (SIGTERM): every shard exits 0; brings the shards up again on the same
    volumes: each index elects a primary again (a group whose every replica restarted: its
    most complete replica) and each replica restores exactly the state it had when stopped
    (its final snapshot), the worker's last write among it;
 7. `down -v`. Containers, networks and volumes of the run (every service's, etcd's too) are
    removed even when a step fails, and the run fails if any is left (``--keep`` leaves them for
    a look, and prints how to remove them).

When no engine can run here it says why and exits 1, unless ``PARAMSHARD_SKIP_IMAGE=1``, which
turns that (and only that) into a skip with exit 0: CI never passes by skipping silently. The
containers talk only to each other and to this host's loopback (published ports are bound to
127.0.0.1); only the image build reaches the Debian mirror and the Python package index.
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import yaml

from client_sdk import PSClient
from client_sdk.placement import shard_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import images  # docker/images.py, beside this file

ROOT = images.ROOT

#: A shard service of docker-compose.yml: ``ps<index>``, and its index's other replicas
#: ``ps<index>b``...
SHARD_SERVICE = re.compile(r"^ps(\d+)([b-z]?)$")
PARAMS = ("layer1/kernel", "layer1/bias", "layer2/kernel", "layer2/bias")
KERNEL = "layer1/kernel"
MIN_ACCURACY = 0.9
log = images.log


class Failed(Exception):
    """A check failed; the message says what was expected and what was seen."""


class CannotRun(Exception):
    """No container engine can run here (the reason); a skip only with PARAMSHARD_SKIP_IMAGE=1."""


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; raise Failed after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx2.HTTPError, ValueError, KeyError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last and not isinstance(last, str):
                return last
        time.sleep(every)
    raise Failed(f"{what}: not within {timeout:.0f} s (last seen: {last!r})")


def client(timeout: float) -> httpx2.Client:
    """For the shards' REST, from the host: never through a proxy, with the fleet's token."""
    token = os.environ.get("PARAMSHARD_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx2.Client(timeout=timeout, trust_env=False, headers=headers)


def get_json(url: str) -> Any:
    with client(5.0) as c:
        r = c.get(url)
        return {"status": r.status_code, "body": r.json()}


def ready(url: str) -> bool:
    with client(3.0) as c:
        return c.get(url + "/readyz").status_code == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the engine and the tools ----------------------------------------------------------------


def ensure_engine() -> str:
    """Choose the engine (installing podman, runc, debootstrap when root needs them); check it
    runs at all. Raise CannotRun with the reason when it does not."""
    try:
        engine, why = images.choose_engine()
    except images.ImageError as exc:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise CannotRun(str(exc)) from exc
        log(f"engine: {exc}; installing podman, runc and debootstrap with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "podman", "runc", "debootstrap"],
        ):
            log("$ " + " ".join(cmd))
            if subprocess.run(cmd, env=env, check=False).returncode != 0:
                raise CannotRun(f"{' '.join(cmd)} failed; install podman and runc by hand") from exc
        engine, why = images.choose_engine()
    log(f"engine: {engine}: {why}")
    info = subprocess.run([engine, "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        raise CannotRun(f"`{engine} info` fails: {info.stderr.strip()[-500:]}")
    if engine == "podman" and not shutil.which("debootstrap") and os.geteuid() == 0:
        images.run(["apt-get", "install", "-y", "-q", "debootstrap"], check=False)
    return engine


def compose_command(engine: str) -> list[str]:
    if engine == "docker":
        if subprocess.run(
            ["docker", "compose", "version"], capture_output=True, check=False
        ).returncode:
            raise CannotRun(
                "docker answers but `docker compose` does not: install its compose plugin"
            )
        return ["docker", "compose"]
    tool = shutil.which("podman-compose") or str(Path(sys.executable).parent / "podman-compose")
    if not Path(tool).exists():
        raise CannotRun(
            "podman-compose is not installed: pip install -e '.[image]' (make test-image does)"
        )
    return [tool]


class Engine:
    """The engine's commands this script uses, logged."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: str, check: bool = True, capture: bool = True) -> str:
        return images.run([self.name, *args], check=check, capture=capture).stdout or ""

    def inspect(self, ref: str, fmt: str, kind: str = "container") -> str:
        return self(kind, "inspect", "--format", fmt, ref).strip()

    def running(self, ref: str) -> bool:
        return self.inspect(ref, "{{.State.Running}}") == "true"

    def exit_code(self, ref: str) -> int:
        return int(self.inspect(ref, "{{.State.ExitCode}}"))

    def logs(self, ref: str) -> str:
        proc = subprocess.run([self.name, "logs", ref], capture_output=True, text=True, check=False)
        return proc.stdout + proc.stderr


# -- 2. the images ----------------------------------------------------------------------------


def check_images(eng: Engine, names: dict[str, str]) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    rev = images.revision()
    for target, name in names.items():
        user = eng.inspect(name, "{{.Config.User}}", "image")
        labels = json.loads(eng.inspect(name, "{{json .Config.Labels}}", "image") or "{}")
        size = int(eng.inspect(name, "{{.Size}}", "image"))
        log(
            f"{name}: user {user!r}, {size / 1e6:.0f} MB, labels "
            f"version={labels.get('org.opencontainers.image.version')} "
            f"revision={labels.get('org.opencontainers.image.revision')}"
        )
        if not user or user.split(":")[0] in ("0", "root"):
            raise Failed(f"{name} runs as {user!r}: expected the unprivileged uid 10001")
        if labels.get("org.opencontainers.image.version") != images.version():
            raise Failed(
                f"{name}: label org.opencontainers.image.version is not {images.version()}"
            )
        if labels.get("org.opencontainers.image.revision") != rev:
            raise Failed(f"{name}: label org.opencontainers.image.revision is not {rev}")
        facts[f"{target}_mb"] = round(size / 1e6)
    health = eng.inspect(names["runtime"], "{{json .Config.Healthcheck}}", "image")
    if "health" not in health:
        raise Failed(f"{names['runtime']} has no HEALTHCHECK running `paramshard health`: {health}")
    return facts


# -- 3. one shard container -------------------------------------------------------------------


def single_shard(eng: Engine, image: str, tag: str, cleanup: list[list[str]]) -> dict[str, Any]:
    volume, port = f"{tag}-single", free_port()
    url = f"http://127.0.0.1:{port}"
    cleanup.append(["volume", "rm", "-f", volume])
    name = f"{tag}-single"
    cleanup.insert(0, ["rm", "-f", "-t", "0", name])
    env = ["-e", "PARAMSHARD_NUM_SHARDS=1", "-e", "PARAMSHARD_SHARD_INDEX=0"]

    def run_until_ready() -> float:
        """``run -d`` the shard on its volume; seconds until its /readyz answers 200."""
        started = time.monotonic()
        publish, mount = f"127.0.0.1:{port}:7100", f"{volume}:/data"
        eng("run", "-d", "--name", name, "-p", publish, "-v", mount, *env, image)
        wait_for(f"{url}/readyz", lambda: ready(url), 60, every=0.05)
        return time.monotonic() - started

    start_s = run_until_ready()
    log(f"one shard: /readyz answered 200 {start_s:.2f} s after `{eng.name} run`")
    if eng.name == "podman":  # Podman 4 without systemd runs a HEALTHCHECK only when asked
        eng("healthcheck", "run", name)
    else:
        wait_for(
            "the HEALTHCHECK",
            lambda: eng.inspect(name, "{{.State.Health.Status}}") == "healthy",
            120,
        )
    log("one shard: its HEALTHCHECK (`paramshard health`) passes")
    with PSClient([url], worker_id="image-e2e") as ps:
        ps.init({"e2e/w": [1.0, 2.0, 3.0]})
        ps.assign({"e2e/w": [4.0, 5.0, 6.0]})
    version = get_json(f"{url}/v1/variables/e2e/w")["body"]["version"]
    eng("stop", "-t", "60", name)
    code = eng.exit_code(name)
    log(f"one shard: after SIGTERM it exited {code}")
    if code != 0:
        raise Failed(f"the shard exited {code} on SIGTERM, expected 0:\n{eng.logs(name)[-3000:]}")
    if not re.search(r"wrote snapshot \S+ \(shutdown", eng.logs(name)):
        raise Failed(f"no final snapshot in the shard's log:\n{eng.logs(name)[-3000:]}")
    eng("rm", name)
    restart_s = run_until_ready()
    got = get_json(f"{url}/v1/variables/e2e/w?values=true")["body"]
    if got["version"] != version or got.get("values") != [4.0, 5.0, 6.0]:
        raise Failed(
            f"after a restart on the same volume e2e/w is {got}, expected version "
            f"{version} and values [4, 5, 6]"
        )
    log(
        f"one shard: restarted on its volume, e2e/w back at version {version}; /readyz 200 "
        f"{restart_s:.2f} s after `{eng.name} run`"
    )
    eng("rm", "-f", "-t", "0", name)
    return {"run_to_ready_s": [round(start_s, 2), round(restart_s, 2)]}


# -- 4-7. the compose fleet ---------------------------------------------------------------------


class Fleet:
    def __init__(self, eng: Engine, compose: list[str], project: str, steps: int, workdir: Path):
        self.eng, self.project, self.steps = eng, project, steps
        spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
        spec["name"] = project
        found = sorted(
            (int(m.group(1)), m.group(2), svc)
            for svc in spec["services"]
            if (m := SHARD_SERVICE.match(svc))
        )
        #: every shard service, each index's replicas together, and the replicas of each index
        self.shards = [svc for _, _, svc in found]
        self.groups: list[list[str]] = [[] for _ in range(found[-1][0] + 1)]
        for index, _, svc in found:
            self.groups[index].append(svc)
        self.urls: dict[str, str] = {}
        for svc in self.shards:
            service = spec["services"][svc]
            (published,) = service["ports"]
            addr, _, container_port = published.split(":")
            if addr != "127.0.0.1":
                raise Failed(f"docker-compose.yml publishes {svc} on {addr}, not on loopback")
            port = free_port()
            service["ports"] = [f"127.0.0.1:{port}:{container_port}"]
            self.urls[svc] = f"http://127.0.0.1:{port}"
        #: the fleet as a client on this host lists it: the replicas of each index, "|" between
        self.sdk_shards = ",".join("|".join(self.urls[s] for s in g) for g in self.groups)
        for service in spec["services"].values():
            service["build"]["context"] = str(ROOT)
        spec["services"]["worker"]["environment"]["DIGITS_STEPS"] = str(steps)
        self.file = workdir / "docker-compose.yml"
        self.file.write_text(yaml.safe_dump(spec, sort_keys=False))
        self.compose = [*compose, "-p", project, "-f", str(self.file)]

    def __call__(self, *args: str) -> None:
        images.run([*self.compose, *args])

    def container(self, service: str) -> str:
        ids = self.eng(
            "ps",
            "-a",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        ).split()
        if len(ids) != 1:
            raise Failed(f"expected one container of {service}, found {ids}")
        return ids[0]

    def cluster(self, svc: str) -> dict[str, Any]:
        return dict(get_json(self.urls[svc] + "/v1/cluster")["body"])

    def wait_ready(self, timeout: float = 120) -> None:
        for svc, url in self.urls.items():
            wait_for(f"{svc} /readyz", lambda url=url: ready(url), timeout)
        for index in range(len(self.groups)):
            wait_for(
                f"shard {index}'s primary", lambda i=index: self.primary(i) is not None, timeout
            )
        log("every replica answers /readyz 200, and every index has its primary")

    def role(self, svc: str) -> str | None:
        """The replica's role now (``None`` when it does not answer)."""
        try:
            return str(self.cluster(svc)["replication"]["role"])
        except (httpx2.HTTPError, ValueError, KeyError):
            return None

    def primary(self, index: int) -> str | None:
        """The replica of shard ``index`` that says it is primary, if exactly one does."""
        found = [svc for svc in self.groups[index] if self.role(svc) == "primary"]
        return found[0] if len(found) == 1 else None

    def holder(self, name: str) -> int:
        """The shard index that owns ``name`` (placement)."""
        return shard_for(name, len(self.groups))

    def leftovers(self) -> dict[str, list[str]]:
        """This project's containers (of every service, etcd included), networks and volumes
        that exist: found by either engine's compose label and by the project's name prefix."""
        found: dict[str, list[str]] = {}
        for kind in ("container", "network", "volume"):
            listing = (
                ["ps", "-a", "--format", "{{.Names}}"]
                if kind == "container"
                else [kind, "ls", "--format", "{{.Name}}"]
            )
            names: set[str] = set()
            for key in ("com.docker.compose.project", "io.podman.compose.project"):
                out = self.eng(*listing, "--filter", f"label={key}={self.project}", check=False)
                names.update(out.split())
            out = self.eng(*listing, check=False)  # podman-compose names them <project>_...
            names.update(n for n in out.split() if n.startswith(f"{self.project}_"))
            if names:
                found[kind] = sorted(names)
        return found

    def remove_all(self) -> dict[str, list[str]]:
        """Remove this project's containers, networks and volumes, whatever state they are in;
        return what is still there after (nothing, unless the engine refused)."""
        subprocess.run([*self.compose, "down", "-v", "-t", "5"], capture_output=True, check=False)
        for kind, names in self.leftovers().items():
            rm = (
                ["rm", "-f", "-t", "0", *names]
                if kind == "container"
                else [kind, "rm", "-f", *names]
            )
            self.eng(*rm, check=False)
        return self.leftovers()


def run_fleet(fleet: Fleet) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    eng = fleet.eng
    log("== 4. the compose fleet: up")
    fleet("up", "-d", "--no-build")
    fleet.wait_ready()
    worker = fleet.container("worker")
    step = lambda: global_step(fleet)  # noqa: E731
    try:
        wait_for("the worker training (global_step >= 300)", lambda: (step() or 0) >= 300, 300)
    except Failed as exc:
        raise Failed(f"{exc}; the worker's log:\n{eng.logs(worker)[-3000:]}") from None
    index = fleet.holder(KERNEL)
    victim, checkpoint, before = checkpoint_on_primary(fleet, index)
    (other,) = [svc for svc in fleet.groups[index] if svc != victim]
    log(
        f"fleet checkpoint {checkpoint} taken at global_step {step()}; {victim} is shard {index}'s "
        f"primary and holds {KERNEL} (state version {before['state_version']}, snapshot "
        f"{before['last_snapshot']})"
    )
    snap_version = before["last_snapshot"]["state_version"]
    if snap_version <= 0:
        raise Failed(f"{victim}'s checkpoint holds nothing: {before['last_snapshot']}")
    container = fleet.container(victim)
    at_kill = step() or 0
    killed_at = time.monotonic()
    eng("kill", "--signal", "KILL", container)
    try:
        wait_for(f"{other} to take over", lambda: fleet.role(other) == "primary", 60, every=0.1)
    except Failed as exc:
        try:
            view = fleet.cluster(other)
            seen = json.dumps({k: view.get(k) for k in ("replication", "leadership")}, default=str)[
                :3000
            ]
        except (httpx2.HTTPError, ValueError, KeyError) as why:
            seen = f"no answer ({type(why).__name__}: {why})"
        raise Failed(
            f"{exc}; {other}'s replication and leadership: {seen}\n{other}'s log:\n"
            f"{eng.logs(fleet.container(other))[-4000:]}\netcd's log:\n"
            f"{eng.logs(fleet.container('etcd'))[-2000:]}"
        ) from None
    facts["failover_s"] = round(time.monotonic() - killed_at, 2)
    log(f"{victim} killed (SIGKILL); {other} primary {facts['failover_s']} s later")
    moved = step() or 0
    wait_for(
        "the worker training on through the new primary",
        lambda: (step() or 0) >= moved + 100 or not eng.running(worker),
        120,
        every=0.1,
    )
    facts["worker_on_s"] = round(time.monotonic() - killed_at, 2)
    if not eng.running(worker) and eng.exit_code(worker) != 0:
        raise Failed(f"the worker failed after the failover:\n{eng.logs(worker)[-3000:]}")
    log(
        f"the worker trained on: global_step {at_kill} at the kill, {step()} "
        f"{facts['worker_on_s']} s after it"
    )
    wait_for(
        f"{victim} down after SIGKILL",
        lambda: (
            not eng.running(container)
            or fleet.cluster(victim)["incarnation"] != before["incarnation"]
        ),
        60,
    )
    if not eng.running(container):
        log(f"{victim} is down (exit {eng.exit_code(container)}); starting it again")
        eng("start", container)
    wait_for(f"{victim} /readyz after the restart", lambda: ready(fleet.urls[victim]), 120)
    wait_for(f"{victim} back as a backup", lambda: fleet.role(victim) == "backup", 120)
    wait_for(
        f"{victim} caught up (in {other}'s in-sync set)",
        lambda: any(
            u.startswith(f"http://{victim}:")
            for u in fleet.cluster(other)["replication"].get("in_sync", [])
        ),
        120,
    )
    after = fleet.cluster(victim)
    restored = after.get("restored") or {}
    if (
        after["incarnation"] == before["incarnation"]
        or restored.get("state_version", -1) < snap_version
    ):
        raise Failed(
            f"{victim} after SIGKILL + start: {after}; expected a new incarnation that "
            f"restored state version >= {snap_version} from its volume"
        )
    kernel = get_json(f"{fleet.urls[victim]}/v1/variables/{KERNEL}")["body"]
    log(
        f"{victim} is back as a backup of {other}, caught up: incarnation {after['incarnation']}, "
        f"restored {restored.get('path')} (state version {restored.get('state_version')}); "
        f"{KERNEL} at version {kernel['version']}"
    )
    wait_for("the worker to finish", lambda: not eng.running(worker), 900, every=2)
    code, out = eng.exit_code(worker), eng.logs(worker)
    m = re.search(r"held-out accuracy of the fleet's weights ([0-9.]+)", out)
    log(f"worker exited {code}; " + (m.group(0) if m else "no accuracy line"))
    if code != 0 or not m or float(m.group(1)) < MIN_ACCURACY:
        raise Failed(
            f"the worker exited {code}, expected 0 with accuracy >= {MIN_ACCURACY}:\n{out[-3000:]}"
        )
    facts["accuracy"] = float(m.group(1))
    restarts = int(eng.inspect(worker, "{{.RestartCount}}") or 0)
    claims = len(re.findall(r"claimed worker index", out))
    if restarts or claims != 1:
        raise Failed(
            f"the worker was restarted ({restarts} restart(s), {claims} start(s) in its log): "
            f"it must ride out the failover in one run:\n{out[-3000:]}"
        )
    if step() != fleet.steps:
        raise Failed(
            f"global_step is {step()} after the worker's {fleet.steps} steps: a step counted "
            "twice or lost across the failover"
        )
    log(f"global_step {fleet.steps}: every step counted once across the failover")

    log("== 5. a variable over REST from the host")
    got = get_json(f"{fleet.urls[victim]}/v1/variables/{KERNEL}?values=true")
    body = got["body"]
    if got["status"] != 200 or body["shape"] != [64, 32] or len(body["values"]) != 64:
        raise Failed(f"GET {KERNEL} from the host: {got['status']} {str(body)[:500]}")
    log(
        f"GET {fleet.urls[victim]}/v1/variables/{KERNEL}: shape {body['shape']}, version "
        f"{body['version']}, updates {body['updates']}, l2_norm {body['l2_norm']:.3f}"
    )
    status = subprocess.run(
        [
            str(Path(sys.executable).parent / "paramshard"),
            "status",
            "--shards",
            fleet.sdk_shards,  # every replica, a row each, with its role
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    log("paramshard status:\n" + status.stdout + status.stderr)

    log("== 6. stop (SIGTERM), then up again on the same volumes")
    with PSClient(fleet.sdk_shards, worker_id="image-e2e") as ps:
        stopped = ps.increment("e2e/stopped")  # acknowledged after the last periodic snapshot
    state = {svc: fleet.cluster(svc)["state_version"] for svc in fleet.shards}
    fleet("stop")
    for svc in fleet.shards:
        cid = fleet.container(svc)
        code = eng.exit_code(cid)
        if code != 0:
            raise Failed(f"{svc} exited {code} on SIGTERM, expected 0:\n{eng.logs(cid)[-3000:]}")
    finals = sum(
        bool(re.search(r"wrote snapshot \S+ \(shutdown", eng.logs(fleet.container(s))))
        for s in fleet.shards
    )
    log(
        f"every shard exited 0 on SIGTERM; {finals} wrote a final snapshot (the others had "
        f"nothing new since their last one)"
    )
    restart_fleet(fleet, state, stopped)
    log("== 7. down -v")
    fleet("down", "-v")
    left = eng(
        "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={fleet.project}"
    ).split()
    if left:
        raise Failed(f"volumes left after down -v: {left}")
    return facts


def checkpoint_on_primary(fleet: Fleet, index: int) -> tuple[str, str, dict[str, Any]]:
    """A fleet checkpoint written by shard ``index``'s primary, which still leads: that
    replica, the checkpoint and its ``/v1/cluster``. The checkpoint's requests go to the
    replica the SDK takes for the primary, the first listed until a refusal says otherwise,
    and a backup takes them too: each group is listed with its primary first. Tried again when
    the lead moved meanwhile (a lease missed on a loaded machine hands it over)."""
    seen: list[str] = []
    for _ in range(3):
        wait_for(f"shard {index}'s primary", lambda: fleet.primary(index) is not None, 60)
        leads = [fleet.primary(i) for i in range(len(fleet.groups))]
        shards = ",".join(
            "|".join(fleet.urls[s] for s in sorted(group, key=lambda s: s != lead))
            for group, lead in zip(fleet.groups, leads)
        )
        with PSClient(shards, worker_id="image-e2e") as ps:
            checkpoint = ps.checkpoint()
        for svc in fleet.groups[index]:
            view = fleet.cluster(svc)
            if checkpoint in str(view.get("last_snapshot")) and fleet.role(svc) == "primary":
                return svc, checkpoint, view
        seen.append(f"{checkpoint}: primary now {fleet.primary(index)}")
        log(f"shard {index}'s lead moved during checkpoint {checkpoint}; taking another")
    raise Failed(f"no checkpoint written by a replica of shard {index} still leading: {seen}")


def restart_fleet(fleet: Fleet, state: dict[str, int], stopped: int) -> None:
    """Step 6's second half: every shard up again on its volume, each index electing its
    primary again (every replica of every group restarted), each replica restored to the state
    it had when stopped, the last acknowledged write (``e2e/stopped`` = ``stopped``) there."""
    started = time.monotonic()
    fleet("up", "-d", "--no-build", *fleet.shards)
    fleet.wait_ready()
    log(f"every index elected a primary again {time.monotonic() - started:.1f} s after `up`")
    index = fleet.holder("e2e/stopped")
    primary = fleet.primary(index)
    got = get_json(f"{fleet.urls[primary]}/v1/variables/e2e/stopped?values=true") if primary else {}
    if got.get("status") != 200 or got["body"].get("values") != stopped:
        raise Failed(
            f"e2e/stopped after the restart, on shard {index}'s primary {primary}: {got}; "
            f"expected {stopped} (acknowledged before the stop)"
        )
    for svc in fleet.shards:
        restored = (fleet.cluster(svc).get("restored") or {}).get("state_version")
        if restored != state[svc] and not (restored is None and state[svc] == 0):  # empty
            raise Failed(
                f"{svc} restored state version {restored}, expected {state[svc]} (when stopped)"
            )
    log(f"every shard restored the state it had when stopped: {state}")


def global_step(fleet: Fleet) -> int | None:
    for url in fleet.urls.values():  # any replica that answers (one may be down)
        try:
            got = get_json(f"{url}/v1/variables/global_step?values=true")
        except httpx2.HTTPError:
            continue
        if got["status"] == 200:
            return int(got["body"]["values"])
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", action="store_true", help="leave containers and volumes for a look")
    p.add_argument("--steps", type=int, default=4000, help="the worker's steps (DIGITS_STEPS)")
    args = p.parse_args(argv)
    started = time.monotonic()
    tag = f"paramshard-e2e-{os.getpid()}"
    # The fleet's token: docker-compose.yml hands PARAMSHARD_TOKEN to the shards and the worker;
    # this script sends it with every request (the SDK and `paramshard status` read it too).
    os.environ["PARAMSHARD_TOKEN"] = secrets.token_hex(32)
    cleanup: list[list[str]] = []
    fleet: Fleet | None = None
    eng: Engine | None = None
    facts: dict[str, Any] = {}
    left: dict[str, list[str]] = {}  # what cleaning up could not remove
    try:
        log("== 1. the engine")
        try:
            eng = Engine(ensure_engine())
            compose = compose_command(eng.name)
        except CannotRun as exc:
            if os.environ.get("PARAMSHARD_SKIP_IMAGE") == "1":
                log(f"SKIPPED (PARAMSHARD_SKIP_IMAGE=1): no container engine can run here: {exc}")
                return 0
            print(
                f"error: no container engine can run here: {exc}\n(PARAMSHARD_SKIP_IMAGE=1 "
                "makes this a skip)",
                file=sys.stderr,
            )
            return 1
        log("== 2. the images")
        t = time.monotonic()
        names = images.build(eng.name)
        facts["build_s"] = round(time.monotonic() - t)
        facts.update(check_images(eng, names))
        log("== 3. one shard container")
        facts.update(single_shard(eng, names["runtime"], tag, cleanup))
        with tempfile.TemporaryDirectory(prefix="paramshard-e2e-") as workdir:
            fleet = Fleet(eng, compose, tag, args.steps, Path(workdir))
            facts.update(run_fleet(fleet))
    except (Failed, images.ImageError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if eng is not None and not args.keep:
            if fleet is not None:
                left = fleet.remove_all()
            for cmd in cleanup:
                eng(*cmd, check=False)
            if left:
                print(f"FAILED: could not remove the run's {left}", file=sys.stderr)
        elif eng is not None:
            log(
                f"--keep: remove it all with `{eng.name} rm -f {tag}-single; {eng.name} volume rm "
                f"{tag}-single` and `{' '.join(fleet.compose) if fleet else ''} down -v`"
            )
    if left:
        return 1
    facts["total_s"] = round(time.monotonic() - started)
    log(f"PASSED: {json.dumps(facts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
