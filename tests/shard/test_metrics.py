"""``GET /metrics``: a real shard process scraped in Prometheus' text format (parsed with
prometheus-client's own parser) after traffic whose counts the test knows: requests by verb
and status on every path a request can take (FastAPI's routes, the direct data-plane routes,
the small pulls the HTTP protocol answers itself), bytes, pushes applied / duplicate / refused,
staleness, variables held, per-worker series bounded by ``--metrics-workers``, snapshot and
restore figures, and label values bounded whatever paths clients ask for.
"""

from __future__ import annotations

import re
import uuid

import httpx2
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client_sdk import PSClient
from tests.shard.test_server_http import init, post

_NAME_RE = re.compile(r"paramshard_[a-z_]+")


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``sample name -> [(labels, value)]`` of one scrape."""
    r = httpx2.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels`` (0 if none)."""
    found = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


def test_requests_writes_and_bytes_are_counted_on_every_path(fleet_factory) -> None:
    fleet = fleet_factory(1)
    url = fleet.urls[0]
    name = "w-" + uuid.uuid4().hex[:8]
    with httpx2.Client(timeout=10) as http:
        init(http, url, name, np.zeros(16, np.float32))
        grad = np.ones(16, np.float32)
        for seq in range(5):  # the direct data-plane route
            rep = post(
                http,
                url,
                "push",
                {"worker_id": "a", "seq": seq, "grads": {name: grad}, "versions": {name: 0}},
            )
            assert rep.status == 200, rep.msg
        rep = post(http, url, "push", {"worker_id": "a", "seq": 4, "grads": {name: grad}})
        assert rep.msg["variables"][name]["status"] == "duplicate"
        bad = post(http, url, "push", {"worker_id": "a", "seq": 9, "grads": {name: grad[:3]}})
        assert bad.status == 422
        for i in range(7):  # paths no route has: one label, however many
            assert http.get(f"{url}/no/such/path/{i}").status_code == 404
        assert http.get(f"{url}/v1/variables/{name}").status_code == 200
    with PSClient(shards=[url], worker_id="b") as ps:
        for _ in range(6):  # small table pulls: answered by the HTTP protocol itself
            ps.pull([name])

    m = scrape(url)
    assert value(m, "paramshard_requests_total", verb="push", status="200") == 6
    assert value(m, "paramshard_requests_total", verb="push", status="422") == 1
    assert value(m, "paramshard_requests_total", verb="init", status="200") == 1
    assert value(m, "paramshard_requests_total", verb="variable", status="200") == 1
    assert value(m, "paramshard_requests_total", verb="other", status="404") == 7
    assert value(m, "paramshard_requests_total", verb="pull", status="200") >= 6
    # Every (verb, status) has one latency histogram counting as many requests.
    for labels, n in m["paramshard_requests_total"]:
        assert value(m, "paramshard_request_duration_seconds_count", **labels) == n
        assert value(m, "paramshard_request_duration_seconds_bucket", le="+Inf", **labels) == n
    assert value(m, "paramshard_pushes_total", outcome="applied") == 5
    assert value(m, "paramshard_pushes_total", outcome="refused") == 1
    assert value(m, "paramshard_writes_total", outcome="applied") == 5
    assert value(m, "paramshard_writes_total", outcome="duplicate") == 1
    assert value(m, "paramshard_push_gradients_total", outcome="applied") == 5
    # Each push said version 0: stalenesses 0, 1, 2, 3, 4.
    assert value(m, "paramshard_push_staleness_versions_count") == 5
    assert value(m, "paramshard_push_staleness_versions_sum") == 10
    assert value(m, "paramshard_push_staleness_versions_bucket", le="0.0") == 1
    assert value(m, "paramshard_push_staleness_versions_bucket", le="2.0") == 3
    assert value(m, "paramshard_received_bytes_total", verb="push") > 7 * grad.nbytes
    assert value(m, "paramshard_sent_bytes_total", verb="pull") > grad.nbytes
    assert value(m, "paramshard_variables") == 1
    assert value(m, "paramshard_variable_bytes") >= grad.nbytes
    assert value(m, "paramshard_worker_writes_total", worker="a", outcome="applied") == 5
    assert value(m, "paramshard_worker_writes_total", worker="a", outcome="duplicate") == 1
    (info,) = m["paramshard_shard_info"]
    assert info[0]["shard"] == "0" and len(info[0]["incarnation"]) == 16
    assert value(m, "paramshard_ready") == 1
    # Names follow Prometheus' conventions: paramshard_*, counters in _total, units spelled.
    for sample in m:
        assert _NAME_RE.fullmatch(sample), sample
    text = httpx2.get(url + "/metrics", timeout=10).text
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        assert kind != "counter" or family.endswith("_total"), family
        assert not family.endswith(("_ms", "_milliseconds", "_kb")), family
    labels = {lab["verb"] for lab, _ in m["paramshard_requests_total"]}
    assert labels <= {"push", "init", "pull", "variable", "other", "cluster", "healthz"}, labels


