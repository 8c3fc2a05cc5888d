"""What `make image` and `make test-image` decide before any container engine is involved
(docker/images.py, docker/image_e2e.py). The engine itself runs in `make test-image`, which CI
runs after `make test`:

* the Debian mirror the local base image is made from is the one in apt's sources (one-line
  and deb822 formats), unless ``PARAMSHARD_DEBIAN_MIRROR`` names another;
* the compose file `make test-image` brings up is docker-compose.yml with only its project
  name, its host ports (free ones, still on loopback), its build context and the worker's step
  count changed: the fleet it checks is the one users run;
* with no engine that can run, `make test-image` fails and says why, and only
  ``PARAMSHARD_SKIP_IMAGE=1`` turns that into a skip, which it says too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest
import yaml

from tests.conftest import ROOT

E2E = ROOT / "docker" / "image_e2e.py"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docker" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def image_e2e() -> ModuleType:
    return load("image_e2e")


@pytest.fixture(scope="module")
def images() -> ModuleType:
    return load("images")


def test_mirror_from_deb822_sources(images, tmp_path, monkeypatch):
    monkeypatch.delenv("PARAMSHARD_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n"
    )
    assert images.debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources(images, tmp_path, monkeypatch):
    monkeypatch.delenv("PARAMSHARD_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb https://packages.example/apt cloud-sdk main\n"
        "deb [signed-by=/k.gpg] http://ftp.example.org/debian/ bookworm main contrib\n"
    )
    assert images.debian_mirror(tmp_path) == "http://ftp.example.org/debian/"
    monkeypatch.setenv("PARAMSHARD_DEBIAN_MIRROR", "http://mine.example/debian")
    assert images.debian_mirror(tmp_path) == "http://mine.example/debian"


def test_mirror_defaults_to_debians_own(images, tmp_path, monkeypatch):
    monkeypatch.delenv("PARAMSHARD_DEBIAN_MIRROR", raising=False)
    assert images.debian_mirror(tmp_path) == images.DEFAULT_MIRROR


def test_the_fleet_under_test_is_the_compose_file(image_e2e, tmp_path):
    fleet = image_e2e.Fleet(None, ["podman-compose"], "paramshard-e2e-1", 123, tmp_path)
    original = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    copy = yaml.safe_load(fleet.file.read_text())
    assert copy["name"] == "paramshard-e2e-1"
    assert fleet.compose == ["podman-compose", "-p", "paramshard-e2e-1", "-f", str(fleet.file)]
    # every replica of every index, each with a port of its own, listed to the SDK as groups
    shards = [s for s in original["services"] if image_e2e.SHARD_SERVICE.match(s)]
    assert sorted(fleet.shards) == sorted(shards) and len(shards) >= 4
    assert fleet.sdk_shards == ",".join("|".join(fleet.urls[s] for s in g) for g in fleet.groups)
    assert all(len(g) >= 2 for g in fleet.groups), fleet.groups
    ports = {svc: copy["services"][svc]["ports"] for svc in fleet.shards}
    for svc, (published,) in ports.items():
        addr, host_port, container_port = published.split(":")
        assert (addr, container_port) == ("127.0.0.1", "7100")
        assert fleet.urls[svc] == f"http://127.0.0.1:{host_port}"
    assert len({p[0] for p in ports.values()}) == len(ports)
    assert copy["services"]["worker"]["environment"]["DIGITS_STEPS"] == "123"
    # Everything else is the file as users have it (copied whole first: YAML anchors share dicts).
    original, copy = json.loads(json.dumps(original)), json.loads(json.dumps(copy))
    for spec in (original, copy):
        spec.pop("name")
        for svc in fleet.shards:
            spec["services"][svc].pop("ports")
        extensions = [v for k, v in spec.items() if k.startswith("x-") and "build" in v]
        for service in [*spec["services"].values(), *extensions]:
            service["build"].pop("context")
        spec["services"]["worker"]["environment"].pop("DIGITS_STEPS")
    assert copy == original


def run_e2e(env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    """docker/image_e2e.py where no docker, podman or apt-get is on the PATH."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    return subprocess.run(
        [sys.executable, str(E2E)],
        cwd=ROOT,
        env={**clean, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_an_engine_it_fails_and_says_why(tmp_path):
    done = run_e2e({}, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: no container engine can run here: no container engine: docker does not " in (
        done.stderr
    )
    assert "PARAMSHARD_SKIP_IMAGE=1 makes this a skip" in done.stderr
    assert "PASSED" not in done.stdout


def test_without_an_engine_a_skip_only_when_asked_and_said(tmp_path):
    done = run_e2e({"PARAMSHARD_SKIP_IMAGE": "1"}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED (PARAMSHARD_SKIP_IMAGE=1): no container engine can run here" in done.stdout
    assert "PASSED" not in done.stdout
    done = run_e2e({"PARAMSHARD_SKIP_IMAGE": "yes"}, tmp_path)  # only "1" skips
    assert done.returncode == 1
