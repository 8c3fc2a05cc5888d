"""Snapshots on disk and the dedup table, in this process (no shard needed to damage a file).

The shard-level behaviour (restart on a damaged data dir, SIGTERM, kill -9) is in
``test_durability.py``; here every kind of damage is tried against the reader directly.
"""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file

from client_sdk.optimizers import SGD, Adagrad
from server import persistence
from server.persistence import snapshot as snapshot_files
from server.store import ParameterStore
from server.store.dedup import WINDOW, DedupTable


def make_store() -> ParameterStore:
    store = ParameterStore(0, 1)
    store.init(
        {
            "w": (np.arange(6, dtype=np.float32).reshape(2, 3), Adagrad(lr=0.1).to_wire()),
            "b": (np.zeros(3, np.float64), SGD(lr=1.0).to_wire()),
            "empty": (np.zeros((0, 4), np.float32), None),
        }
    )
    store.push("w0", 5, {"w": np.ones((2, 3), np.float32), "b": np.ones(3)})
    store.push("w0", 7, {"w": np.ones((2, 3), np.float32)})
    store.increment("step", 3, "w1", 1)
    return store


def snapshot(store: ParameterStore, tmp_path, number: int = 1, checkpoint: str | None = None):
    return persistence.write_snapshot(
        tmp_path, number, store.capture(), incarnation="abc", checkpoint=checkpoint
    )


def restore(tmp_path) -> ParameterStore:
    found = persistence.find_restorable(tmp_path, 0, 1)
    assert found is not None
    store = ParameterStore(0, 1)
    store.restore(found.variables, found.dedup)
    return store


def test_round_trip_keeps_values_versions_state_and_dedup(tmp_path):
    store = make_store()
    snap = snapshot(store, tmp_path)
    assert snap.manifest_path.name == "snapshot-00000001.json"
    back = restore(tmp_path)
    assert back.state_version == store.state_version == 4
    for var in store:
        got = back.get(var.name)
        np.testing.assert_array_equal(got.value, var.value)
        assert got.value.dtype == var.value.dtype and got.value.flags.writeable
        assert (got.version, got.updates, got.kind, got.optimizer) == (
            var.version,
            var.updates,
            var.kind,
            var.optimizer,
        )
        assert got.state.keys() == var.state.keys()
        for slot in var.state:
            np.testing.assert_array_equal(got.state[slot], var.state[slot])
    # the dedup table came back: the same seqs are duplicates, the increment's result too
    assert back.push("w0", 7, {"w": np.ones((2, 3), np.float32)})["w"]["status"] == "duplicate"
    assert back.increment("step", 3, "w1", 1) == {"value": 3, "version": 1, "status": "duplicate"}
    assert back.push("w0", 6, {"b": np.ones(3)})["b"]["status"] == "applied"


def test_values_file_is_plain_safetensors(tmp_path):
    snap = snapshot(make_store(), tmp_path)
    tensors = load_file(snap.values_path)
    keys = {
        name: {slot: t["key"] for slot, t in meta["tensors"].items()}
        for name, meta in snap.manifest["variables"].items()
    }
    assert set(tensors) == {k for slots in keys.values() for k in slots.values()}
    assert set(keys["w"]) == {"value", "accumulator"} and len(set(tensors)) == 5
    np.testing.assert_array_equal(tensors[keys["b"]["value"]], np.zeros(3) - 1.0)


#: Names that collide with safetensors' own key, or with keys a snapshot makes for others.
AWKWARD = ["__metadata__", "t0", "t1", "t0.accumulator", "t2.accumulator", "w"]


def awkward_store() -> ParameterStore:
    store = ParameterStore(0, 1)
    store.init(
        {
            name: (np.full((2, 2), i, np.float32), Adagrad(lr=0.1).to_wire())
            for i, name in enumerate(AWKWARD)
        }
    )
    store.push("w0", 1, {name: np.ones((2, 2), np.float32) for name in AWKWARD})
    return store


