"""Readers for the deployment files, shared by the static checks and the multi-host test, and
the checks that the settings a file sets are the ones the code reads (:func:`shard_config`,
:func:`check_worker_env`).

``docker-compose.yml`` is read with PyYAML (anchors and ``<<`` merge keys resolved, as Compose
resolves them); ``docker/Dockerfile`` with :func:`parse_dockerfile`, a small reader of the
instructions this repository uses (continuation lines, comments, ``FROM ... AS stage``).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shlex
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from client_sdk._settings import load_settings
from client_sdk.wire import ENV_SHARDS, ENV_TOKEN, ENV_WORKER_ID
from server import config as config_module
from server.config import ShardConfig, env_name
from server.demo import digits_worker as digits

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S_DIR = ROOT / "docker" / "k8s"

#: A shard service: ``ps<index>`` and its index's other replicas, ``ps<index>b``, ``ps<index>c``...
SHARD_SERVICE = re.compile(r"^ps(\d+)([b-z]?)$")


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def shard_services(compose: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every shard service, replicas included (``ps0``, ``ps0b``, ``ps1``, ...), in
    shard-index order, each index's first replica first."""
    found = sorted(
        (int(m.group(1)), m.group(2), name)
        for name in compose["services"]
        if (m := SHARD_SERVICE.match(name))
    )
    return [(name, compose["services"][name]) for _, _, name in found]


def replica_groups(compose: dict[str, Any]) -> list[list[tuple[str, dict[str, Any]]]]:
    """The shard services grouped by shard index (index 0's replicas first)."""
    groups: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, svc in shard_services(compose):
        m = SHARD_SERVICE.match(name)
        assert m is not None
        groups.setdefault(int(m.group(1)), []).append((name, svc))
    return [groups[i] for i in sorted(groups)]


#: What the user's .env gives ``${PARAMSHARD_TOKEN:?...}`` in the compose file, and what the
#: Secret's file holds in a pod, in tests.
A_TOKEN = "0123456789abcdef" * 4
#: The compose file's required interpolation of the token (compose stops, saying this, without).
TOKEN_FROM_ENV = re.compile(r"\$\{PARAMSHARD_TOKEN:\?[^}]+\}")


def interpolated(env: dict[str, str]) -> dict[str, str]:
    """``env`` as compose passes it when PARAMSHARD_TOKEN is set (in .env or the shell)."""
    return {k: TOKEN_FROM_ENV.sub(A_TOKEN, v) if isinstance(v, str) else v for k, v in env.items()}


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` as a dict of strings (both Compose spellings)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case, e.g. "COPY"
    args: str  # the rest of the (joined) line
    stage: str  # the name of the stage it belongs to ("" before the first FROM)
    line: int  # 1-based line where it starts


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    stage = ""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        joined = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = joined.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.search(r"\s+AS\s+(\S+)\s*$", args, re.IGNORECASE)
            stage = m.group(1) if m else ""
        out.append(Instruction(keyword, args.strip(), stage, start))
    return out


def stages(instructions: list[Instruction]) -> list[str]:
    return [i.stage for i in instructions if i.keyword == "FROM"]


def in_stage(instructions: list[Instruction], stage: str, keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.stage == stage and i.keyword == keyword]


def image_env(instructions: list[Instruction], stage: str) -> dict[str, str]:
    """The ``ENV`` a container of ``stage`` starts with (the ``base`` stage's, then its own)."""
    env: dict[str, str] = {}
    for ins in in_stage(instructions, "base", "ENV") + in_stage(instructions, stage, "ENV"):
        for item in shlex.split(ins.args):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` (relative, with ``/``) reaches the build context under these
    ``.dockerignore`` patterns: the last matching pattern wins, ``!`` re-includes, and a
    pattern that matches a directory matches everything under it."""
    included = True
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip().strip("/")
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(p, pat[3:]) for p in parts) or any(
                fnmatch.fnmatchcase(p, pat) for p in prefixes
            )
        else:
            hit = any(
                fnmatch.fnmatchcase(p, pat) and p.count("/") == pat.count("/") for p in prefixes
            )
        if hit:
            included = negate
    return included


def dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def load_k8s() -> list[tuple[Path, dict[str, Any]]]:
    """Every document of every manifest in docker/k8s/ except the kustomization."""
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def k8s_objects(
    docs: list[tuple[Path, dict[str, Any]]], kind: str, component: str | None = None
) -> list[dict[str, Any]]:
    """The objects of ``kind`` (with ``app.kubernetes.io/component: component`` if given), in
    name order."""
    found = [
        doc
        for _, doc in docs
        if doc.get("kind") == kind
        and (
            component is None
            or doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        )
    ]
    return sorted(found, key=lambda doc: doc["metadata"]["name"])


def k8s_object(
    docs: list[tuple[Path, dict[str, Any]]], kind: str, component: str | None = None
) -> dict[str, Any]:
    found = k8s_objects(docs, kind, component)
    what = f"{kind} of component {component}" if component else kind
    assert len(found) == 1, f"expected one {what} in docker/k8s/, found {len(found)}"
    return found[0]


def k8s_env(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value (a string) or the ``valueFrom`` mapping."""
    return {
        e["name"]: e["value"] if "value" in e else e["valueFrom"] for e in container.get("env", [])
    }


