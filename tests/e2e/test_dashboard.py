"""The shard's pages in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium) against shard processes, with every address but the
loopback's sent to a proxy that is not there, so a page that fetched anything from elsewhere
would fail to draw.

* the dashboard at ``/`` shows a variable's version going up while a worker pushes, the
  worker, and the fleet (both shards up; then one of them down once it is stopped); the test
  saves a screenshot (``PARAMSHARD_UPDATE_SCREENSHOT=1`` writes it to docs/dashboard.png,
  which the README shows);
* ``/docs`` renders the shard's routes from its own copy of swagger-ui.

``make test`` installs Chromium (apt-get, as root) when it is missing; elsewhere this module
fails saying what to install (it skips, saying so, outside CI when it cannot run).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from client_sdk import PSClient
from client_sdk.placement import shard_for
from tests.conftest import ROOT
from tests.helpers.eventually import eventually

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
)
MISSING = [
    what
    for what, found in (
        ("chromium (apt-get install chromium)", CHROMIUM),
        ("chromedriver (apt-get install chromium-driver)", CHROMEDRIVER),
    )
    if not found
]
try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
except ImportError:  # pragma: no cover - the test extra has it
    MISSING.append("selenium (pip install -e '.[test]')")

if MISSING:
    _why = "the browser tests need " + ", ".join(MISSING) + " (make test installs them as root)"
    if os.environ.get("CI"):
        pytest.fail(_why, pytrace=False)
    pytest.skip(_why, allow_module_level=True)

SCREENSHOT = ROOT / "docs" / "dashboard.png"


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in CI and containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        # Nothing but the loopback is reachable: every other address goes to a dead proxy.
        "--proxy-server=http://127.0.0.1:9",
        "--proxy-bypass-list=127.0.0.1;localhost",
    ):
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def text(driver, css: str) -> str | None:
    """The text of the first element ``css`` selects, or None (read in one script: the page
    redraws its tables every second)."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null", css
    )


def row_of(name: str) -> str:
    return f"#variables tr[data-name='{name}']"


def resources_from_elsewhere(driver, origin: str) -> list[str]:
    names = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    return [n for n in names if not n.startswith(origin)]


def test_dashboard_shows_versions_going_up_workers_and_the_fleet(
    fleet_factory, browser, tmp_path
) -> None:
    fleet = fleet_factory(2)
    urls = list(fleet.urls)
    fleet.extra_args = (*fleet.extra_args, "--fleet-urls", ",".join(urls))
    for i in range(2):  # again, knowing the fleet (each on the port it bound first)
        fleet.stop(i)
        fleet.start(i)
    # A small model on two shards; the variable the test follows is on shard 0.
    name = next(n for n in (f"layer{k}/kernel" for k in range(1, 99)) if shard_for(n, 2) == 0)
    model = {
        name: np.zeros((64, 32), np.float32),
        "layer1/bias": np.zeros(32, np.float32),
        "embedding": np.zeros((1000, 16), np.float32),
        "head/kernel": np.zeros((32, 10), np.float32),
    }
    # and one with bounded staleness there too, whose staleness the page shows
    bounded = next(n for n in (f"head{k}/bias" for k in range(99)) if shard_for(n, 2) == 0)
    stop = threading.Event()
    pushed = []

    def worker(k: int) -> None:
        with PSClient(shards=urls, worker_id=f"worker-{k}") as ps:
            ps.init(model)
            ps.init({bounded: np.zeros(10, np.float32)}, max_staleness=8)
            step = 0
            while not stop.is_set():
                if step % 3 == 0:  # pull now and then: the pushes between measure staleness
                    ps.pull([*model, bounded])
                ps.push({n: np.full(v.shape, 1e-3, np.float32) for n, v in model.items()})
                ps.push({bounded: np.full(10, 1e-3, np.float32)})
                pushed.append(k)
                step += 1
                stop.wait(0.02)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(2)]
    for thread in threads:
        thread.start()
    try:
        browser.get(urls[0] + "/")
        row = row_of(name)
        first = int(eventually(lambda: text(browser, row + " td.version"), f"{name} shown"))
        eventually(
            lambda: int(text(browser, row + " td.version") or 0) > first,
            f"the version of {name} shown going up from {first}",
        )
        eventually(
            lambda: re.match(r"\d+ / \d+", text(browser, f"{row_of(bounded)} td.staleness") or ""),
            f"the staleness of {bounded} shown",
        )
        assert text(browser, "#workers tr[data-worker='worker-0']")
        assert text(browser, "#workers tr[data-worker='worker-1']")
        eventually(
            lambda: text(browser, "#fleet tr[data-index='1'] td.state") == "up",
            "shard 1 shown up",
        )
        assert text(browser, "#fleet tr[data-index='0'] td.state") == "up"
        assert text(browser, "#shard") == "shard 0/2"
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        if os.environ.get("PARAMSHARD_UPDATE_SCREENSHOT"):
            shutil.copyfile(tmp_path / "dashboard.png", SCREENSHOT)
        assert resources_from_elsewhere(browser, urls[0]) == []
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert set(pushed) == {0, 1}
    fleet.stop(1)
    eventually(
        lambda: text(browser, "#fleet tr[data-index='1'] td.state") == "down",
        "shard 1 shown down once stopped",
    )


def test_docs_render_the_routes_with_no_network(fleet_factory, browser) -> None:
    url = fleet_factory(1).urls[0]
    browser.get(url + "/docs")
    eventually(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, ".opblock")) >= 10,
        "the OpenAPI page listing the routes",
    )
    paths = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/v1/push", "/v1/pull", "/v1/cluster", "/metrics"} <= paths, paths
    assert resources_from_elsewhere(browser, url) == []


def test_dashboard_asks_for_a_token_and_uses_the_one_in_its_address(fleet_factory, browser):
    token = "t" * 40
    url = fleet_factory(1, "--token", token).urls[0]
    browser.get(url + "/")
    eventually(
        lambda: text(browser, "#status") == "this shard needs a token", "the page asking for one"
    )
    assert browser.find_element(By.ID, "auth").is_displayed()
    browser.get(f"{url}/#token={token}")
    eventually(lambda: (text(browser, "#status") or "").startswith("live"), "the page live")
    assert text(browser, "#shard") == "shard 0/1"
    assert "token" not in browser.current_url  # taken out of the address once read
