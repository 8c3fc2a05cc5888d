"""Every optimizer on real shard processes: what a fleet computes is what the references compute.

The references and the cases are tests/shard/test_optimizers.py's (plain float64 numpy from the
published algorithms). Here workers push through the SDK to shard processes, which apply each
gradient as the optimizer's next step: the values pulled back are within 1e-9 of the reference
in float64, and the same bits as ``server.optim.apply`` run in this process on the same
gradients, in float64 and float32, on the event loop and, for a push big enough, off it. A
shard stopped with SIGTERM and started again on its data dir, or a checkpoint resharded onto
another number of shards, goes on with the same slots and step counts: the trajectory continues
as if nothing had happened. A bad optimizer is refused whole, naming the field.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx2
import numpy as np
import pytest

from client_sdk import PSClient, wire
from client_sdk.optimizers import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Cosine,
    ExponentialDecay,
    Ftrl,
    Optimizer,
    RMSprop,
    StepDecay,
)
from client_sdk.placement import shard_for
from server.store.apply import OFFLOAD_BYTES
from tests.helpers.reshard import reshard
from tests.shard.test_optimizers import CASES, relative_error, run_in_place, run_reference

STEPS = 20


def _fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _grads(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any, n: int) -> list:
    return [(rng.standard_normal(shape) * rng.uniform(0.2, 1.5)).astype(dtype) for _ in range(n)]


def _local(opt: Optimizer, w0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """``server.optim.apply`` in this process, step by step, as a shard applies a push."""
    return run_in_place(opt, w0, grads, scratch=True)[0]


def _summaries(ps: PSClient) -> dict[str, dict]:
    return {s["name"]: s for s in ps.variables()}


def test_every_optimizer_on_a_fleet_follows_the_reference(fleet2):
    rng = np.random.default_rng(5)
    runs: dict[str, tuple[Optimizer, np.ndarray, list[np.ndarray]]] = {}
    for i, opt in enumerate(CASES):
        for dtype in (np.float64, np.float32):
            w0 = rng.standard_normal((8, 16)).astype(dtype)
            runs[_fresh(f"{type(opt).__name__}{i}-{np.dtype(dtype).str[1:]}")] = (
                opt,
                w0,
                _grads(rng, w0.shape, dtype, STEPS),
            )
    with PSClient(fleet2.urls, worker_id=_fresh("w")) as ps:
        for name, (opt, w0, _) in runs.items():
            ps.init({name: w0}, optimizer=opt)
        for k in range(STEPS):  # one push per step, every variable in it
            ps.push({name: grads[k] for name, (_, _, grads) in runs.items()})
        pulled = ps.pull(list(runs))
        shown = _summaries(ps)
    for name, (opt, w0, grads) in runs.items():
        np.testing.assert_array_equal(pulled[name], _local(opt, w0, grads), err_msg=name)
        if w0.dtype == np.float64:
            want = run_reference(opt, w0, grads)[0]
            assert relative_error(pulled[name], want) <= 1e-9, name
        assert shown[name]["steps"] == STEPS and shown[name]["updates"] == STEPS
        assert shown[name]["optimizer"] == opt.to_wire(), name


@pytest.mark.parametrize(
    "opt",
    [
        Adam(lr=0.01, amsgrad=True, clip_norm=100.0),
        SGD(lr=0.01, momentum=0.9, nesterov=True),
        Ftrl(lr=0.1, l1=0.01),
    ],
    ids=lambda o: type(o).__name__,
)
def test_a_big_push_applied_off_the_event_loop_gives_the_same_bits(fleet2, opt):
    """16 MiB of gradient is applied in a worker thread, into fresh buffers for an optimizer
    with slots, a block at a time: the same bits as on the loop."""
    rng = np.random.default_rng(6)
    n = OFFLOAD_BYTES // 4
    w0 = rng.standard_normal(n, dtype=np.float32)
    grads = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
    name = _fresh("big")
    with PSClient(fleet2.urls, worker_id=_fresh("w")) as ps:
        ps.init({name: w0}, optimizer=opt)
        for g in grads:
            ps.push({name: g})
            ps.pull([name])  # a reader holds the value between pushes
        got = ps.pull([name])[name]
        assert _summaries(ps)[name]["steps"] == 3
    np.testing.assert_array_equal(got, _local(opt, w0, grads))


#: Optimizers whose every slot, and step count, changes the trajectory.
STATEFUL = [
    Adam(lr=0.01, amsgrad=True),
    AdamW(lr=0.01, schedule=StepDecay(every=3, gamma=0.5)),
    SGD(lr=0.05, momentum=0.9, dampening=0.3, schedule=Cosine(total=8, warmup=2, min_lr=0.001)),
    RMSprop(lr=0.01, centered=True, momentum=0.5),
    Adagrad(lr=0.1, lr_decay=0.1),
    Ftrl(lr=0.1, l1=0.01, schedule=ExponentialDecay(gamma=0.9)),
]


def _stateful_run(rng: np.random.Generator, steps: int) -> dict[str, tuple]:
    out = {}
    for i, opt in enumerate(STATEFUL):
        w0 = rng.standard_normal((6, 5)).astype(np.float32)
        out[f"{type(opt).__name__.lower()}{i}"] = (
            opt,
            w0,
            _grads(rng, w0.shape, np.float32, steps),
        )
    return out


def test_sigterm_and_restart_keep_the_slots_and_the_step_count(fleet_factory):
    fleet = fleet_factory(2, "--snapshot-interval", "0", data=True)  # only the final snapshot
    runs = _stateful_run(np.random.default_rng(7), 10)
    with PSClient(fleet.urls, worker_id="t") as ps:
        for name, (opt, w0, _) in runs.items():
            ps.init({name: w0}, optimizer=opt)
        for k in range(5):
            ps.push({name: grads[k] for name, (_, _, grads) in runs.items()})
        for i in range(2):
            assert fleet.stop(i) == 0  # SIGTERM: a final snapshot, then exit 0
            fleet.start(i)
        assert all(s["steps"] == 5 for s in _summaries(ps).values())
        for k in range(5, 10):
            ps.push({name: grads[k] for name, (_, _, grads) in runs.items()})
        pulled = ps.pull(list(runs))
        assert all(s["steps"] == 10 for s in _summaries(ps).values())
    for name, (opt, w0, grads) in runs.items():
        np.testing.assert_array_equal(pulled[name], _local(opt, w0, grads), err_msg=name)


def test_a_resharded_checkpoint_keeps_the_slots_and_the_step_count(fleet_factory, tmp_path):
    fleet = fleet_factory(2, "--snapshot-interval", "0", data=True)
    runs = _stateful_run(np.random.default_rng(8), 8)
    with PSClient(fleet.urls, worker_id="t") as ps:
        for name, (opt, w0, _) in runs.items():
            ps.init({name: w0}, optimizer=opt)
        for k in range(4):
            ps.push({name: grads[k] for name, (_, _, grads) in runs.items()})
        ps.checkpoint()
    for i in range(2):
        fleet.stop(i)
    _, dirs = reshard(fleet.data_dirs, tmp_path / "three", 3)
    fleet3 = fleet_factory(3, data_dirs=dirs)
    with PSClient(fleet3.urls, worker_id="t3") as ps:
        assert all(s["steps"] == 4 for s in _summaries(ps).values())
        for k in range(4, 8):
            ps.push({name: grads[k] for name, (_, _, grads) in runs.items()})
        pulled = ps.pull(list(runs))
    for name, (opt, w0, grads) in runs.items():
        np.testing.assert_array_equal(pulled[name], _local(opt, w0, grads), err_msg=name)


# -- bad optimizers ------------------------------------------------------------------------------


def _post(url: str, verb: str, msg: dict) -> tuple[int, Any]:
    enc = wire.encode(msg)
    r = httpx2.post(
        f"{url}/v1/{verb}",
        content=enc.join(),
        headers={"content-type": enc.content_type},
        timeout=30,
    )
    return r.status_code, wire.unpack(bytearray(r.content), r.headers["content-type"])


@pytest.mark.parametrize(
    "spec, dtype, field",
    [
        ({"type": "sgd", "momentun": 0.9}, "<f4", "optimizer.momentun"),
        ({"type": "sgd", "lr": -0.1}, "<f4", "optimizer.lr"),
        ({"type": "sgd", "nesterov": True}, "<f4", "optimizer.nesterov"),
        ({"type": "sgd", "momentum": 0.9, "nesterov": 1}, "<f4", "optimizer.nesterov"),
        ({"type": "adam", "betas": [0.9, 1.0]}, "<f4", "optimizer.betas[1]"),
        ({"type": "rmsprop", "alpha": -0.5}, "<f4", "optimizer.alpha"),
        ({"type": "ftrl", "learning_rate_power": 0.5}, "<f4", "optimizer.learning_rate_power"),
        ({"type": "adamax"}, "<f4", "optimizer.type"),
        (
            {"type": "adam", "schedule": {"type": "cosine", "total": 10, "warmup": 20}},
            "<f4",
            "optimizer.schedule.warmup",
        ),
        ({"type": "sgd", "schedule": {"type": "step"}}, "<f4", "optimizer.schedule.every"),
        (
            {"type": "sgd", "schedule": {"type": "cosine", "total": 1e3}},
            "<f4",
            "optimizer.schedule.total",
        ),
        ({"type": "adam"}, "<f2", "optimizer.epsilon"),  # 1e-8 is 0 in float16
    ],
)
def test_a_bad_optimizer_is_refused_naming_the_field_and_nothing_is_created(
    fleet2, spec, dtype, field
):
    good, bad = _on_shard_0("good"), _on_shard_0("bad")
    msg = {
        "variables": {
            good: {"value": np.zeros(3, dtype), "optimizer": {"type": "adam", "epsilon": 1e-3}},
            bad: {"value": np.zeros(3, dtype), "optimizer": spec},
        }
    }
    status, reply = _post(fleet2.urls[0], "init", msg)
    assert status == 400, reply
    error = reply["error"]
    assert error["code"] == "bad_request"
    assert error["details"] == {"variable": bad, "field": field}, error
    assert field.split(".")[-1].split("[")[0] in error["message"]
    with PSClient(fleet2.urls, worker_id=_fresh("w")) as ps:
        names = {s["name"] for s in ps.variables()}
    assert good not in names and bad not in names


def _on_shard_0(prefix: str) -> str:
    while shard_for(name := _fresh(prefix), 2) != 0:
        pass
    return name
