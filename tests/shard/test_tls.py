"""TLS on real shard processes (``--tls-cert``/``--tls-key``) with a CA made in the test
(trustme): the SDK's own connection pools speak https (sync, the fan-out, asyncio), verify the
shard's certificate against ``verify=CA_FILE`` and refuse one they cannot verify at once, saying
what to pass; big bodies still reach the shard's buffers on both ways of serving; plaintext on
the TLS port and a bad certificate setting leave the shard healthy or refuse to start."""

from __future__ import annotations

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
from client_sdk._cache import Lent
from client_sdk._http.native import AsyncNativeSender, NativeSender
from tests.conftest import HTTP_MODES, ROOT, OnLoop
from tests.helpers.pki import loopback_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, and a certificate for the loopback names signed by it, as PEM files."""
    return loopback_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module", params=HTTP_MODES)
def fleet(request, module_fleet_factory, pki):
    env = {"PARAMSHARD_HTTP": "stock" if request.param == "stock" else "auto"}
    return module_fleet_factory(2, "--tls-cert", pki["cert"], "--tls-key", pki["key"], env=env)


def test_the_sdk_speaks_https_through_its_own_pools(fleet, pki):
    assert all(u.startswith("https://") for u in fleet.urls)
    names = [f"t-{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
    big = np.arange(300_000, dtype=np.float32)  # 1.2 MB: read straight into the shard's buffer
    with client_sdk.PSClient(fleet.urls, verify=pki["ca"]) as ps:
        assert isinstance(ps._sender, NativeSender)
        ps.init({n: np.zeros_like(big) for n in names}, optimizer=client_sdk.optimizers.Add())
        for _ in range(3):
            ps.push({n: big for n in names})
        ps.flush()
        bufs = {n: np.zeros_like(big) for n in names}  # received into them over TLS too
        pulled = ps.pull(names, out=bufs)  # both shards at once: the fan-out
        for n in names:
            assert pulled[n] is bufs[n]
            np.testing.assert_array_equal(bufs[n], big * 3)
            assert type(ps._core.cache.entries[n][2]) is Lent  # received, not copied, into it
        pulled = ps.pull(names)
        for n in names:
            np.testing.assert_array_equal(pulled[n], big * 3)
        assert ps.increment(f"{names[0]}/step", 2) == 2


def test_the_asyncio_client_speaks_https_too(fleet, pki):
    name = f"a-{uuid.uuid4().hex[:8]}"
    ps = OnLoop(client_sdk.AsyncPSClient(fleet.urls, verify=pki["ca"]))
    try:
        assert isinstance(ps.client._sender, AsyncNativeSender)
        ps.init({name: np.zeros(100_000, np.float32)}, optimizer=client_sdk.optimizers.Add())
        ps.push({name: np.ones(100_000, np.float32)})
        ps.flush()
        np.testing.assert_array_equal(ps.pull([name])[name], np.ones(100_000))
    finally:
        ps.close()


def test_a_certificate_the_client_cannot_verify_is_refused_at_once(fleet):
    with client_sdk.PSClient(fleet.urls, retry_deadline=60) as ps:  # the system's CAs
        with pytest.raises(client_sdk.ConfigError) as refused:
            ps.pull(["anything"])
    assert "verify=" in str(refused.value) and refused.value.shard in fleet.urls
    ps = OnLoop(client_sdk.AsyncPSClient(fleet.urls, retry_deadline=60))
    try:
        with pytest.raises(client_sdk.ConfigError):
            ps.pull(["anything"])
    finally:
        ps.close()


def test_verify_false_skips_the_check(fleet):
    with client_sdk.PSClient(fleet.urls, verify=False) as ps:
        assert isinstance(ps.variables(), list)


def test_a_bad_verify_setting_is_a_config_error(tmp_path):
    with pytest.raises(client_sdk.ConfigError, match="CA bundle"):
        client_sdk.PSClient(["https://127.0.0.1:1"], verify=str(tmp_path / "missing.pem"))
    with pytest.raises(client_sdk.ConfigError, match="verify must be"):
        client_sdk.PSClient(["https://127.0.0.1:1"], verify=3)  # type: ignore[arg-type]


def test_plaintext_on_the_tls_port_leaves_the_shard_healthy(fleet, pki):
    plain = fleet.urls[0].replace("https://", "http://")
    with httpx2.Client(timeout=5, trust_env=False) as raw:
        with pytest.raises(httpx2.HTTPError):
            raw.get(plain + "/healthz")
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with httpx2.Client(timeout=5, trust_env=False, verify=ctx) as tls:
        assert tls.get(fleet.urls[0] + "/healthz").status_code == 200
        r = tls.get(fleet.urls[0] + "/v1/cluster")
        assert r.status_code == 200 and r.json()["shard_index"] == 0


def test_tokens_over_tls(fleet_factory, pki):
    token = "tls-token-" + "ab" * 16
    fleet = fleet_factory(
        1, "--tls-cert", pki["cert"], "--tls-key", pki["key"], env={wire.ENV_TOKEN: token}
    )
    with client_sdk.PSClient(fleet.urls, verify=pki["ca"], token=token) as ps:
        ps.init({"x": np.zeros(2, np.float32)})
    with client_sdk.PSClient(fleet.urls, verify=pki["ca"], token="w" * 20) as ps:
        with pytest.raises(client_sdk.AuthError):
            ps.pull(["x"])


@pytest.mark.parametrize(
    "args, says",
    [
        (["--tls-cert", "CERT"], "--tls-key"),
        (["--tls-key", "KEY"], "--tls-cert"),
        (["--tls-cert", "KEY", "--tls-key", "KEY"], "cannot load the certificate"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", "KEY"], "no such file"),
    ],
)
def test_a_bad_tls_setting_stops_the_shard_at_start(pki, args, says):
    args = [pki["cert"] if a == "CERT" else pki["key"] if a == "KEY" else a for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
