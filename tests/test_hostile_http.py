"""The shard against hostile HTTP: header values it parses, huge and unfinished heads, bodies
that stall, long-poll bodies, and the memory a burst of big pushes leaves behind.

Shards are real processes (tests/conftest.py); the hostile side is raw sockets or raw httpx2
calls, so these tests pin what the shard does at its edge (docs/PROTOCOL.md, "Limits"), not
what the SDK sends. Nothing here asserts a timing: a deadline is checked by its effect (the
connection is closed, the next request is answered), with bounds many times the deadline.
"""

from __future__ import annotations

import json

import httpx2
import msgpack
import pytest

from client_sdk import wire

# -- helpers --------------------------------------------------------------------------------


def error_of(r: httpx2.Response, family: str) -> dict:
    """The error of a refusal, checking it is in ``family`` (``msgpack`` or ``json``)."""
    ctype = r.headers.get("content-type", "")
    if family == "msgpack":
        assert ctype.startswith(wire.MSGPACK), (r.status_code, ctype, r.content[:200])
        return msgpack.unpackb(r.content)["error"]
    assert ctype.startswith(wire.JSON), (r.status_code, ctype, r.content[:200])
    return json.loads(r.content)["error"]


# -- header values the shard parses (item 11) -----------------------------------------------

ROUTES = [("GET", "/healthz", "json"), ("GET", "/readyz", "json"),
          ("GET", "/v1/cluster", "json"), ("GET", "/v1/variables", "json"),
          ("GET", "/v1/variables/x", "json"), ("GET", "/v1/workers", "json"),
          ("GET", "/metrics", "json"), ("GET", "/", "json"), ("GET", "/nowhere", "json"),
          ("POST", "/v1/pull", "msgpack"), ("POST", "/v1/push", "msgpack"),
          ("POST", "/v1/init", "msgpack"), ("POST", "/v1/wait", "msgpack"),
          ("POST", "/v1/increment", "msgpack"), ("POST", "/v1/pause", "msgpack"),
          ("POST", "/v1/nowhere", "msgpack")]


@pytest.mark.parametrize("value", ["1" * 5000 + "/2", "0/" + "9" * 5000, "0/" + "1" * 10,
                                   "\u00b2/2", "0/\u00b9"])
def test_a_fleet_header_of_any_length_or_digits_is_a_400_on_every_route(fleet2, value):
    """A fleet header whose numbers are too long for Python's ``int`` (4,300 digits), or
    digits that ``int`` does not take (superscripts pass ``str.isdigit``), is 400
    ``bad_request`` in the route's family, never a plain-text 500."""
    url = fleet2.urls[0]
    body = msgpack.packb({"names": []})
    with httpx2.Client(timeout=10.0) as http:
        for method, path, family in ROUTES:
            r = http.request(method, url + path, content=body if method == "POST" else None,
                             headers={"x-paramshard-fleet": value.encode("latin-1"),
                                      "content-type": wire.MSGPACK})
            assert r.status_code == 400, (method, path, r.status_code, r.content[:200])
            err = error_of(r, family)
            assert err["code"] == "bad_request" and "x-paramshard-fleet" in err["message"]
            assert len(err["message"]) < 400  # the value is not echoed whole
        r = http.get(url + "/healthz")
        assert r.status_code == 200
