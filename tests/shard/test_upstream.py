"""The shard's use of uvicorn's and FastAPI's private API (server/upstream.py): the check at
start, the stock way of serving when the check fails or ``--http stock`` asks for it, and the
dependency bounds in pyproject.toml that constraints-lowest.txt (``make test-lowest``) mirrors.

The data-plane tests run in both ways of serving through the ``fleet2`` fixtures of
tests/shard/test_server_http.py and tests/sdk/test_client.py and the ``edge_shard`` fixture of
tests/shard/test_hostile_http.py.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from client_sdk import PSClient
from server import upstream
from tests.conftest import ROOT

#: uvicorn's httptools request cycle as it was up to uvicorn 0.41: ``receive()`` hands the
#: pending body on as it is (the shard's fast path keeps it as pieces, not bytes).
OLD_RECEIVE = """
import uvicorn.protocols.http.httptools_impl as impl

async def receive(self):
    if self.waiting_for_100_continue and not self.transport.is_closing():
        self.transport.write(b"HTTP/1.1 100 Continue\\r\\n\\r\\n")
        self.waiting_for_100_continue = False
    if not self.disconnected and not self.response_complete:
        self.flow.resume_reading()
        await self.message_event.wait()
        self.message_event.clear()
    if self.disconnected or self.response_complete:
        return {"type": "http.disconnect"}
    message = {"type": "http.request", "body": self.body, "more_body": self.more_body}
    self.body = b""
    return message

