"""``GET /v1/variables`` of a shard holding many variables (docs/PROTOCOL.md §4): the listing
comes in pieces with the shard's event loop free between them, so the data plane is answered
while it is being made, and it is still every variable, sorted, in one JSON document.

Over real HTTP to a shard process of this module's own. A client that reads only the start of
the listing holds the shard's sending back (the socket's buffers fill up); a push sent then is
applied before the listing reaches its variable, which a listing made in one go would show at
its old version.
"""

from __future__ import annotations

import json

import httpx2
import numpy as np

from client_sdk import PSClient
from client_sdk.placement import MAX_NAME_LENGTH
from tests.helpers.names import fresh

#: Enough variables, with long names, that their listing (~10 MB) outgrows the sockets' buffers.
COUNT = 20_000


def test_the_data_plane_is_answered_while_a_long_listing_is_made(fleet_factory):
    (url,) = fleet_factory(1).urls
    prefix = fresh("listed")
    pad = "x" * (MAX_NAME_LENGTH - len(prefix) - 12)
    names = [f"{prefix}/{pad}/{i:06d}" for i in range(COUNT)]
    last = f"{prefix}/zz"  # sorted after all of them
    one = np.zeros(1, dtype=np.float32)
    with PSClient([url], worker_id=fresh("lister")) as ps:
        ps.init({last: one})
        ps.init({name: one for name in names})
        with httpx2.Client(timeout=60) as http, http.stream("GET", f"{url}/v1/variables") as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            chunks = r.iter_raw()
            body = bytearray(next(chunks))
            assert ps.push({last: np.ones(1, np.float32)})[last]["status"] == "applied"
            for chunk in chunks:
                body += chunk
    listed = json.loads(body)["variables"]
    assert [v["name"] for v in listed] == sorted([*names, last])
    assert listed[-1]["name"] == last and listed[-1]["version"] == 1
