"""Inspection that follows the variable (server/follow.py, ``paramshard get``): on a fleet
whose shards know each other's URLs (``--fleet-urls``), ``GET /v1/variables/NAME`` sent to
any shard answers with the owner's answer, JSON or ``.npy``, with the caller's token; a shard
without the URLs answers 421. ``paramshard get`` prints a variable and a counter's value from
the fleet. A fleet serving https with a private CA's certificates follows the variable
too. A worker whose shard does not answer says so in its log after a few seconds."""

from __future__ import annotations

import io
import logging
import os
import ssl
import subprocess
import sys
import uuid

import httpx2
import numpy as np
import pytest

import client_sdk
from client_sdk import wire
from client_sdk.placement import shard_for
from tests.conftest import ROOT
from tests.helpers.pki import loopback_pki
from tests.helpers.ports import refused_port

TOKEN = "follow-token-" + "f6" * 16
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def fleet(module_fleet_factory):
    """3 shards with a token, restarted once their ports are known, with --fleet-urls."""
    fleet = module_fleet_factory(3, env={wire.ENV_TOKEN: TOKEN})
    fleet.env["PARAMSHARD_FLEET_URLS"] = ",".join(fleet.urls)
    for i in range(3):
        fleet.stop(i)
        fleet.start(i)
    return fleet


@pytest.fixture(scope="module")
def names(fleet):
    """A tensor on each shard and a counter, made through the SDK."""
    prefix = uuid.uuid4().hex[:8]
    found: dict[int, str] = {}
    k = 0
    while len(found) < 3:
        name = f"{prefix}/w{k}"
        found.setdefault(shard_for(name, 3), name)
        k += 1
    with client_sdk.PSClient(fleet.urls, "w-follow", token=TOKEN) as ps:
        ps.init({n: np.full((2, 2), i, np.float32) for i, n in found.items()})
        counter = f"{prefix}/step"
        for _ in range(5):
            ps.increment(counter)
    return found, counter


def test_any_shard_answers_for_any_variable(fleet, names, http):
    found, _ = names
    for owner, name in found.items():
        for i, url in enumerate(fleet.urls):
            r = http.get(f"{url}/v1/variables/{name}", params={"values": "true"}, headers=AUTH)
            assert r.status_code == 200, (i, r.text)
            assert r.json()["name"] == name and r.json()["values"] == [[owner] * 2] * 2
            if i != owner:
                assert r.headers["x-paramshard-owner"] == f"{owner}/3"
            r = http.get(f"{url}/v1/variables/{name}", params={"format": "npy"}, headers=AUTH)
            assert r.status_code == 200
            np.testing.assert_array_equal(np.load(io.BytesIO(r.content)), np.full((2, 2), owner))


def test_the_owners_refusals_come_back_as_they_are(fleet, names, http):
    found, _ = names
    owner, name = next(iter(found.items()))
    other = fleet.urls[(owner + 1) % 3]
    assert http.get(f"{other}/v1/variables/{name}").status_code == 401  # checked here first
    r = http.get(f"{other}/v1/variables/{name}", params={"format": "bad"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
    missing = name + "-missing"
    url = fleet.urls[(shard_for(missing, 3) + 1) % 3]
    r = http.get(f"{url}/v1/variables/{missing}", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_forwarded_request_is_not_forwarded_again(fleet, names, http):
    found, _ = names
    owner, name = next(iter(found.items()))
    other = fleet.urls[(owner + 1) % 3]
    r = http.get(f"{other}/v1/variables/{name}", headers={**AUTH, "x-paramshard-forwarded": "1/3"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "not_owner"


def test_without_fleet_urls_a_shard_answers_421(fleet_factory, http):
    plain = fleet_factory(2)
    name = next(n for n in (f"p{k}" for k in range(100)) if shard_for(n, 2) == 1)
    r = http.get(f"{plain.urls[0]}/v1/variables/{name}")
    assert r.status_code == 421 and r.json()["error"]["details"]["owners"] == {name: 1}


def test_a_tls_fleet_with_a_private_ca_follows_the_variable(fleet_factory, tmp_path):
    """Shards serving https with a certificate of a private CA, which they trust through
    ``SSL_CERT_FILE``: asked of any shard, a variable is answered by its owner, and the fleet
    view reaches every shard (httpx2's default without the environment would not trust it)."""
    pki = loopback_pki(tmp_path)
    fleet = fleet_factory(
        2, "--tls-cert", pki["cert"], "--tls-key", pki["key"], env={"SSL_CERT_FILE": pki["ca"]}
    )
    fleet.env["PARAMSHARD_FLEET_URLS"] = ",".join(fleet.urls)
    for i in range(2):
        fleet.stop(i)
        fleet.start(i)
    name = f"tls-{uuid.uuid4().hex[:8]}"
    owner = shard_for(name, 2)
    with client_sdk.PSClient(fleet.urls, "w-tls", verify=pki["ca"]) as ps:
        ps.init({name: np.full(3, 7.0, np.float32)})
    other = fleet.urls[1 - owner]
    with httpx2.Client(verify=ssl.create_default_context(cafile=pki["ca"])) as http:
        r = http.get(f"{other}/v1/variables/{name}", params={"values": "true"})
        assert r.status_code == 200, r.text
        assert r.json()["values"] == [7.0] * 3
        assert r.headers["x-paramshard-owner"] == f"{owner}/2"
        shards = http.get(f"{other}/v1/fleet").json()["shards"]
        assert [s.get("up") for s in shards] == [True, True], shards


def test_counters_show_their_value(fleet, names, http):
    _, counter = names
    url = fleet.urls[shard_for(counter, 3)]
    listed = http.get(f"{url}/v1/variables", headers=AUTH).json()["variables"]
    (entry,) = [v for v in listed if v["name"] == counter]
    assert entry["kind"] == "counter" and entry["value"] == 5
    assert http.get(f"{url}/v1/variables/{counter}", headers=AUTH).json()["value"] == 5


def paramshard(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    if token is not None:
        env[wire.ENV_TOKEN] = token
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


def test_paramshard_get_prints_a_variable_and_a_counter(fleet, names):
    found, counter = names
    shards = ",".join(fleet.urls)
    out = paramshard("get", counter, "--shards", shards)
    assert out.returncode == 0, out.stderr
    assert "kind: counter" in out.stdout and "value: 5" in out.stdout
    owner, name = next(iter(found.items()))
    out = paramshard("get", name, "--shards", shards, "--values")
    assert out.returncode == 0, out.stderr
    assert "version: 0" in out.stdout and f"values: [[{owner}.0, {owner}.0]" in out.stdout
    out = paramshard("get", name + "-missing", "--shards", shards)
    assert out.returncode == 1 and "404" in out.stderr
    out = paramshard("get", name, "--shards", shards, token=None)
    assert out.returncode == 1 and "401" in out.stderr


def test_a_worker_says_what_it_waits_for(caplog):
    caplog.set_level(logging.WARNING, logger="client_sdk")
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        with client_sdk.PSClient([url], retry_deadline=5) as ps:
            with pytest.raises(client_sdk.ShardUnavailableError):
                ps.pull(["anything"])
    waiting = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert waiting and url in waiting[0] and wire.ENV_SHARDS in waiting[0]
