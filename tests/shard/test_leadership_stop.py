"""Stopping a replica's campaign (server/replication/leadership.py ``Leadership.stop``) against a
real etcd server (the ``etcd`` fixture), in this process.

What it guards: ``docker compose stop`` stops every replica of a group at once; the primary
gives its key back, and a backup whose own shutdown has begun must not take the lead and keep
it, its shutdown waiting on a campaign that never ends. A cancellation can be lost on its way
(a library turning it into its own timeout as that timeout fires: seen with the lowest
versions' HTTP stack); that is the one part stood in for here, by a survey of the other
replicas that swallows the first cancellation it gets.
"""

from __future__ import annotations

import asyncio
import uuid

from server.replication import PRIMARY, Role
from server.replication.etcd import EtcdClient
from server.replication.leadership import Leadership

URL = "http://replica-a:7100"
OTHER = "http://replica-b:7100"


def test_a_stop_during_the_campaign_ends_it_even_if_a_cancellation_is_lost(etcd):
    prefix = f"/test-{uuid.uuid4().hex[:8]}"

    async def go() -> None:
        role = Role(URL, replicated=True)
        leadership = Leadership(
            role, EtcdClient([etcd.url]), prefix=prefix, index=0, url=URL, group=[URL, OTHER]
        )
        surveying = asyncio.Event()

        async def survey(urls: list[str]) -> dict:
            surveying.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # lost: as if the request's own timeout had fired instead
            return {}

        leadership._survey = survey  # type: ignore[method-assign]
        leadership.start()
        await asyncio.wait_for(surveying.wait(), 10)
        stopping = asyncio.ensure_future(leadership.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)  # not wait_for: no cancel of it
        if not done:  # it led on, keeping its lease alive: end it only to fail
            leadership._stopping = True
            await asyncio.wait({stopping}, timeout=10)
        assert done, "stop() never returned: the campaign took the lead and kept it"
        assert role.kind != PRIMARY
        probe = EtcdClient([etcd.url])
        try:
            held, _ = await probe.get(f"{prefix}/shard/0/primary")
        finally:
            await probe.close()
        assert held is None  # the key is given back, not kept alive

    asyncio.run(go())
