"""Errors for people: a data-plane request that asks for JSON (a JSON body, or an ``Accept``
naming JSON only) gets its error as JSON, with the code, message and details the msgpack form
has (docs/PROTOCOL.md §2 Errors); the SDK's ``Accept`` keeps msgpack. On a real shard."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from client_sdk import wire

MISSING = {"names": ["nothing-" + uuid.uuid4().hex[:8]]}


def error_of(r) -> dict:
    ctype = r.headers["content-type"]
    if ctype.startswith(wire.JSON):
        return json.loads(r.content)["error"]
    assert ctype.startswith(wire.MSGPACK), ctype
    return wire.unpack(bytearray(r.content), ctype)["error"]


def pull(http, url: str, headers: dict[str, str]):
    enc = wire.encode(MISSING)
    return http.post(
        f"{url}/v1/pull", content=enc.join(), headers={"content-type": enc.content_type, **headers}
    )


@pytest.mark.parametrize(
    "accept",
    ["application/json", "application/json, */*;q=0.1", "text/html, application/json"],
)
def test_an_accept_naming_json_gets_the_error_as_json(fleet1, http, accept):
    url = fleet1.urls[0]
    packed = pull(http, url, {})
    as_json = pull(http, url, {"accept": accept})
    assert packed.status_code == as_json.status_code == 404
    assert packed.headers["content-type"].startswith(wire.MSGPACK)
    assert as_json.headers["content-type"].startswith(wire.JSON)
    assert error_of(as_json) == error_of(packed)


@pytest.mark.parametrize(
    "accept",
    [
        "*/*",
        wire.MSGPACK,
        f"{wire.FRAME}, {wire.MSGPACK}",
        f"application/json, {wire.MSGPACK}",
    ],
)
def test_an_accept_that_takes_msgpack_keeps_msgpack(fleet1, http, accept):
    r = pull(http, fleet1.urls[0], {"accept": accept})
    assert r.status_code == 404 and r.headers["content-type"].startswith(wire.MSGPACK)


def test_a_json_body_gets_its_refusal_as_json(fleet1, http):
    url = fleet1.urls[0]
    body = json.dumps({"names": ["w"]}).encode()
    as_json = http.post(f"{url}/v1/pull", content=body, headers={"content-type": wire.JSON})
    assert as_json.status_code == 415
    assert as_json.headers["content-type"].startswith(wire.JSON)
    err = error_of(as_json)
    assert err["code"] == "unsupported_media_type" and "msgpack" in err["message"]
    # the same refusal of the same body, msgpack-encoded for a client that did not ask
    packed = http.post(
        f"{url}/v1/pull",
        content=body,
        headers={"content-type": "application/jsonx"},
    )
    assert packed.status_code == 415 and packed.headers["content-type"].startswith(wire.MSGPACK)


def test_a_refused_write_in_json_changed_nothing(fleet1, http):
    url = fleet1.urls[0]
    name = "j-" + uuid.uuid4().hex[:8]
    enc = wire.encode({"variables": {name: {"value": np.zeros(2, np.float32)}}})
    http.post(f"{url}/v1/init", content=enc.join(), headers={"content-type": enc.content_type})
    bad = wire.encode({"worker_id": "w", "seq": 0, "grads": {name: np.ones(3, np.float32)}})
    r = http.post(
        f"{url}/v1/push",
        content=bad.join(),
        headers={"content-type": bad.content_type, "accept": "application/json"},
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_tensor"
    assert http.get(f"{url}/v1/variables/{name}").json()["version"] == 0
