"""Structured logs (``--log-format json``, server/logs.py) on a real shard process: every line
of its log is one JSON object carrying the shard, and each notable event (start, restore,
worker first seen, refused request, auth failure, checkpoint, snapshot) is one line with its
fields; no access log by default; ``text`` stays plain text."""

from __future__ import annotations

import json
import uuid

import numpy as np

import client_sdk
from client_sdk import wire
from tests.helpers.eventually import eventually

TOKEN = "logs-token-" + "e5" * 16


def lines(fleet) -> list[str]:
    return (fleet.workdir / "shard0.log").read_text().splitlines()


def events(fleet) -> list[dict]:
    parsed = []
    for line in lines(fleet):
        record = json.loads(line)  # every line parses
        assert record["shard"] == "0/1", record
        assert {"time", "level", "logger", "message"} <= record.keys()
        parsed.append(record)
    return parsed


def find(fleet, event: str, **fields) -> list[dict]:
    return [
        e
        for e in events(fleet)
        if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
    ]


def test_json_logs_carry_every_notable_event(fleet_factory, http):
    fleet = fleet_factory(1, "--log-format", "json", data=True, env={"PARAMSHARD_TOKEN": TOKEN})
    url = fleet.urls[0]
    assert find(fleet, "start", outcome="serving")
    eventually(lambda: find(fleet, "restore", outcome="empty"), "the restore line")
    worker = "w-" + uuid.uuid4().hex[:8]
    name = "v-" + uuid.uuid4().hex[:8]
    with client_sdk.PSClient([url], worker, token=TOKEN) as ps:
        ps.init({name: np.zeros(3, np.float32)}, optimizer=client_sdk.optimizers.Add())
        ps.push({name: np.ones(3, np.float32)})
        ps.flush()
        ps.checkpoint()
    first = eventually(lambda: find(fleet, "worker_first_seen", worker=worker), "first seen")
    assert len(first) == 1 and first[0]["seq"] >= 0
    assert find(fleet, "checkpoint", outcome="paused")
    assert find(fleet, "checkpoint", outcome="resumed")
    written = find(fleet, "snapshot", outcome="written")
    assert written and written[-1]["checkpoint"] and written[-1]["variables"] >= 1

    http.get(url + "/v1/variables")  # no token
    refused = eventually(lambda: find(fleet, "auth_refused", outcome="missing"), "auth line")
    assert refused[0]["path"] == "/v1/variables" and TOKEN not in json.dumps(refused)
    missing = "m-" + uuid.uuid4().hex[:8]
    enc = wire.encode({"names": [missing]})
    r = http.post(
        url + "/v1/pull",
        content=enc.join(),
        headers={"content-type": enc.content_type, "authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 404
    eventually(lambda: find(fleet, "refused", code="not_found", status=404), "refused line")

    # no access log: no line per request
    assert not [e for e in events(fleet) if "POST /v1/push" in e["message"]]

    fleet.stop(0)
    fleet.start(0)
    restored = eventually(lambda: find(fleet, "restore", outcome="restored"), "restored")
    assert restored[-1]["variables"] >= 1 and restored[-1]["snapshot"]


def test_text_logs_are_plain_lines(fleet_factory):
    fleet = fleet_factory(1)
    with client_sdk.PSClient(fleet.urls[0], "w-text") as ps:
        ps.init({"t": np.zeros(1, np.float32)})
        ps.push({"t": np.ones(1, np.float32)})
        ps.flush()
    eventually(
        lambda: any("worker w-text first seen" in line for line in lines(fleet)), "first seen"
    )
    assert not any(line.startswith("{") for line in lines(fleet))
