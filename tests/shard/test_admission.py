"""The admission gate of a shard's app, phase by phase, in this process.

A real shard restores in well under a second, too fast to catch it restoring; here the real app
(``create_app``) is driven through ``httpx2.ASGITransport`` without running its lifespan, so it
stays in whatever phase the test puts its gate in.
"""

from __future__ import annotations

import asyncio

import httpx2
import numpy as np

from client_sdk import wire
from server.app import create_app
from server.config import ShardConfig
from tests.helpers.eventually import eventually_async


async def post(client: httpx2.AsyncClient, verb: str, msg: dict) -> httpx2.Response:
    enc = wire.encode(msg)
    return await client.post(
        f"/v1/{verb}", content=enc.join(), headers={"content-type": enc.content_type}
    )


def error(r: httpx2.Response) -> dict:
    return wire.unpack(bytearray(r.content), r.headers["content-type"])["error"]


def test_restoring_and_draining_shards_are_live_but_not_ready(tmp_path):
    app = create_app(ShardConfig(data_dir=str(tmp_path)))
    gate = app.state.gate

    async def main() -> None:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://shard") as c:
            assert gate.phase == "restoring"  # the lifespan (restore) has not run
            assert (await c.get("/healthz")).status_code == 200
            r = await c.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "restoring"
            r = await post(c, "pull", {"names": ["w"]})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert (
                error(r)["code"] == "unavailable" and error(r)["details"]["reason"] == "restoring"
            )
            assert "x-paramshard-state-version" not in r.headers  # not known yet
            assert (await c.get("/v1/cluster")).status_code == 200  # inspection answers

            gate.set_phase("ready")
            assert (await c.get("/readyz")).json() == {"status": "ready", "paused_for": None}
            r = await post(c, "init", {"variables": {"w": {"value": np.zeros(2)}}})
            assert r.status_code == 200 and r.headers["x-paramshard-state-version"] == "0"

            gate.set_phase("draining", "shutting down")
            assert (await c.get("/readyz")).status_code == 503
            r = await post(c, "push", {"worker_id": "w", "seq": 1, "grads": {"w": np.ones(2)}})
            assert r.status_code == 503 and error(r)["details"]["reason"] == "draining"
            assert (await c.get("/healthz")).status_code == 200

            gate.set_phase("failed", "bad data dir")
            r = await c.get("/readyz")
            assert r.status_code == 503 and r.json()["error"] == "bad data dir"

    asyncio.run(main())


def test_requests_waiting_for_room_are_served_in_turn_or_refused(tmp_path):
    app = create_app(ShardConfig(max_queued_requests=1))
    gate = app.state.gate
    gate.set_phase("ready")

    async def main() -> None:
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://shard"
        ) as c:
            await post(c, "init", {"variables": {"w": {"value": np.zeros(2)}}})
            assert await gate.admit(0)  # one request in flight: the limit
            waiting = asyncio.ensure_future(post(c, "pull", {"names": ["w"]}))
            await eventually_async(lambda: gate.stats()["waiting"], "the pull waits for room")
            assert gate.stats()["waiting"] == 1 and not waiting.done()
            gate.release(0)  # room: the waiting pull goes in
            assert (await waiting).status_code == 200
            assert await gate.admit(0)
            r = await post(c, "pull", {"names": ["w"]})  # waits ADMIT_WAIT, then 429
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert error(r)["code"] == "overloaded"
            gate.release(0)
            assert gate.stats()["requests_in_flight"] == 0 and gate.stats()["waiting"] == 0

    asyncio.run(main())