def assert_same(back: ParameterStore, store: ParameterStore) -> None:
    assert sorted(v.name for v in back) == sorted(v.name for v in store)
    for var in store:
        got = back.get(var.name)
        np.testing.assert_array_equal(got.value, var.value)
        assert got.version == var.version and got.state.keys() == var.state.keys()
        for slot in var.state:
            np.testing.assert_array_equal(got.state[slot], var.state[slot])


def test_any_name_round_trips_even_safetensors_own_metadata_key(tmp_path):
    store = awkward_store()
    snap = snapshot(store, tmp_path)
    assert "__metadata__" in snap.manifest["variables"]
    assert_same(restore(tmp_path), store)
    assert len(load_file(snap.values_path)) == 2 * len(AWKWARD)  # plain safetensors still


def test_format_1_snapshots_keyed_by_name_still_restore(tmp_path, monkeypatch):
    """Snapshots written with each value under its variable's name (and slots under
    ``name#slot``) restore, also the ones where a variable named ``__metadata__`` wrote that
    key twice into the safetensors header."""
    store = awkward_store()
    names = list(store.capture().variables)
    monkeypatch.setattr(
        snapshot_files,
        "tensor_key",
        lambda j, slot: names[j] if slot == "value" else f"{names[j]}#{slot}",
    )
    snap = snapshot(store, tmp_path)
    monkeypatch.undo()
    head = snap.values_path.read_bytes()[:4096]
    assert head.count(b'"__metadata__"') == 2  # what such a writer made
    assert snap.manifest["variables"]["w"]["tensors"]["value"]["key"] == "w"
    assert_same(restore(tmp_path), store)


def test_reshard_moves_awkward_names(tmp_path):
    from server.reshard import reshard

    store = awkward_store()
    capture = store.capture()
    persistence.write_snapshot(tmp_path / "one", 1, capture, incarnation="x", checkpoint="ck")
    result = reshard([tmp_path / "one"], tmp_path / "two", 2, checkpoint="ck")
    assert result.variables == len(AWKWARD)
    held = {
        v.name: v
        for j in range(2)
        for v in persistence.find_restorable(tmp_path / "two" / f"shard-{j}", j, 2).variables
    }
    assert sorted(held) == sorted(AWKWARD)
    for var in store:
        np.testing.assert_array_equal(held[var.name].value, var.value)
        np.testing.assert_array_equal(held[var.name].state["accumulator"], var.state["accumulator"])


def test_capture_is_one_instant_and_later_updates_do_not_touch_it(tmp_path):
    store = make_store()
    capture = store.capture()
    frozen = {
        name: {k: a.copy() for k, a in arrays.items()}
        for name, (_, arrays) in capture.variables.items()
    }
    store.push("w0", 8, {"w": np.full((2, 3), 10, np.float32)})
    store.assign({"b": np.full(3, 5.0)})
    for name, (_, arrays) in capture.variables.items():
        for slot, a in arrays.items():
            np.testing.assert_array_equal(a, frozen[name][slot])
    assert not np.array_equal(store.get("w").state["accumulator"], frozen["w"]["accumulator"])