# -- the settings a file sets, against what the code reads ------------------------------------

SHARD_ENV = {env_name(f.name) for f in fields(ShardConfig)}
SDK_ENV = {ENV_SHARDS, ENV_TOKEN, ENV_WORKER_ID}


def shard_config(
    env: dict[str, str], hostname: str | None = None, monkeypatch: pytest.MonkeyPatch | None = None
) -> ShardConfig:
    """What ``paramshard serve`` makes of ``env`` as a container sets it (``hostname``: the
    host's name it sees); fails naming any ``PARAMSHARD_*`` variable it does not read."""
    unknown = sorted(k for k in env if k.startswith("PARAMSHARD_") and k not in SHARD_ENV)
    assert not unknown, f"paramshard serve does not read {unknown}; it reads {sorted(SHARD_ENV)}"
    if hostname is not None:
        assert monkeypatch is not None
        monkeypatch.setattr(config_module.socket, "gethostname", lambda: hostname)
    env = interpolated(env)
    if env_name("token_file") in env:  # the Secret's file, as mounted in a pod
        mounted = Path(tempfile.mkdtemp()) / "tokens"
        mounted.write_text(A_TOKEN + "\n")
        env = {**env, env_name("token_file"): str(mounted)}
    return ShardConfig.from_sources({}, env)


def check_worker_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The example worker and the SDK accept this environment as it is; the worker's settings."""
    unknown = sorted(k for k in env if k.startswith("PARAMSHARD_") and k not in SDK_ENV)
    assert not unknown, f"the SDK does not read {unknown}; it reads {sorted(SDK_ENV)}"
    for key in list(os.environ):
        if key.startswith(("PARAMSHARD_", "DIGITS_")):
            monkeypatch.delenv(key)
    for key, value in interpolated(env).items():
        monkeypatch.setenv(key, value)
    args = digits.parse_args([])  # exits (SystemExit) on a bad DIGITS_* value
    for key in env:
        if key.startswith("DIGITS_"):
            assert hasattr(args, key[len("DIGITS_") :].lower()), (
                f"{key} is not a setting of server/demo/digits_worker.py"
            )
    load_settings(environ=interpolated(env))
    return args


def follows_a_cut_primary(args: argparse.Namespace) -> bool:
    """A call stuck on a primary cut off from the network (it never answers) gives up on it
    soon enough to follow the new primary within the call's retry deadline."""
    return args.timeout <= 10 and args.retry_deadline >= 2 * args.timeout + 30
