"""``GET /v1/variables`` of a shard holding many variables (docs/PROTOCOL.md §4): the listing is
made in pieces with the shard's event loop free between them, so the data plane is answered
while it is being made, and it is still every variable, sorted, in one JSON document.

Over real HTTP to a shard process of this test's own. A worker pushes to the variables listed
first and last, both in each push, all the while the listing is made: a listing made in one go
shows them at one version, one made in pieces shows the last one pushed more often.
"""

from __future__ import annotations

import threading

import httpx2
import numpy as np

from client_sdk import PSClient
from tests.helpers.names import fresh

COUNT = 8_192


def test_the_data_plane_is_answered_while_a_long_listing_is_made(fleet_factory):
    (url,) = fleet_factory(1).urls
    prefix = fresh("listed")
    first, last = f"{prefix}/a", f"{prefix}/z"
    names = [f"{prefix}/m/{i:06d}" for i in range(COUNT)]  # sorted between the two
    one = np.zeros(1, dtype=np.float32)
    stop = threading.Event()
    pushed = []

    def push_all_along() -> None:
        with PSClient([url], worker_id=fresh("pusher")) as ps:
            while not stop.is_set():
                pushed.append(ps.push({first: one, last: one})[last]["version"])

    with PSClient([url], worker_id=fresh("lister")) as ps:
        ps.init({first: one, last: one})
        ps.init({name: one for name in names})
    pusher = threading.Thread(target=push_all_along)
    pusher.start()
    try:
        while not pushed:  # pushing before the listing starts
            stop.wait(0.01)
        listed = httpx2.get(f"{url}/v1/variables", timeout=120).json()["variables"]
    finally:
        stop.set()
        pusher.join(60)
    assert [v["name"] for v in listed] == sorted([first, last, *names])
    assert listed[-1]["version"] > listed[0]["version"] >= 1