def damage_truncate(snap):
    data = snap.values_path.read_bytes()
    snap.values_path.write_bytes(data[: len(data) // 2])


def damage_flip_value_byte(snap):
    data = bytearray(snap.values_path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    snap.values_path.write_bytes(bytes(data))


def damage_garbage_values(snap):
    snap.values_path.write_bytes(b"\x00garbage" * 50)


def damage_torn_manifest(snap):
    text = snap.manifest_path.read_text()
    snap.manifest_path.write_text(text[: len(text) // 2])


def damage_edited_manifest(snap):
    m = json.loads(snap.manifest_path.read_text())
    m["variables"]["w"]["version"] += 1  # valid JSON, wrong content
    snap.manifest_path.write_text(json.dumps(m))


def damage_missing_values(snap):
    snap.values_path.unlink()


def damage_header_length(snap):
    data = bytearray(snap.values_path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    snap.values_path.write_bytes(bytes(data))


def damage_offsets_past_the_end(snap):
    """A header that parses, whose first tensor's bytes run past the file's end (the file as
    long as before: only the bounds check can tell)."""
    data = snap.values_path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "the edited header no longer fits"
    snap.values_path.write_bytes(data[:8] + text.ljust(n) + data[8 + n :])


@pytest.mark.parametrize(
    "damage",
    [
        damage_offsets_past_the_end,
        damage_truncate,
        damage_flip_value_byte,
        damage_garbage_values,
        damage_torn_manifest,
        damage_edited_manifest,
        damage_missing_values,
        damage_header_length,
    ],
    ids=lambda f: f.__name__[len("damage_") :],
)
def test_a_damaged_newest_snapshot_is_skipped_for_the_previous_good_one(tmp_path, damage, caplog):
    store = make_store()
    snapshot(store, tmp_path, 1)
    good = {v.name: (v.version, v.value.copy()) for v in store}
    store.push("w0", 9, {"w": np.ones((2, 3), np.float32)})
    newest = snapshot(store, tmp_path, 2)
    damage(newest)
    back = restore(tmp_path)
    for name, (version, value) in good.items():
        assert back.get(name).version == version
        np.testing.assert_array_equal(back.get(name).value, value)
    assert "skipping snapshot" in caplog.text and newest.manifest_path.name in caplog.text


def test_nothing_valid_refuses_to_start_empty(tmp_path):
    damage_truncate(snapshot(make_store(), tmp_path))
    with pytest.raises(persistence.SnapshotMismatch, match="none of the 1 snapshot"):
        persistence.find_restorable(tmp_path, 0, 1)


def test_another_shards_snapshot_is_refused(tmp_path):
    snapshot(make_store(), tmp_path)
    with pytest.raises(persistence.SnapshotMismatch, match="--shard-index 0 --num-shards 1"):
        persistence.find_restorable(tmp_path, 1, 2)


def test_an_empty_or_missing_dir_has_nothing_to_restore(tmp_path):
    assert persistence.find_restorable(tmp_path, 0, 1) is None
    assert persistence.find_restorable(tmp_path / "nope", 0, 1) is None


def test_keep_k_plain_snapshots_and_every_checkpoint(tmp_path):
    store = make_store()
    for n in range(1, 10):
        snapshot(store, tmp_path, n, checkpoint=f"ck{n}" if n in (2, 5, 6, 7) else None)
    persistence.prune(tmp_path, keep=2)
    left = [(n, c) for n, c, _ in persistence.list_snapshots(tmp_path)]
    assert left == [(2, "ck2"), (5, "ck5"), (6, "ck6"), (7, "ck7"), (8, None), (9, None)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"snapshot-{n:08d}{'-' + c if c else ''}{ext}"
        for n, c in left
        for ext in (".json", ".safetensors")
    )
    persistence.prune(tmp_path, keep=2, keep_checkpoints=2)  # --keep-checkpoints 2
    assert [c for _, c, _ in persistence.list_snapshots(tmp_path)] == ["ck6", "ck7", None, None]


def test_leftovers_of_interrupted_writes_are_cleaned(tmp_path):
    store = make_store()
    snap = snapshot(store, tmp_path, 1)
    (tmp_path / ".tmp-snapshot-00000002.safetensors").write_bytes(b"half")
    (tmp_path / "snapshot-00000003.safetensors").write_bytes(b"no manifest")
    (tmp_path / ".tmpA1b2C3").write_bytes(b"safetensors' writer's own, killed mid-write")
    for other in (".tmpA1b2C", ".tmp-notes", "notes.txt"):  # not ours: left alone
        (tmp_path / other).write_bytes(b"x")
    assert sorted(persistence.clean(tmp_path)) == [
        ".tmp-snapshot-00000002.safetensors",
        ".tmpA1b2C3",
        "snapshot-00000003.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [snap.manifest_path.name, snap.values_path.name, ".tmpA1b2C", ".tmp-notes", "notes.txt"]
    )
    assert persistence.next_number(tmp_path) == 2


def test_checkpoint_restore_picks_that_snapshot(tmp_path):
    store = make_store()
    snapshot(store, tmp_path, 1, checkpoint="ck1")
    store.push("w0", 10, {"b": np.ones(3)})
    snapshot(store, tmp_path, 2)
    found = persistence.find_restorable(tmp_path, 0, 1, checkpoint="ck1")
    assert found.snapshot.number == 1
    with pytest.raises(persistence.SnapshotMismatch, match="no snapshot of checkpoint"):
        persistence.find_restorable(tmp_path, 0, 1, checkpoint="ck2")


# -- the dedup table ----------------------------------------------------------------------------


def test_dedup_window_duplicates_and_expiry():
    t = DedupTable()
    for seq in (100, 102, 101):  # out of order is fine within the window
        assert t.check("w", seq) == "new"
        t.record("w", seq)
    assert [t.check("w", s) for s in (99, 100, 101, 102, 103)] == [
        "new",
        "duplicate",
        "duplicate",
        "duplicate",
        "new",
    ]
    t.record("w", 102 + WINDOW)  # a jump: the window behind it is kept below
    assert [t.check("w", s) for s in (99, 100, 103, 102 + WINDOW)] == [
        "new",
        "duplicate",
        "new",
        "duplicate",
    ]
    t.record("w", 103)  # the writes below the jump go on
    assert t.check("w", 103) == "duplicate" and t.check("w", 104) == "new"
    t.record("w", 102 + 3 * WINDOW)  # a second jump: the lowest window is forgotten
    assert t.check("w", 102) == "expired"  # below the windows: cannot tell, so refused
    assert t.check("w", 102 + WINDOW) == "duplicate"
    assert t.check("w", 102 + 2 * WINDOW) == "new"  # between the windows: never applied
    assert t.check("other", 100) == "new"


def test_dedup_matches_an_exact_model():
    """Random writes (runs, retries, jumps): a seq the table calls new was never applied, one
    it calls a duplicate was; also through export/load and merge."""
    rng = random.Random(7)
    for _ in range(30):
        t, applied, seq = DedupTable(), set(), rng.randrange(10**6)
        for _ in range(300):
            r = rng.random()
            if r < 0.02:
                s = seq + rng.choice([WINDOW, 3 * WINDOW, 10**12])  # a jump
            elif r < 0.3 and applied:
                s = rng.choice(sorted(applied))  # a retry
            else:
                seq += rng.randrange(1, 3 * WINDOW // 2 if rng.random() < 0.05 else 5)
                s = seq
            outcome = t.check("w", s)
            assert outcome != "new" or s not in applied, s
            assert outcome != "duplicate" or s in applied, s
            if outcome == "new":
                t.record("w", s)
                applied.add(s)
            if rng.random() < 0.05:
                t = DedupTable.load(json.loads(json.dumps(t.export())))
            if rng.random() < 0.05:
                t = DedupTable.merge([t, DedupTable()])


def test_dedup_export_load_and_merge():
    a, b = DedupTable(), DedupTable()
    a.record("w", 10)
    a.record("w", 12, [5, 2])
    b.record("w", 11)
    b.record("v", 3)
    back = DedupTable.load(json.loads(json.dumps(a.export())))
    assert back.check("w", 12) == "duplicate" and back.result("w", 12) == [5, 2]
    assert back.check("w", 11) == "new"
    merged = DedupTable.merge([a, b])
    assert [merged.check("w", s) for s in (10, 11, 12, 13)] == [
        "duplicate",
        "duplicate",
        "duplicate",
        "new",
    ]
    assert merged.check("v", 3) == "duplicate"
    with pytest.raises(ValueError):
        DedupTable.load({"window": 5, "workers": {"w": {"high": "x"}}})


def test_dedup_forgets_the_least_recently_seen_worker_past_its_bound():
    t = DedupTable(max_workers=2)
    for w in ("a", "b", "a", "c"):
        t.record(w, 1)
    assert t.check("a", 1) == "duplicate" and t.check("c", 1) == "duplicate"
    assert t.check("b", 1) == "new"
