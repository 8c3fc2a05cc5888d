"""The etcd client of leadership (server/replication/etcd.py) against a real etcd server.

A module's etcd (the ``etcd`` fixture, tests/helpers/etcd.py) serves every test, each under a
key prefix of its own. Leases, create-if-absent, revision-checked replace and delete, watches;
and what a bad reply becomes (a scripted server on loopback stands in for a broken etcd).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.replication.etcd import EtcdClient, EtcdError, LeaseLost
from tests.helpers.ports import refused_port


def run(coro):
    return asyncio.run(coro)


def prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:8]}"


def test_create_only_if_absent_and_create_revision_grows(etcd):
    key = prefix() + "/k"

    async def go():
        c = EtcdClient([etcd.url])
        try:
            rev, kv = await c.create(key, b"one")
            assert rev > 0 and kv is None
            again, held = await c.create(key, b"two")
            assert again == 0 and held is not None and held.value == b"one"
            assert held.create_revision == rev
            found, at = await c.get(key)
            assert found == held and at >= rev
            assert await c.delete(key, found.mod_revision)
            assert (await c.get(key))[0] is None
            rev2, _ = await c.create(key, b"three")
            assert rev2 > rev  # a new incarnation of the key: a higher create_revision
        finally:
            await c.close()

    run(go())


def test_replace_and_delete_only_if_unchanged(etcd):
    key = prefix() + "/k"

    async def go():
        c = EtcdClient([etcd.url])
        try:
            rev, _ = await c.replace(key, b"a", 0)  # 0: only if absent
            assert rev > 0
            stale, now = await c.replace(key, b"b", 0)
            assert stale == 0 and now is not None and now.value == b"a"
            rev2, _ = await c.replace(key, b"b", now.mod_revision)
            assert rev2 > rev
            assert not await c.delete(key, now.mod_revision)  # changed since
            assert (await c.get(key))[0].value == b"b"
        finally:
            await c.close()

    run(go())


def test_a_lease_holds_its_key_until_revoked_and_is_lost_after(etcd):
    key = prefix() + "/leased"

    async def go():
        c = EtcdClient([etcd.url])
        try:
            lease, ttl = await c.grant(5)
            assert ttl >= 5
            assert await c.keepalive(lease) >= 1
            await c.create(key, b"x", lease)
            held, _ = await c.get(key)
            assert held.lease == lease
            watching = asyncio.ensure_future(c.watch(key, held.mod_revision, 30))
            await asyncio.sleep(0.1)
            assert not watching.done()
            await c.revoke(lease)
            assert await watching  # the delete was seen
            assert (await c.get(key))[0] is None
            with pytest.raises(LeaseLost):
                await c.keepalive(lease)
            await c.revoke(lease)  # revoking twice is not an error
        finally:
            await c.close()

    run(go())


def test_a_watch_without_a_change_ends_after_its_timeout(etcd):
    async def go():
        c = EtcdClient([etcd.url])
        try:
            _, at = await c.get(prefix())
            assert await c.watch(prefix(), at, 0.3) is False
        finally:
            await c.close()

    run(go())


def test_an_unreachable_endpoint_is_skipped_and_none_reachable_is_an_etcd_error(etcd):
    async def go():
        with refused_port() as port:
            dead = f"http://127.0.0.1:{port}"
            c = EtcdClient([dead, etcd.url])
            try:
                assert (await c.get(prefix()))[0] is None
            finally:
                await c.close()
            c = EtcdClient([dead])
            try:
                with pytest.raises(EtcdError, match=r"cannot reach etcd.*--etcd"):
                    await c.get(prefix())
            finally:
                await c.close()

    run(go())


REPLIES = {
    "not json": (200, b"<html>hello</html>"),
    "json list": (200, b"[1, 2]"),
    "error": (500, json.dumps({"error": "boom", "code": 13, "message": "boom"}).encode()),
    "bad int": (200, json.dumps({"header": {"revision": "x"}}).encode()),
    "bad base64": (200, json.dumps({"kvs": [{"key": "!!", "value": "??"}]}).encode()),
    "two kvs": (200, json.dumps({"kvs": [{"key": "YQ=="}, {"key": "Yg=="}]}).encode()),
    "no lease": (200, json.dumps({"ID": "0", "TTL": "0"}).encode()),
}


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_a_bad_reply_is_an_etcd_error_saying_what(case):
    status, body = REPLIES[case]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def go():
        c = EtcdClient([f"http://127.0.0.1:{server.server_address[1]}"])
        try:
            with pytest.raises(EtcdError) as err:
                if case == "no lease":
                    await c.grant(2)
                else:
                    await c.get("/k")
            # it names the etcd it asked, or the request whose reply was wrong
            assert any(s in str(err.value) for s in ("127.0.0.1", "range /k", "lease grant"))
        finally:
            await c.close()

    try:
        run(go())
    finally:
        server.shutdown()
        server.server_close()
