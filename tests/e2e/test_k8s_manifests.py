"""Static checks of the Kubernetes manifests users deploy (docker/k8s/): no cluster runs here,
so they are checked against the API schemas of kubernetes-validate, strictly (unknown fields are
errors), for the oldest and the newest Kubernetes it knows of those we support, and against the
code that reads their settings: every shard StatefulSet's pods form the replica groups the shards
read, elect their primary in the manifests' etcd, and read their tokens from the Secret; the
worker Job lists every group (tests/e2e/test_deploy_files.py checks the Dockerfile and the
compose file the same way).
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from client_sdk.wire import ENV_SHARDS, ENV_TOKEN, ENV_WORKER_ID
from server.config import InvalidSetting, env_name
from tests.helpers.deploy_files import (
    DOCKERFILE,
    K8S_DIR,
    check_worker_env,
    follows_a_cut_primary,
    in_stage,
    k8s_env,
    k8s_object,
    k8s_objects,
    load_compose,
    load_k8s,
    parse_dockerfile,
    shard_config,
)

#: Kubernetes versions the manifests must validate against (oldest supported, newest known).
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def compose():
    return load_compose()


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def k8s():
    return load_k8s()


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_follow_the_kubernetes_api(k8s, version):
    assert k8s
    for path, doc in k8s:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (
            kubernetes_validate.SchemaNotFoundError,
            kubernetes_validate.utils.VersionNotSupportedError,
        ):
            pytest.skip(f"this kubernetes-validate has no schemas for Kubernetes {version}")
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{path.name}: {doc['kind']}/{doc['metadata']['name']} is invalid for "
                f"Kubernetes {version}: {str(exc).splitlines()[0]}"
            )


def test_kubernetes_check_catches_mistakes(k8s):
    sts = copy.deepcopy(shard_sets(k8s)[0])
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def shard_sets(k8s) -> list[dict]:
    """The shards' StatefulSets (one per replica of every index), in name order."""
    return k8s_objects(k8s, "StatefulSet", "shard")


def shard_url(sts: dict, i: int, port: int | str) -> str:
    """Pod ``i`` of ``sts`` as the others reach it: its name under the governing Service."""
    return f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}"


#: What tells the two shard sets apart (their names, and the other set each keeps off).
SET_OWN = ("PARAMSHARD_ADVERTISE_URL",)


def without_set_names(sts: dict) -> dict:
    """``sts`` with its name, replica label, anti-affinity and own URL taken out."""
    out = copy.deepcopy(sts)
    out["metadata"].pop("name")
    for labels in (
        out["metadata"]["labels"],
        out["spec"]["selector"]["matchLabels"],
        out["spec"]["template"]["metadata"]["labels"],
    ):
        labels.pop("paramshard.io/replica")
    spec = pod_spec(out)
    spec.pop("affinity")
    (container,) = spec["containers"]
    container["env"] = [e for e in container["env"] if e["name"] not in SET_OWN]
    return out


