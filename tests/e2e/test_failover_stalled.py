"""Workers with the SDK's default timeouts ride out a primary that is alive but cut off: frozen
with SIGSTOP, its socket still open, so that a request sent to it is taken and never answered.

A replica group elects its primary in a real etcd (lease TTL 2 s); four workers, one per HTTP
layer of the SDK (``PSClient`` over its own pool, ``AsyncPSClient`` over its asyncio pool, each
also over an injected httpx2 transport), push one-hot gradients and increment a counter through
the group (``URL|URL``) with the default ``timeout`` and ``retry_deadline`` (30 s each), and two
more pull (over the two pools), while the primary is frozen past its lease. Every call
returns: a request with no reply for a lease TTL makes the SDK ask the group who leads, abandon
the frozen primary once another replica leads at a higher epoch and send the request there,
same seq (client_sdk/_stalls.py). The history checker (tests/helpers/history.py) then finds
every acknowledged write exactly once on every replica, the old primary back as a backup. Over
http and over https (the SDK's TLS connections; the shards trust the test's CA through
``SSL_CERT_FILE``).
"""

from __future__ import annotations

import signal
import ssl
import threading
import uuid

import httpx2
import numpy as np
import pytest

from client_sdk import AsyncPSClient, PSClient, PSError
from client_sdk.optimizers import SGD
from tests.conftest import OnLoop
from tests.e2e.test_faults import check_replicas, progress, role
from tests.e2e.test_leadership import TTL, one_primary
from tests.helpers.eventually import eventually
from tests.helpers.pki import loopback_pki
from tests.helpers.replicas import start_group
from tests.helpers.writers import PER_WORKER, WORKERS, Writers

#: One worker per HTTP layer of the SDK.
LAYERS = ("pool", "asyncio", "httpx2", "httpx2-asyncio")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, and a certificate for 127.0.0.1 signed by it, as PEM files."""
    return loopback_pki(tmp_path_factory.mktemp("pki"))


def _clients(shards: str, ca: str | None):
    """Worker ``w``'s client: the HTTP layer ``LAYERS[w]``, the SDK's default timeouts."""
    verify: bool | str = ca if ca is not None else True
    tls = ssl.create_default_context(cafile=ca) if ca is not None else True

    def make(w: int, name: str):
        layer = LAYERS[w]
        if layer == "pool":
            return PSClient(shards, worker_id=name, verify=verify)
        if layer == "asyncio":
            return OnLoop(AsyncPSClient(shards, worker_id=name, verify=verify))
        if layer == "httpx2":
            transport = httpx2.HTTPTransport(verify=tls, trust_env=False)
            return PSClient(shards, worker_id=name, transport=transport)
        transport = httpx2.AsyncHTTPTransport(verify=tls, trust_env=False)
        return OnLoop(AsyncPSClient(shards, worker_id=name, transport=transport))

    return make


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_every_call_returns_across_a_frozen_primary_with_default_timeouts(
    tmp_path, etcd, pki, scheme, monkeypatch
):
    extra: tuple[str, ...] = ()
    env = None
    if scheme == "https":
        extra = ("--tls-cert", pki["cert"], "--tls-key", pki["key"])
        # The replicas verify each other, and the test's own probes verify them, with the CA.
        env = {"SSL_CERT_FILE": pki["ca"]}
        monkeypatch.setenv("SSL_CERT_FILE", pki["ca"])
    prefix = f"/test-{uuid.uuid4().hex[:8]}"
    group = start_group(
        tmp_path / "group",
        2,
        *("--etcd", etcd.url, "--etcd-prefix", prefix, "--lease-ttl", str(TTL), *extra),
        env=env,
    )
    try:
        p, _ = one_primary(group)
        assert group.urls[p].startswith(f"{scheme}://")
        shards = "|".join([group.urls[p], group.urls[1 - p]])  # the primary first
        make = _clients(shards, pki["ca"] if scheme == "https" else None)
        chief = make(0, "chief")
        try:
            chief.init({"v": np.zeros(WORKERS * PER_WORKER, np.float32)}, SGD(lr=1.0))
            chief.increment("counter", 0)
        finally:
            chief.close()
        writers = Writers(shards, n=len(LAYERS), timeout=None, client=make).start()
        readers = Readers(make)
        try:
            progress(writers)
            group.send(p, signal.SIGSTOP)
            try:
                eventually(
                    lambda: role(group.urls[1 - p]) == "primary", "the backup taking over", 30
                )
                # Each worker's call to the frozen primary returns, answered by the new one,
                # and the worker goes on writing there.
                now, read = _acked_by_worker(writers), list(readers.pulls)
                eventually(
                    lambda: (
                        all(a >= b + 2 for a, b in zip(_acked_by_worker(writers), now))
                        and all(a >= b + 2 for a, b in zip(readers.pulls, read))
                    ),
                    "every worker's writes acknowledged and pulls answered by the new primary",
                    timeout=60,
                )
            finally:
                group.send(p, signal.SIGCONT)
            progress(writers)
        finally:
            writers.stop()
            readers.stop()
        assert writers.errors == [] and readers.errors == []  # every call returned
        eventually(lambda: role(group.urls[p]) == "backup", "the old primary a backup", 30)
        assert check_replicas(group, writers.history) == 1 - p
    finally:
        group.close()


class Readers:
    """Two workers pulling ``counter`` without pause (one over the SDK's own pool, one over
    its asyncio pool), counting the pulls answered; a pull that raises is an error."""

    def __init__(self, make) -> None:
        self.pulls = [0, 0]
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read, args=(k, make)) for k in (0, 1)]
        for t in self._threads:
            t.start()

    def _read(self, k: int, make) -> None:
        ps = make(k, f"reader-{k}")
        try:
            while not self._stop.is_set():
                try:
                    ps.pull(["counter"])
                    self.pulls[k] += 1
                except PSError as exc:
                    self.errors.append(f"reader-{k}: {type(exc).__name__}: {exc}"[:300])
        finally:
            ps.close()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _acked_by_worker(writers: Writers) -> list[int]:
    acked = list(writers.history.acked_writes)
    return [sum(1 for a in acked if a[0] == f"writer-{w}") for w in range(len(LAYERS))]
