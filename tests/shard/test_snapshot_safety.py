"""What a shard must never lose on disk, with real shard processes: a variable of any name, a
fleet checkpoint a user asked for, space to leftovers of a crash, and acknowledged writes when
the disk is full or refuses (it says so and refuses writes instead).

Damage to single files is in ``test_persistence.py`` (in this process); restarts, retries and
resharding in general in ``test_durability.py``.
"""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
import time

import httpx2
import numpy as np
import pytest

from client_sdk import PSClient, ShardUnavailableError, wire
from client_sdk.optimizers import Adagrad, Add
from tests.conftest import Fleet, http_json

#: Runs a command with a soft limit on the size of any file it writes (argv[1] bytes) and
#: SIGXFSZ ignored, so that a write past it fails with EFBIG: a disk that refuses, for any user.
_LIMITED = (
    "import os, resource, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), hard))\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class LimitedFleet(Fleet):
    """A fleet whose shards cannot write a file above ``limit`` bytes (``None``: no limit)."""

    def __init__(self, limit: int | None, *args, **kwargs) -> None:
        self.limit = limit
        super().__init__(*args, **kwargs)

    def command(self, i: int) -> list[str]:
        cmd = super().command(i)
        if self.limit is None:
            return cmd
        return [sys.executable, "-c", _LIMITED, str(self.limit), *cmd[1:]]


@pytest.fixture
def one_shard(tmp_path):
    """``one_shard(*flags, limit=None, before=None)``: one shard with a data dir, its files
    limited to ``limit`` bytes; ``before(data_dir)`` runs before it starts."""
    made: list[Fleet] = []

    def make(*flags: str, limit: int | None = None, before=None) -> LimitedFleet:
        workdir = tmp_path / f"fleet{len(made)}"
        workdir.mkdir()
        if before is not None:
            before(workdir / "data" / "shard-0")
        fleet = LimitedFleet(limit, 1, workdir, flags, None, True)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.close()


def post(url: str, verb: str, msg: dict) -> tuple[int, dict, httpx2.Headers]:
    enc = wire.encode(msg)
    r = httpx2.post(
        f"{url}/v1/{verb}",
        content=enc.join(),
        timeout=60,
        headers={"content-type": enc.content_type},
    )
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"]), r.headers


def readyz(url: str) -> tuple[int, dict]:
    r = httpx2.get(url + "/readyz", timeout=10)
    return r.status_code, r.json()


def test_a_variable_named_like_safetensors_own_key_survives_sigterm_and_restart(fleet_factory):
    fleet = fleet_factory(1, "--snapshot-interval", "0", data=True)
    names = ["__metadata__", "t0", "t0.accumulator", "w"]
    with PSClient(fleet.urls, worker_id="t") as ps:
        ps.init(
            {n: np.full(4, i, np.float32) for i, n in enumerate(names)}, optimizer=Adagrad(lr=0.1)
        )
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
        for _ in range(4):  # more checkpoints and plain snapshots than either is kept
            ps.push({"w": np.ones(3, np.float32)})
            later.append(ps.checkpoint())
            assert (
                httpx2.post(
                    url + "/v1/snapshot",
                    content=b"\x80",
                    timeout=30,
                    headers={"content-type": "application/msgpack"},
                ).status_code
                == 200
            )
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
    assert sorted(r.json()["removed"]) == [
        f"{stem}{ext}"
        for stem in [f"snapshot-{listed[0]['snapshot']:08d}-{first}"]
        for ext in (".json", ".safetensors")
    ]
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
    leftovers = [
        ".tmpXq81Zb",
        ".tmp-snapshot-00000007.safetensors",
        ".tmp-snapshot-00000007.json",
    ]  # safetensors' writer's, then ours
    for name in leftovers:
        (data / name).write_bytes(b"\0" * 65536)
    (data / "operator-notes.txt").write_text("not ours")
    fleet.start(0)
    assert sorted(p.name for p in data.iterdir() if p.name.startswith(".")) == []
    assert (data / "operator-notes.txt").exists()
    assert ".tmpXq81Zb" in fleet.log_tail(0)


def test_a_disk_that_refuses_snapshots_refuses_writes_until_one_succeeds(one_shard):
    """A snapshot the disk refuses (here: EFBIG, a file-size limit) is 503, not 500; the shard
    then refuses writes (503 ``cannot_persist``), serves reads, says why in ``/readyz`` and
    ``/v1/cluster``, retries by itself and takes writes again once a snapshot succeeds; every
    write it acknowledged survives SIGTERM and a restart."""
    fleet = one_shard("--snapshot-interval", "0", limit=256 << 10)
    url = fleet.urls[0]
    acked = 0
    with PSClient(fleet.urls, worker_id="t", retry_deadline=1.5) as ps:
        ps.init({"w": np.zeros(4, np.float32)}, optimizer=Add())
        for _ in range(5):
            ps.push({"w": np.ones(4, np.float32)})
            acked += 1
        status, msg, _ = post(url, "snapshot", {})
        assert status == 200, msg  # small enough: written
        ps.init({"big": np.ones(128 << 10, np.float32)})  # 512 KiB: above the limit
        status, msg, headers = post(url, "snapshot", {})
        assert status == 503, msg
        assert msg["error"]["code"] == "unavailable" and "Retry-After" in headers
        assert msg["error"]["details"]["reason"] == "cannot_persist"
        assert "File too large" in msg["error"]["message"]
        # a fleet checkpoint's write fails the same way: resume answers 503, not 500
        assert post(url, "pause", {"checkpoint": "c1"})[0] == 200
        assert post(url, "snapshot", {"checkpoint": "c1"})[0] == 200  # captured
        status, msg, _ = post(url, "resume", {"checkpoint": "c1"})
        assert status == 503 and msg["error"]["details"]["reason"] == "cannot_persist", msg
        assert str(fleet.data_dirs[0]) not in msg["error"]["message"]  # paths: the log only

        status, body = readyz(url)
        assert status == 503 and body["status"] == "cannot_persist" and body["error"]
        info = http_json(url + "/v1/cluster")["cannot_persist"]
        assert info["error"] == "File too large" and info["attempts"] >= 1
        status, msg, headers = post(
            url, "push", {"worker_id": "raw", "seq": 1, "grads": {"w": np.ones(4, np.float32)}}
        )
        assert status == 503 and msg["error"]["details"]["reason"] == "cannot_persist"
        assert int(headers["retry-after"]) >= 1
        assert "cannot write snapshots" in msg["error"]["message"]
        with pytest.raises(ShardUnavailableError, match="cannot write snapshots"):
            ps.push({"w": np.ones(4, np.float32)})  # the SDK retried, then gave up: not applied
        np.testing.assert_array_equal(ps.pull(["w"])["w"], np.full(4, acked, np.float32))
        assert "cannot persist" in fleet.log_tail(0) and str(fleet.data_dirs[0]) in fleet.log_tail(
            0
        )

        # the operator makes room: the shard's own retry succeeds and writes are taken again
        resource.prlimit(
            fleet.procs[0].pid,
            resource.RLIMIT_FSIZE,
            (resource.RLIM_INFINITY, resource.RLIM_INFINITY),
        )
        deadline = time.monotonic() + 60
        while readyz(url)[0] != 200:
            assert time.monotonic() < deadline, fleet.log_tail(0)
            time.sleep(0.2)
        assert http_json(url + "/v1/cluster")["cannot_persist"] is None
        for _ in range(2):
            ps.push({"w": np.ones(4, np.float32)})
            acked += 1
    assert fleet.stop(0) == 0
    fleet.limit = None
    fleet.start(0)
    with PSClient(fleet.urls, worker_id="t2") as ps:
        got = ps.pull(["w", "big"])
    np.testing.assert_array_equal(got["w"], np.full(4, acked, np.float32))
    np.testing.assert_array_equal(got["big"], np.ones(128 << 10, np.float32))


@contextlib.contextmanager
def small_filesystem(path, size: str):
    """A filesystem of ``size`` bytes mounted at ``path`` (a tmpfs): a disk that fills up for
    real. Needs the right to mount (root, as in the containers this suite runs in)."""
    path.mkdir(parents=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({r.stderr.strip()}): run the suite as "
            "root to test a full disk; the refusal of writes is tested without root "
            "by test_a_disk_that_refuses_snapshots_refuses_writes_until_one_succeeds"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_on_a_full_disk_snapshots_free_older_ones_and_sigterm_loses_nothing(one_shard):
    """A data dir with room for three snapshots and a checkpoint's: the fourth snapshot, and
    the final one on SIGTERM, find the disk full, remove older periodic snapshots (never the
    newest, never the checkpoint) and are written; every acknowledged push survives."""
    with contextlib.ExitStack() as stack:

        def mount(data):
            stack.enter_context(small_filesystem(data, "1536k"))

        fleet = one_shard("--snapshot-interval", "0", before=mount)
        stack.callback(fleet.close)  # stopped before the filesystem goes
        data, url = fleet.data_dirs[0], fleet.urls[0]
        value = np.zeros(100_000, np.float32)  # 400 kB: three snapshots fill the disk
        acked = 0
        with PSClient(fleet.urls, worker_id="t") as ps:
            ps.init({"v": value}, optimizer=Add())
            ckpt = ps.checkpoint()
            for _ in range(4):
                for _ in range(3):
                    ps.push({"v": np.ones_like(value)})
                    acked += 1
                status, msg, _ = post(url, "snapshot", {})
                assert status == 200, msg
            ps.push({"v": np.ones_like(value)})  # only the final snapshot holds this one
            acked += 1
        assert "out of space" in fleet.log_tail(0)
        assert fleet.stop(0) == 0, fleet.log_tail(0)
        assert readable_snapshots(data)[0] == (1, ckpt)
        fleet.start(0)
        with PSClient(fleet.urls, worker_id="t2") as ps:
            np.testing.assert_array_equal(ps.pull(["v"])["v"], np.full_like(value, acked))
        assert [c["checkpoint"] for c in http_json(url + "/v1/checkpoints")["checkpoints"]] == [
            ckpt
        ]
        assert http_json(url + "/v1/cluster")["restored"]["checkpoint"] is None


def readable_snapshots(data) -> list[tuple[int, str | None]]:
    from server import persistence

    return [(n, c) for n, c, _ in persistence.list_snapshots(data)]


def test_no_reply_shows_where_the_data_dir_is(fleet_factory):
    """``/v1/cluster`` and checkpoint replies name snapshots relative to the data dir and say
    only whether there is one: where it is on the host is for the shard's log."""
    fleet = fleet_factory(1, "--snapshot-interval", "0", data=True)
    url, data = fleet.urls[0], fleet.data_dirs[0]
    with PSClient(fleet.urls, worker_id="t") as ps:
        ps.init({"w": np.zeros(3, np.float32)})
    assert post(url, "pause", {"checkpoint": "c1"})[0] == 200
    assert post(url, "snapshot", {"checkpoint": "c1"})[0] == 200
    status, reply, _ = post(url, "resume", {"checkpoint": "c1"})
    assert status == 200 and reply["snapshot"]["path"] == "snapshot-00000001-c1.json"
    assert fleet.stop(0) == 0
    fleet.start(0)
    cluster = httpx2.get(url + "/v1/cluster", timeout=10)
    assert str(data) not in cluster.text and str(fleet.workdir) not in cluster.text
    info = cluster.json()
    assert info["data_dir"] is True
    assert (data / info["restored"]["path"]).is_file()
    assert str(data) in fleet.log_tail(0, 400)  # the operator finds it in the log
