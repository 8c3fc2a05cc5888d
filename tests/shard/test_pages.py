"""The shard's pages and the fleet view over HTTP, without a browser (tests/e2e/test_dashboard.py
drives them in one): ``/`` and ``/docs`` are self-contained (every script and style they load is
the shard's own), ``/docs/assets/`` serves swagger-ui's files and nothing else, and
``GET /v1/fleet`` probes the shards of ``--fleet-urls``: up, down, or not the shard the list
says; bad ``--fleet-urls`` are refused at start.
"""

from __future__ import annotations

import re

import httpx2
import pytest

from server.config import InvalidSetting, ShardConfig
from tests.helpers.eventually import eventually

_SRC = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


def test_pages_load_nothing_from_elsewhere(fleet_factory) -> None:
    url = fleet_factory(1).urls[0]
    with httpx2.Client(timeout=10) as http:
        for page in ("/", "/docs"):
            r = http.get(url + page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            for ref in _SRC.findall(r.text):
                assert ref.startswith("/"), (page, ref)
                assert http.get(url + ref).status_code == 200, (page, ref)
        js = http.get(url + "/docs/assets/swagger-ui-bundle.js")
        assert js.headers["content-type"].startswith("text/javascript")
        assert len(js.content) > 100_000
        for bad in ("nope.js", "..%2F..%2Fpyproject.toml", "__init__.py", "redoc.standalone.js"):
            r = http.get(f"{url}/docs/assets/{bad}")
            assert r.status_code == 404, bad
            assert r.json()["error"]["code"] == "not_found"
        assert http.get(url + "/redoc").status_code == 404  # it would load from a CDN
        assert http.get(url + "/healthz").status_code == 200


def test_fleet_view_without_fleet_urls_knows_only_itself(fleet_factory) -> None:
    fleet = fleet_factory(2)
    body = httpx2.get(fleet.urls[1] + "/v1/fleet", timeout=10).json()
    assert body["configured"] is False and body["num_shards"] == 2
    me, other = body["shards"][1], body["shards"][0]
    assert me["self"] and me["up"] and me["index"] == 1
    assert other["up"] is None and "--fleet-urls" in other["error"]


def test_fleet_view_probes_every_shard(fleet_factory) -> None:
    fleet = fleet_factory(3)
    urls = list(fleet.urls)
    # Shard 2 is listed where shard 1 is and the other way round; then shard 2 stops.
    listed = [urls[0], urls[2], urls[1]]
    fleet.extra_args = (*fleet.extra_args, "--fleet-urls", ",".join(listed))
    fleet.stop(0)
    fleet.start(0)
    view = httpx2.get(urls[0] + "/v1/fleet", timeout=10).json()
    assert view["configured"] is True
    assert [s["url"] for s in view["shards"]] == listed
    assert view["shards"][0]["self"] and view["shards"][0]["ready"]
    for s in view["shards"][1:]:
        assert s["up"] is True and s["ready"] is False and "that URL is shard" in s["error"]
    fleet.stop(2)

    def down() -> bool:
        body = httpx2.get(urls[0] + "/v1/fleet", timeout=10).json()
        return body["shards"][1]["up"] is False

    eventually(down, "shard 2 (listed second) seen down")


@pytest.mark.parametrize(
    "urls",
    [
        "http://a:1",  # one URL for two shards
        "http://a:1,http://b:1,http://c:1",
        "http://a:1,ftp://b:1",
        "http://a:1,http://b 1",
        " , ",
        "http://a:1|ftp://b:1,http://c:1",  # a replica group with a bad replica
        "http://a:1|,http://c:1",
    ],
)
def test_bad_fleet_urls_are_refused_naming_the_setting(urls: str) -> None:
    with pytest.raises(InvalidSetting, match=r"--fleet-urls|PARAMSHARD_FLEET_URLS"):
        ShardConfig.from_sources({"num_shards": "2", "fleet_urls": urls})
    assert ShardConfig.from_sources(
        {"num_shards": "2", "fleet_urls": "http://a:1, https://b.example/ps"}
    ).fleet_urls == ("http://a:1", "https://b.example/ps")
    assert ShardConfig.from_sources(
        {"num_shards": "2", "fleet_urls": "http://a:1/ | http://b:1,http://c:1"}
    ).fleet_urls == ("http://a:1|http://b:1", "http://c:1")