def test_every_shard_index_is_a_group_of_two_replicas(k8s, monkeypatch):
    """Pod i of each shard StatefulSet is a replica of shard i: the same index, the same
    group (every set's pod i, as the pods reach each other), its own URL in it."""
    sets = shard_sets(k8s)
    assert len(sets) == 2, [s["metadata"]["name"] for s in sets]
    replicas = sets[0]["spec"]["replicas"]
    assert all(s["spec"]["replicas"] == replicas for s in sets), "the sets differ in size"
    assert without_set_names(sets[0]) == without_set_names(sets[1]), (
        "the shard StatefulSets differ beyond their names and own URL"
    )
    port = k8s_env(pod_spec(sets[0])["containers"][0])["PARAMSHARD_PORT"]
    for i in range(replicas):
        group = tuple(shard_url(sts, i, port) for sts in sets)
        for sts in sets:
            (container,) = pod_spec(sts)["containers"]
            env = k8s_env(container)
            host = f"{sts['metadata']['name']}-{i}"
            config = shard_config(env, hostname=host, monkeypatch=monkeypatch)
            assert (config.shard_index, config.num_shards) == (i, replicas), host
            assert config.replica_group == group, host
            assert config.advertise_url == shard_url(sts, i, port), host
    # the two replicas of a shard kept on different nodes where the cluster has them
    for sts, other in zip(sets, reversed(sets)):
        (term,) = pod_spec(sts)["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        theirs = other["spec"]["template"]["metadata"]["labels"]
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= theirs.items()
        mine = sts["spec"]["template"]["metadata"]["labels"]
        assert not term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= mine.items()


def test_every_shard_elects_its_primary_in_the_manifests_etcd(k8s, compose, monkeypatch):
    etcd = k8s_object(k8s, "StatefulSet", "etcd")
    svc = k8s_object(k8s, "Service", "etcd")
    (container,) = pod_spec(etcd)["containers"]
    env = k8s_env(container)
    (cport,) = container["ports"]
    (sport,) = svc["spec"]["ports"]
    assert etcd["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    assert sport["targetPort"] in (cport["containerPort"], cport["name"])
    url = f"http://{svc['metadata']['name']}:{sport['port']}"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == url
    assert env["ETCD_LISTEN_CLIENT_URLS"].endswith(f":{cport['containerPort']}")
    # its data on its own volume (the in-sync sets must outlive an etcd restart)
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["ETCD_DATA_DIR"].startswith(mounts[claim["metadata"]["name"]] + "/")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    assert container["image"] == compose["services"]["etcd"]["image"]  # the image we build
    ctx = pod_spec(etcd)["securityContext"]
    assert ctx["runAsNonRoot"] and str(ctx["fsGroup"]) == str(ctx["runAsUser"]) == "10001"
    for sts in shard_sets(k8s):
        name = f"{sts['metadata']['name']}-0"
        shard_env = k8s_env(pod_spec(sts)["containers"][0])
        config = shard_config(shard_env, hostname=name, monkeypatch=monkeypatch)
        assert config.etcd == (url,), sts["metadata"]["name"]


def test_statefulset_shards_take_their_index_from_the_pod_ordinal(k8s, monkeypatch):
    for sts in shard_sets(k8s):
        (container,) = pod_spec(sts)["containers"]
        env = k8s_env(container)
        assert env["PARAMSHARD_SHARD_INDEX"] == "auto"
        replicas = sts["spec"]["replicas"]
        name = sts["metadata"]["name"]
        for i in range(replicas):
            config = shard_config(env, hostname=f"{name}-{i}", monkeypatch=monkeypatch)
            assert (config.shard_index, config.num_shards) == (i, replicas)
        # one pod too many (kubectl scale without resharding) refuses to start
        with pytest.raises(InvalidSetting, match="shard index must be in"):
            shard_config(env, hostname=f"{name}-{replicas}", monkeypatch=monkeypatch)
        assert container["args"] == ["serve"]


def test_statefulset_service_probes_volume_and_budget(k8s, dockerfile):
    svc = k8s_object(k8s, "Service", "shard")
    pdb = k8s_object(k8s, "PodDisruptionBudget")
    assert svc["spec"]["clusterIP"] == "None", "a headless Service gives each pod a DNS name"
    assert svc["spec"]["publishNotReadyAddresses"], "replicas must resolve each other unready"
    assert pdb["spec"].get("maxUnavailable") == 1  # never both replicas of a shard at once
    for sts in shard_sets(k8s):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        (container,) = pod_spec(sts)["containers"]
        env = k8s_env(container)
        port = int(env["PARAMSHARD_PORT"])

        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

        (cport,) = container["ports"]
        assert cport["containerPort"] == port
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"]["port"] in (port, cport["name"]), probe

        (claim,) = sts["spec"]["volumeClaimTemplates"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts[claim["metadata"]["name"]] == env["PARAMSHARD_DATA_DIR"]

        for key in ("requests", "limits"):
            assert {"cpu", "memory"} <= container["resources"][key].keys()
        # the pod runs as the image's user, so the volume (fsGroup) is writable by it
        uid = in_stage(dockerfile, "runtime", "USER")[0].args.split(":")[0]
        ctx = pod_spec(sts)["securityContext"]
        assert ctx["runAsNonRoot"] and str(ctx["runAsUser"]) == uid and str(ctx["fsGroup"]) == uid
        assert pod_spec(sts)["terminationGracePeriodSeconds"] >= 30  # time for the final snapshot

        # Prometheus finds the shards' /metrics by the usual pod annotations.
        notes = sts["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == port
        assert notes["prometheus.io/path"] == "/metrics"


def test_statefulset_shards_read_their_tokens_from_the_secret(k8s):
    secret = k8s_object(k8s, "Secret")
    for sts in shard_sets(k8s):
        (container,) = pod_spec(sts)["containers"]
        path = Path(k8s_env(container)[env_name("token_file")])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
        (name,) = [n for n, v in volumes.items() if "secret" in v]
        assert mounts[name] == str(path.parent)
        assert volumes[name]["secret"]["secretName"] == secret["metadata"]["name"]
        assert not volumes[name]["secret"].get("optional"), "a shard must not start without it"
        assert path.name in secret["stringData"]


def test_worker_job_lists_every_shard_group(k8s, compose, monkeypatch):
    sets = shard_sets(k8s)
    job = k8s_object(k8s, "Job")
    secret = k8s_object(k8s, "Secret")
    shard = pod_spec(sets[0])["containers"][0]
    port = k8s_env(shard)["PARAMSHARD_PORT"]
    (container,) = pod_spec(job)["containers"]
    env = k8s_env(container)
    # the replicas of each index ("|" between them), the indexes in order
    expected = [
        "|".join(shard_url(sts, i, port) for sts in sets)
        for i in range(sets[0]["spec"]["replicas"])
    ]
    assert env[ENV_SHARDS].strip().split(",") == expected
    assert k8s_env(shard)["PARAMSHARD_FLEET_URLS"].split(",") == expected  # the fleet view
    assert job["spec"]["completionMode"] == "Indexed"
    assert int(env["DIGITS_NUM_WORKERS"]) == job["spec"]["completions"]
    index_from = env["DIGITS_WORKER_INDEX"]["fieldRef"]["fieldPath"]
    assert "job-completion-index" in index_from
    ref = env[ENV_TOKEN]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and not ref.get("optional")
    assert ref["key"] in secret["stringData"]
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    args = check_worker_env({**plain, "DIGITS_WORKER_INDEX": "2", ENV_WORKER_ID: "w"}, monkeypatch)
    assert follows_a_cut_primary(args)
    for key in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][key].keys()
    # the same images as the compose file builds
    assert shard["image"] == compose["services"]["ps0"]["image"]
    assert container["image"] == compose["services"]["worker"]["image"]
