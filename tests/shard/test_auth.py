"""Bearer-token auth on real shard processes (server/auth.py, docs/PROTOCOL.md §2 Auth).

A module-wide shard per way of serving (the fast path with its direct routes and immediate
pulls, and the stock FastAPI path) runs with a full token, a second full token (rotation) and a
read token. Every verb is sent on it without a token, with a wrong one and with the read token,
as raw HTTP; what it holds is read back with the full token to show a refusal changed nothing.
Bad headers (malformed, huge, non-ASCII) get 401 and leave the shard healthy, and no token
reaches its log. The SDK's ``AuthError`` names the shard; a token file is read again when it
changes; a shard refuses to start with a bad token setting, without printing the token.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import numpy as np
import pytest

import client_sdk
from client_sdk import wire
from client_sdk.wire import groups as group_wire
from tests.conftest import HTTP_MODES, ROOT, Fleet
from tests.helpers.eventually import eventually
from tests.shard.test_server_http import ACCEPT_FRAME, decode_reply

TOKEN = "full-" + "a1" * 16
TOKEN2 = "rotated-" + "b2" * 16
READ = "read-" + "c3" * 16
WRONG = "wrong-" + "d4" * 16

WRITE_VERBS = (
    "init",
    "push",
    "assign",
    "increment",
    "set_optimizer",
    "delete",
    "create_table",
    "push_rows",
)
CONTROL_VERBS = ("pause", "snapshot", "resume")
READ_VERBS = ("pull", "wait", "poll", "pull_rows")


@pytest.fixture(scope="module", params=HTTP_MODES)
def shard(request, tmp_path_factory):
    """One shard with a data dir (so pause works), two full tokens and a read token."""
    env = {
        "PARAMSHARD_HTTP": "stock" if request.param == "stock" else "auto",
        "PARAMSHARD_TOKEN": f"{TOKEN},{TOKEN2}",
        "PARAMSHARD_READ_TOKEN": READ,
    }
    fleet = Fleet(1, tmp_path_factory.mktemp(f"auth-{request.param}"), env=env, data=True)
    yield fleet
    fleet.close()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def raw(http, url: str, verb: str, msg: Any, headers: dict[str, str] | None = None, **kw):
    enc = wire.encode(msg)
    h = {"content-type": enc.content_type, **(headers or {})}
    return decode_reply(http.post(f"{url}/v1/{verb}", content=enc.join(), headers=h, **kw))


def bodies(name: str, counter: str) -> dict[str, Any]:
    """A well-formed request of every verb, about ``name`` (a float vector) and ``counter``."""
    worker = "w-" + uuid.uuid4().hex[:8]
    return {
        "init": {"variables": {name + "-new": {"value": np.ones(3, np.float32)}}},
        "push": {"worker_id": worker, "seq": 0, "grads": {name: np.ones(3, np.float32)}},
        "assign": {"values": {name: np.full(3, 7.0, np.float32)}},
        "increment": {"name": counter, "delta": 5},
        "set_optimizer": {"names": [name], "frozen": True, "worker_id": worker, "seq": 1},
        "delete": {"names": [name], "worker_id": worker, "seq": 2},
        "pause": {"checkpoint": "ck-" + uuid.uuid4().hex[:8], "lease": 30},
        "snapshot": {},
        "resume": {"checkpoint": "nothing-paused"},
        "pull": {"names": [name]},
        "wait": {"names": [name], "timeout": 0},
        "poll": {"names": [name], "timeout": 0},
        "create_table": {"name": name + "-new-table", "spec": {"dim": 2}},
        "pull_rows": {"name": name + "-table", "ids": np.array([1, 2], np.int64)},
        "push_rows": {
            "name": name + "-table",
            "ids": np.array([1], np.int64),
            "grads": np.ones((1, 2), np.float32),
            "worker_id": worker,
            "seq": 3,
        },
    }


def setup_state(http, url: str) -> tuple[str, str, dict[str, Any]]:
    name, counter = "v-" + uuid.uuid4().hex[:8], "c-" + uuid.uuid4().hex[:8]
    rep = raw(
        http,
        url,
        "init",
        {
            "variables": {
                name: {"value": np.zeros(3, np.float32), "optimizer": {"type": "add"}},
                counter: {"value": np.array(0, np.int64), "kind": "counter"},
            }
        },
        bearer(TOKEN),
    )
    assert rep.status == 200, rep.msg
    rep = raw(
        http, url, "create_table", {"name": name + "-table", "spec": {"dim": 2}}, bearer(TOKEN)
    )
    assert rep.status == 200, rep.msg
    return name, counter, state_of(http, url)


def state_of(http, url: str) -> dict[str, Any]:
    """What the shard holds and whether it is paused, read with the full token."""
    r = http.get(f"{url}/v1/variables", headers=bearer(TOKEN))
    assert r.status_code == 200, r.text
    ready = http.get(f"{url}/readyz").json()
    variables = {v["name"]: (v["version"], v["frozen"]) for v in r.json()["variables"]}
    r = http.get(f"{url}/v1/tables", headers=bearer(TOKEN))
    assert r.status_code == 200, r.text
    tables = {t["name"]: (t["version"], t["rows"]) for t in r.json()["tables"]}
    return {"variables": variables, "tables": tables, "paused_for": ready["paused_for"]}


def refused_counts(http, url: str) -> dict[str, int]:
    r = http.get(f"{url}/v1/cluster", headers=bearer(READ))
    assert r.status_code == 200, r.text
    auth = r.json()["auth"]
    assert auth["mode"] == "token+read"
    return auth["refused"]


def assert_401(rep, reason: str) -> None:
    assert rep.status == 401, (rep.status, rep.msg)
    assert rep.msg["error"]["code"] == "unauthorized"
    assert rep.msg["error"]["details"]["reason"] == reason
    assert "Bearer" in rep.headers["www-authenticate"]
    assert rep.headers[wire.HEADER_SHARD] == "0/1"


# -- every verb, every way ------------------------------------------------------------------


@pytest.mark.parametrize("verb", WRITE_VERBS + CONTROL_VERBS + READ_VERBS)
def test_a_request_without_a_token_is_401_and_changes_nothing(shard, http, verb):
    url = shard.urls[0]
    name, counter, before = setup_state(http, url)
    counts = refused_counts(http, url)
    msg = bodies(name, counter)[verb]
    assert_401(raw(http, url, verb, msg), "missing")
    assert_401(raw(http, url, verb, msg, bearer(WRONG)), "wrong")
    assert_401(raw(http, url, verb, msg, {"authorization": f"Basic {TOKEN}"}), "malformed")
    assert state_of(http, url) == before
    after = refused_counts(http, url)
    assert after["missing"] == counts["missing"] + 1
    assert after["wrong"] == counts["wrong"] + 1
    assert after["malformed"] == counts["malformed"] + 1


@pytest.mark.parametrize("verb", WRITE_VERBS + CONTROL_VERBS)
def test_a_read_token_on_a_write_is_403_and_changes_nothing(shard, http, verb):
    url = shard.urls[0]
    name, counter, before = setup_state(http, url)
    counts = refused_counts(http, url)
    rep = raw(http, url, verb, bodies(name, counter)[verb], bearer(READ))
    assert rep.status == 403, (rep.status, rep.msg)
    assert rep.msg["error"]["code"] == "forbidden"
    assert "read-only token" in rep.msg["error"]["message"]
    assert state_of(http, url) == before
    assert refused_counts(http, url)["forbidden"] == counts["forbidden"] + 1


@pytest.mark.parametrize("verb", READ_VERBS)
def test_a_read_token_may_read(shard, http, verb):
    url = shard.urls[0]
    name, counter, _ = setup_state(http, url)
    rep = raw(http, url, verb, bodies(name, counter)[verb], bearer(READ))
    assert rep.status == 200, rep.msg


@pytest.mark.parametrize("token", [TOKEN, TOKEN2])
def test_every_full_token_may_write(shard, http, token):
    """Both tokens of a rotation are accepted, for every verb (pause then resume)."""
    url = shard.urls[0]
    name, counter, _before = setup_state(http, url)
    msgs = bodies(name, counter)
    for verb in ("push", "assign", "increment", "set_optimizer", "snapshot"):
        rep = raw(http, url, verb, msgs[verb], bearer(token))
        assert rep.status == 200, (verb, rep.msg)
    checkpoint = msgs["pause"]["checkpoint"]
    assert raw(http, url, "pause", msgs["pause"], bearer(token)).status == 200
    assert state_of(http, url)["paused_for"] == checkpoint
    assert raw(http, url, "resume", {"checkpoint": checkpoint}, bearer(token)).status == 200
    assert raw(http, url, "delete", msgs["delete"], bearer(token)).status == 200
    assert name not in state_of(http, url)["variables"]


def test_a_small_table_pull_needs_a_token_too(shard, http):
    """The small table pull the fast path answers without the app (server.immediate.
    immediate_routes) is refused without a token like any other, and answered with one."""
    url = shard.urls[0]
    name, _, _ = setup_state(http, url)
    ask = {"names": [name], "layout": "table"}
    rep = raw(http, url, "pull", ask, {"accept": ACCEPT_FRAME})
    assert_401(rep, "missing")
    rep = raw(http, url, "pull", ask, {"accept": ACCEPT_FRAME, **bearer(WRONG)})
    assert_401(rep, "wrong")
    rep = raw(http, url, "pull", ask, {"accept": ACCEPT_FRAME, **bearer(READ)})
    assert rep.status == 200 and rep.msg["table"]["versions"] == [0]


def test_a_read_token_may_register_and_pull_a_step_group_not_push_it(shard, http):
    url = shard.urls[0]
    name, _, _ = setup_state(http, url)
    assert_401(raw(http, url, "groups", {"names": [name]}), "missing")
    made = raw(http, url, "groups", {"names": [name]}, bearer(READ))
    assert made.status == 200, made.msg
    gid = made.msg["group"]
    assert_401(raw(http, url, "group_pull", {"group": gid}), "missing")
    pulled = raw(http, url, "group_pull", {"group": gid}, bearer(READ))
    assert pulled.status == 200 and pulled.msg["group"] == gid
    body = group_wire.encode(
        {"group": gid, "worker_id": "w-read", "seq": 1},
        None,
        "grads",
        "<f4",
        [np.ones(3, np.float32).data.cast("B")],
        12,
    )
    headers = {"content-type": body.content_type, **bearer(READ)}
    rep = http.post(f"{url}/v1/group_push", content=body.join(), headers=headers)
    assert rep.status_code == 403
    assert state_of(http, url)["variables"][name] == (0, False)


def test_inspection_needs_a_read_token_and_probes_are_open(shard, http):
    url = shard.urls[0]
    name, _, _ = setup_state(http, url)
    for path in ("/v1/variables", f"/v1/variables/{name}", "/v1/workers", "/v1/cluster"):
        r = http.get(url + path)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["content-type"].startswith(wire.JSON)
        assert r.json()["error"]["code"] == "unauthorized"
        assert http.get(url + path, headers=bearer(READ)).status_code == 200
    for path in ("/healthz", "/readyz", "/docs", "/openapi.json"):
        assert http.get(url + path).status_code == 200, path
    r = http.delete(f"{url}/v1/checkpoints/nothing", headers=bearer(READ))
    assert r.status_code == 403


# -- bad headers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, reason",
    [
        ("Bearer", "malformed"),
        (f"Token {TOKEN}", "malformed"),
        (TOKEN, "malformed"),
        ("Bearer " + "x" * 5000, "malformed"),  # above MAX_AUTHORIZATION
        ("Bearer " + "x" * 2000, "wrong"),
        ("Bearer " + TOKEN[:-1], "wrong"),
        ("Bearer " + TOKEN + "x", "wrong"),
        (b"Bearer \xe9\xe8\xff" + TOKEN.encode(), "malformed"),
        ("Bearer " + TOKEN + " extra", "wrong"),
    ],
)
def test_a_bad_authorization_header_is_401_and_the_shard_stays_healthy(shard, http, value, reason):
    url = shard.urls[0]
    name, counter, before = setup_state(http, url)
    msg = bodies(name, counter)["push"]
    rep = raw(http, url, "push", msg, {"authorization": value})  # type: ignore[dict-item]
    assert_401(rep, reason)
    assert state_of(http, url) == before
    assert http.get(url + "/healthz").status_code == 200


def test_a_huge_authorization_header_is_refused_by_the_head_bound(shard, http):
    url = shard.urls[0]
    name, counter, before = setup_state(http, url)
    rep = raw(http, url, "push", bodies(name, counter)["push"], bearer("y" * 100_000))
    assert rep.status in (400, 401), rep.status
    assert state_of(http, url) == before
    assert http.get(url + "/healthz").status_code == 200


def test_the_scheme_is_case_insensitive_and_spaces_are_skipped(shard, http):
    url = shard.urls[0]
    name, _counter, _ = setup_state(http, url)
    rep = raw(http, url, "pull", {"names": [name]}, {"authorization": f"bearer   {TOKEN}"})
    assert rep.status == 200


def test_no_token_reaches_the_log(shard, http):
    """Refusals are logged (at most a line a second), never with the token sent or held."""
    url = shard.urls[0]
    raw(http, url, "push", {}, bearer(WRONG))
    eventually(lambda: "auth: refused" in shard.log_tail(0, 400), "a refusal in the log")
    text = (shard.workdir / "shard0.log").read_text(errors="replace")
    for secret in (TOKEN, TOKEN2, READ, WRONG):
        assert secret not in text


# -- the SDK --------------------------------------------------------------------------------


def test_the_sdk_sends_its_token_and_names_the_shard_when_refused(shard, monkeypatch):
    url = shard.urls[0]
    name = "sdk-" + uuid.uuid4().hex[:8]
    with client_sdk.PSClient([url], token=TOKEN2, retry_deadline=5) as ps:
        ps.init({name: np.zeros(2, np.float32)}, optimizer=client_sdk.optimizers.Add())
        ps.push({name: np.ones(2, np.float32)})
        ps.flush()
        np.testing.assert_array_equal(ps.pull([name])[name], np.ones(2))
    monkeypatch.setenv(wire.ENV_TOKEN, READ)
    with client_sdk.PSClient([url], retry_deadline=5) as ps:
        np.testing.assert_array_equal(ps.pull([name])[name], np.ones(2))
        with pytest.raises(client_sdk.AuthError) as refused:
            ps.assign({name: np.zeros(2, np.float32)})
    assert refused.value.status == 403 and refused.value.shard == url
    assert url in str(refused.value) and "read-only token" in str(refused.value)
    monkeypatch.delenv(wire.ENV_TOKEN)
    with client_sdk.PSClient([url], retry_deadline=5) as ps:
        with pytest.raises(client_sdk.AuthError) as refused:
            ps.pull([name])
    assert refused.value.status == 401 and url in str(refused.value)
    assert "PARAMSHARD_TOKEN" in str(refused.value)


# -- the token file, and settings -----------------------------------------------------------


def test_a_token_file_is_read_again_when_it_changes(fleet_factory, tmp_path, http):
    path = tmp_path / "token"
    path.write_text(f"# the fleet's token\n{TOKEN}\n")
    fleet = fleet_factory(1, "--token-file", str(path))
    url = fleet.urls[0]
    assert http.get(url + "/v1/cluster", headers=bearer(TOKEN)).status_code == 200
    assert http.get(url + "/v1/cluster", headers=bearer(TOKEN2)).status_code == 401
    path.write_text(f"{TOKEN}\n{TOKEN2}\n")  # rotation: old and new
    eventually(
        lambda: http.get(url + "/v1/cluster", headers=bearer(TOKEN2)).status_code == 200,
        "the new token accepted",
    )
    assert http.get(url + "/v1/cluster", headers=bearer(TOKEN)).status_code == 200
    path.write_text("short\n")  # a bad file keeps the tokens in use
    path.write_text(f"{TOKEN2}\n")
    eventually(
        lambda: http.get(url + "/v1/cluster", headers=bearer(TOKEN)).status_code == 401,
        "the old token refused",
    )
    assert http.get(url + "/v1/cluster", headers=bearer(TOKEN2)).status_code == 200


def test_a_bad_token_file_keeps_the_tokens_in_use(fleet_factory, tmp_path, http):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    fleet = fleet_factory(1, "--token-file", str(path))
    url = fleet.urls[0]
    path.write_text("\xe9" * 20)
    eventually(lambda: "keeping the tokens in use" in fleet.log_tail(0), "the bad file reported")
    assert http.get(url + "/v1/cluster", headers=bearer(TOKEN)).status_code == 200


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--token", "short"], {}, "5 characters"),
        (["--token", "x" * 20 + " y"], {}, "printable ASCII"),
        ([], {"PARAMSHARD_TOKEN": " , "}, "PARAMSHARD_TOKEN is empty"),
        (["--read-token", READ], {}, "needs a full one too"),
        (["--token-file", "/nonexistent/token"], {}, "cannot read the token file"),
    ],
)
def test_a_bad_token_setting_stops_the_shard_at_start(args, env, says):
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert "short" not in proc.stderr.replace("--token", "")
    assert "x" * 20 not in proc.stderr


def test_the_sdk_sends_the_last_token_of_a_list(shard, monkeypatch):
    """One PARAMSHARD_TOKEN for shards and workers while a token is rotated: the shards take
    both, the SDK sends the newest (the last)."""
    monkeypatch.setenv(wire.ENV_TOKEN, f"{WRONG},{TOKEN2}")
    with client_sdk.PSClient([shard.urls[0]], retry_deadline=5) as ps:
        assert ps.variables() is not None
    monkeypatch.setenv(wire.ENV_TOKEN, f"{TOKEN2},{WRONG}")
    with client_sdk.PSClient([shard.urls[0]], retry_deadline=5) as ps:
        with pytest.raises(client_sdk.AuthError):
            ps.variables()


def test_paramshard_status_sends_the_token(shard, monkeypatch):
    url = shard.urls[0]

    def status(env: dict[str, str]) -> subprocess.CompletedProcess:
        import os

        clean = {k: v for k, v in os.environ.items() if k != wire.ENV_TOKEN}
        return subprocess.run(
            [sys.executable, "-m", "server.cli", "status", "--shards", url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**clean, "PYTHONPATH": str(ROOT), **env},
            cwd=ROOT,
        )

    assert status({wire.ENV_TOKEN: READ}).returncode == 0
    assert status({}).returncode != 0


def test_the_one_lookup_check_and_the_digest_check_agree(tmp_path):
    """A header that spells an accepted token as the SDK does is judged by one dict lookup
    (Guard.exact); every other value by the digests. Both give the same verdicts, and a
    token dropped from the token file leaves the lookup too."""
    from server.auth import READ as NEED_READ
    from server.auth import WRITE as NEED_WRITE
    from server.auth import Guard

    path = tmp_path / "token"
    path.write_text(f"{TOKEN2}\n")
    guard = Guard([TOKEN], [READ], str(path))
    digests_only = Guard([TOKEN], [READ], str(path))
    digests_only.exact = {}
    values = [
        f"Bearer {TOKEN}",
        f"Bearer {TOKEN2}",
        f"Bearer {READ}",
        f"Bearer {WRONG}",
        f"bearer  {TOKEN}",
        f"Bearer {TOKEN} ",
        f"Basic {TOKEN}",
        "Bearer",
    ]
    for value in values:
        for need in (NEED_READ, NEED_WRITE):
            headers = {b"authorization": value.encode()}
            assert guard._judge(headers, need) == digests_only._judge(headers, need), value
    assert guard._judge({b"authorization": f"Bearer {READ}".encode()}, NEED_WRITE) == "forbidden"
    assert set(guard.exact.values()) == {NEED_READ, NEED_WRITE} and len(guard.exact) == 3
    path.write_text(f"{TOKEN}\n")
    os.utime(path, (1, 1))  # a new stamp whatever the clock's resolution
    assert guard.reload()
    assert guard._judge({b"authorization": f"Bearer {TOKEN2}".encode()}, NEED_READ) == "wrong"
    assert f"Bearer {TOKEN2}".encode() not in guard.exact