impl.RequestResponseCycle.receive = receive
"""

FALLBACK = "lacks what the shard's fast HTTP path uses"


def test_the_installed_web_stack_offers_what_the_fast_path_uses():
    """In the versions pyproject.toml allows (make test: the newest; make test-lowest: the
    lowest) nothing is missing, so shards serve fast."""
    assert upstream.check() == ([], [])


def test_an_uvicorn_without_what_the_fast_path_uses_is_served_the_stock_way(fleet_factory):
    """A shard on an uvicorn whose request cycle does not turn the body into bytes (as up to
    0.41) logs one warning naming the versions and serves correctly the stock way: init,
    wait_ready, a push of a big gradient and a pull all work."""
    fleet = fleet_factory(1, prelude=OLD_RECEIVE)
    with PSClient(fleet.urls, timeout=10) as client:
        client.init({"w": np.zeros((256, 256), np.float32), "b": np.zeros(3, np.float32)})
        client.wait_ready(["w", "b"], timeout=10)
        client.push({"w": np.ones((256, 256), np.float32), "b": np.ones(3, np.float32)})
        pulled = client.pull(["w", "b"])
    np.testing.assert_array_equal(pulled["w"], np.full((256, 256), -0.01, np.float32))
    np.testing.assert_array_equal(pulled["b"], np.full(3, -0.01, np.float32))
    log = fleet.logs[0].read_text()
    assert log.count(FALLBACK) == 1, log
    warning = next(line for line in log.splitlines() if FALLBACK in line)
    assert "WARNING" in warning and re.search(r"uvicorn \d+\.\d+", warning), warning
    assert "RequestResponseCycle.receive" in warning, warning


def test_http_stock_serves_the_stock_way_without_a_warning(fleet_factory):
    fleet = fleet_factory(1, env={"PARAMSHARD_HTTP": "stock"})
    with PSClient(fleet.urls, timeout=10) as client:
        client.init({"v": np.arange(4, dtype=np.float32)})
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.arange(4, dtype=np.float32))
    log = fleet.logs[0].read_text()
    assert "serving the stock way (--http stock)" in log, log
    assert FALLBACK not in log and "WARNING" not in log, log


def test_a_bad_http_mode_is_refused_at_start():
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--http", "fastest"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "--http" in done.stderr and "auto, stock" in done.stderr, done.stderr


# -- dependency bounds ----------------------------------------------------------------------


def _requirements() -> dict[str, str]:
    """Every dependency pyproject.toml names (runtime and extras, not the peers'), name ->
    specifier, markers dropped."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        if extra != "peers":
            lines += reqs
    out = {}
    for line in lines:
        req = line.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
        if name == "paramshard":
            continue
        out[name] = req[len(name) :].split("]", 1)[-1] if "[" in req else req[len(name) :]
    return out


def _lowest() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints-lowest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


def test_constraints_lowest_pins_every_dependency_to_its_lower_bound():
    """constraints-lowest.txt (make test-lowest) names every dependency of pyproject.toml once,
    at exactly its lower bound."""
    reqs, lowest = _requirements(), _lowest()
    assert set(lowest) == set(reqs), set(lowest) ^ set(reqs)
    for name, spec in reqs.items():
        lower = re.search(r">=\s*([^,\s]+)", spec)
        assert lower, f"{name} has no lower bound in pyproject.toml ({spec!r})"
        assert lowest[name] == lower.group(1), (name, spec, lowest[name])


@pytest.mark.parametrize("name", ["uvicorn", "fastapi", "starlette", "httpx2"])
def test_the_web_stack_is_bounded_above(name):
    """uvicorn, FastAPI and starlette, whose internals the shard uses (server/upstream.py), and
    httpx2, whose network backend the SDK wraps (client_sdk/_http/httpx_deadline.py), are
    bounded below the next minor release after the newest the suite ran on."""
    spec = _requirements()[name]
    assert re.search(r"<\s*\d+\.\d+(,|$)", spec), f"{name} has no upper bound ({spec!r})"


# -- the lists of what the subclasses use -----------------------------------------------------


def _attribute_reads(path, classes: set[str]) -> dict[str, set[str]]:
    """``base -> attribute names`` read or written on ``self``, ``self.cycle``/``cycle`` and
    ``self.flow`` inside the methods of ``classes`` in the module at ``path`` (and under
    ``stored``, those assigned on ``self``)."""
    import ast

    out: dict[str, set[str]] = {"self": set(), "cycle": set(), "flow": set(), "stored": set()}
    tree = ast.parse(path.read_text())
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
            continue
        for node in ast.walk(cls):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id == "self":
                out["self"].add(node.attr)
                if isinstance(node.ctx, ast.Store):
                    out["stored"].add(node.attr)
            elif isinstance(base, ast.Name) and base.id in ("cycle", "previous"):
                out["cycle"].add(node.attr)
            elif (
                isinstance(base, ast.Attribute)
                and isinstance(base.value, ast.Name)
                and base.value.id == "self"
                and base.attr in ("cycle", "flow")
            ):
                out[base.attr].add(node.attr)
    return out


def test_the_lists_name_every_upstream_member_the_subclasses_use():
    """Every member of uvicorn's classes that server/httptools_protocol.py and server/readguard.py
    use is in server/upstream.py's lists, so the check at start covers it."""
    from server import httptools_protocol as protocol
    from server import readguard

    own = set()
    for cls in (protocol.ShardHttpProtocol, readguard.ReadGuard, readguard.GuardedH11Protocol):
        for klass in cls.__mro__:
            if klass.__module__.startswith("server."):
                own.update(vars(klass))
    fast = _attribute_reads(ROOT / "server" / "httptools_protocol.py", {"ShardHttpProtocol"})
    guard = _attribute_reads(ROOT / "server" / "readguard.py", {"ReadGuard", "GuardedH11Protocol"})
    assigned_here = {"parser", "flow"}  # replaced by the subclasses, but uvicorn's to begin with
    own |= fast["stored"] | guard["stored"]
    http_used = (fast["self"] | guard["self"]) - (own - assigned_here)
    assert http_used - set(upstream.HTTPTOOLS_NEEDS) - set(upstream.H11_NEEDS) == set()
    assert fast["cycle"] - set(upstream.CYCLE_NEEDS) == set()
    flow_own = (
        set(vars(readguard._WatchedFlow))
        | _attribute_reads(ROOT / "server" / "readguard.py", {"_WatchedFlow"})["stored"]
    )
    assert (fast["flow"] | guard["flow"]) - flow_own - set(upstream.FLOW_NEEDS) == set()
