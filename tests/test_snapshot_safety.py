"""What a shard must never lose on disk, with real shard processes: a variable of any name, a
fleet checkpoint a user asked for, space to leftovers of a crash, and acknowledged writes when
the disk is full or refuses (it says so and refuses writes instead).

Damage to single files is in ``test_persistence.py`` (in this process); restarts, retries and
resharding in general in ``test_durability.py``.
"""

from __future__ import annotations

import httpx2
import numpy as np

from client_sdk import PSClient
from client_sdk.optimizers import Adagrad
from conftest import http_json


def test_a_variable_named_like_safetensors_own_key_survives_sigterm_and_restart(fleet_factory):
    fleet = fleet_factory(1, "--snapshot-interval", "0", data=True)
    names = ["__metadata__", "t0", "t0.accumulator", "w"]
    with PSClient(fleet.urls, worker_id="t") as ps:
        ps.init({n: np.full(4, i, np.float32) for i, n in enumerate(names)},
                optimizer=Adagrad(lr=0.1))
        for _ in range(3):
            ps.push({n: np.ones(4, np.float32) for n in names})
        before = ps.pull(names)
        versions = {s["name"]: s["version"] for s in ps.variables()}
        assert fleet.stop(0) == 0
        fleet.start(0)  # exits 1 if its only snapshot does not validate
        after = ps.pull(names)
        for n in names:
            np.testing.assert_array_equal(after[n], before[n])
        assert {s["name"]: s["version"] for s in ps.variables()} == versions
        ps.push({"__metadata__": np.ones(4, np.float32)})  # its optimizer slots came back too
    assert "skipping snapshot" not in fleet.log_tail(0, 400)


def test_a_checkpoint_is_kept_until_deleted(fleet_factory):
    fleet = fleet_factory(1, "--snapshot-interval", "0", "--keep-snapshots", "1", data=True)
    url = fleet.urls[0]
    with PSClient(fleet.urls, worker_id="t") as ps:
        ps.init({"w": np.zeros(3, np.float32)})
        first = ps.checkpoint()
        kept = ps.pull(["w"])["w"]
        later = []
        for k in range(4):  # more checkpoints and plain snapshots than either is kept
            ps.push({"w": np.ones(3, np.float32)})
            later.append(ps.checkpoint())
            assert httpx2.post(url + "/v1/snapshot", content=b"\x80", timeout=30,
                               headers={"content-type": "application/msgpack"}).status_code == 200
    assert fleet.stop(0) == 0
    fleet.extra_args += ("--restore", first)
    fleet.start(0)  # exits 1 if the checkpoint was pruned
    with PSClient(fleet.urls, worker_id="t2") as ps:
        np.testing.assert_array_equal(ps.pull(["w"])["w"], kept)
    listed = http_json(url + "/v1/checkpoints")["checkpoints"]
    assert [c["checkpoint"] for c in listed] == [first, *later]
    assert all(c["bytes"] > 0 for c in listed)

    r = httpx2.delete(url + f"/v1/checkpoints/{first}", timeout=10)
    assert r.status_code == 200, r.text
    assert sorted(r.json()["removed"]) == [f"{stem}{ext}" for stem in
                                           [f"snapshot-{listed[0]['snapshot']:08d}-{first}"]
                                           for ext in (".json", ".safetensors")]
    assert [c["checkpoint"] for c in http_json(url + "/v1/checkpoints")["checkpoints"]] == later
    r = httpx2.delete(url + f"/v1/checkpoints/{first}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx2.delete(url + "/v1/checkpoints/bad%20id", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


def test_the_newest_snapshot_cannot_be_deleted_and_keep_checkpoints_prunes(fleet_factory):
    fleet = fleet_factory(1, "--snapshot-interval", "0", "--keep-checkpoints", "2", data=True)
    url = fleet.urls[0]
    with PSClient(fleet.urls, worker_id="t") as ps:
        ps.init({"w": np.zeros(3, np.float32)})
        ids = [ps.checkpoint() for _ in range(3)]
    assert [c["checkpoint"] for c in http_json(url + "/v1/checkpoints")["checkpoints"]] == ids[1:]
    r = httpx2.delete(url + f"/v1/checkpoints/{ids[-1]}", timeout=10)
    assert r.status_code == 409 and "newest snapshot" in r.json()["error"]["message"]
    assert [c["checkpoint"] for c in http_json(url + "/v1/checkpoints")["checkpoints"]] == ids[1:]


def test_leftover_temp_files_of_a_killed_snapshot_are_removed_at_start(fleet_factory):
    fleet = fleet_factory(1, "--snapshot-interval", "0", data=True)
    with PSClient(fleet.urls, worker_id="t") as ps:
        ps.init({"w": np.arange(4, dtype=np.float32)})
    fleet.kill(0)
    data = fleet.data_dirs[0]
    leftovers = [".tmpXq81Zb", ".tmp-snapshot-00000007.safetensors",
                 ".tmp-snapshot-00000007.json"]  # safetensors' writer's, then ours
    for name in leftovers:
        (data / name).write_bytes(b"\0" * 65536)
    (data / "operator-notes.txt").write_text("not ours")
    fleet.start(0)
    assert sorted(p.name for p in data.iterdir() if p.name.startswith(".")) == []
    assert (data / "operator-notes.txt").exists()
    assert ".tmpXq81Zb" in fleet.log_tail(0)