def test_worker_series_are_bounded_with_the_rest_summed(fleet_factory) -> None:
    fleet = fleet_factory(1, "--metrics-workers", "2")
    url = fleet.urls[0]
    name = "w-" + uuid.uuid4().hex[:8]
    pushes = {"w1": 6, "w2": 5, "w3": 2, "w4": 1}
    with httpx2.Client(timeout=10) as http:
        init(http, url, name, np.zeros(4, np.float32))
        for worker, n in pushes.items():
            for seq in range(n):
                rep = post(
                    http,
                    url,
                    "push",
                    {"worker_id": worker, "seq": seq, "grads": {name: np.ones(4, np.float32)}},
                )
                assert rep.status == 200, rep.msg
    m = scrape(url)
    series = {lab["worker"] for lab, _ in m["paramshard_worker_writes_total"]}
    assert series == {"w1", "w2", "_other"}
    assert value(m, "paramshard_worker_writes_total", worker="w1", outcome="applied") == 6
    assert value(m, "paramshard_worker_writes_total", worker="_other", outcome="applied") == 3
    assert value(m, "paramshard_worker_gradients_total", worker="_other", outcome="applied") == 3
    assert value(m, "paramshard_workers") == 4


def test_snapshot_and_restore_figures(fleet_factory) -> None:
    fleet = fleet_factory(1, data=True)
    url = fleet.urls[0]
    name = "w-" + uuid.uuid4().hex[:8]
    with httpx2.Client(timeout=10) as http:
        init(http, url, name, np.zeros(1000, np.float32))
        assert "paramshard_snapshot_bytes" not in scrape(url)
        rep = post(http, url, "snapshot", {})
        assert rep.status == 200, rep.msg
    m = scrape(url)
    assert value(m, "paramshard_snapshot_bytes") >= 4000
    assert value(m, "paramshard_snapshot_duration_seconds") > 0
    assert 0 <= value(m, "paramshard_snapshot_age_seconds") < 600
    assert value(m, "paramshard_cannot_persist") == 0
    incarnation = m["paramshard_shard_info"][0][0]["incarnation"]
    fleet.stop(0)
    fleet.start(0)
    m = scrape(url)
    assert value(m, "paramshard_restore_duration_seconds") > 0
    assert 0 <= value(m, "paramshard_snapshot_age_seconds") < 600
    assert m["paramshard_shard_info"][0][0]["incarnation"] != incarnation
    assert value(m, "paramshard_variables") == 1


@pytest.mark.parametrize("flag", ["-1", "many", "1001"])
def test_a_bad_metrics_workers_flag_is_refused(flag: str) -> None:
    from server.config import InvalidSetting, ShardConfig

    with pytest.raises(InvalidSetting, match="--metrics-workers"):
        ShardConfig.from_sources({"metrics_workers": flag})


def test_with_a_token_metrics_need_a_read_token_and_the_pages_are_open(fleet_factory) -> None:
    fleet = fleet_factory(1, "--token", "w" * 32, "--read-token", "r" * 32)
    url = fleet.urls[0]
    read = {"authorization": "Bearer " + "r" * 32}
    with httpx2.Client(timeout=10) as http:
        assert http.get(url + "/metrics").status_code == 401
        assert http.get(url + "/v1/fleet").status_code == 401
        for page in ("/", "/docs", "/docs/assets/swagger-ui.css", "/openapi.json"):
            assert http.get(url + page).status_code == 200, page
        assert http.get(url + "/v1/fleet", headers=read).status_code == 200
        r = http.get(url + "/metrics", headers=read)
        assert r.status_code == 200
    m = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            m.setdefault(sample.name, []).append((sample.labels, sample.value))
    assert value(m, "paramshard_auth_refused_total", reason="missing") >= 2
    assert value(m, "paramshard_requests_total", verb="metrics", status="401") >= 1
