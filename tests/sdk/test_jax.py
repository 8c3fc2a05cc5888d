"""client_sdk.jax: a pytree of parameters bound to a real 2-shard fleet.

The names a tree's paths give, the round trip (init, pull as jax arrays, push of a gradient
tree, applied by the shard's optimizer), the copies a pull and a push avoid (the pulled jax
array's buffer is the reply's; a background push of jax gradients allocates nothing
parameter-sized, counted with tracemalloc, which sees numpy's allocations), and the clear errors
for trees, leaves and prefixes that do not fit, with nothing sent.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from typing import NamedTuple

import numpy as np
import pytest

from client_sdk import BadRequestError, BadTensorError, PSClient
from client_sdk.optimizers import SGD, Adagrad
from tests.conftest import ROOT
from tests.helpers.names import fresh

jax = pytest.importorskip("jax")
jnp = jax.numpy

from client_sdk.jax import bind, leaf_names  # noqa: E402  (after the skip)


class Pair(NamedTuple):
    kernel: object
    bias: object


def mlp(seed: int = 0, hidden: int = 8) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {
        "layer1": {
            "kernel": jnp.asarray(rng.normal(size=(4, hidden)), jnp.float32),
            "bias": jnp.zeros(hidden, jnp.float32),
        },
        "layer2": Pair(jnp.asarray(rng.normal(size=(hidden, 2)), jnp.float32), np.zeros(2, "f4")),
    }


@pytest.fixture
def ps(fleet2):
    with PSClient(fleet2.urls, worker_id=fresh("w")) as client:
        yield client


def test_names_are_the_tree_paths_under_the_prefix():
    tree = {"layer2": [np.ones(1), (np.ones(2),)], "layer1": Pair(np.ones(3), np.ones(4))}
    assert leaf_names(tree, "m") == [
        "m/layer1/kernel",
        "m/layer1/bias",
        "m/layer2/0",
        "m/layer2/1/0",
    ]
    # A dict's insertion order does not matter, and a prefix's slashes are trimmed.
    again = {"layer1": Pair(np.ones(3), np.ones(4)), "layer2": [np.ones(1), (np.ones(2),)]}
    assert leaf_names(again, "/m/") == leaf_names(tree, "m")
    assert leaf_names({"params": {"Dense_0": {"kernel": np.ones(1)}}}) == ["params/Dense_0/kernel"]
    assert leaf_names(np.ones(3), "w") == ["w"]


def test_names_that_cannot_be_variables_are_refused_with_the_path():
    with pytest.raises(BadRequestError, match=r"\['a b'\].*rename its key"):
        leaf_names({"a b": np.ones(1)})
    with pytest.raises(BadRequestError, match="would both be variable 'a/b'"):
        leaf_names({"a/b": np.ones(1), "a": {"b": np.ones(1)}})
    with pytest.raises(BadRequestError, match="single array: give it a name as prefix"):
        leaf_names(np.ones(3))
    with pytest.raises(BadRequestError, match="prefix must be a str"):
        leaf_names({"a": np.ones(1)}, prefix=3)  # type: ignore[arg-type]


def test_bind_refuses_leaves_that_are_not_float_arrays(ps):
    with pytest.raises(BadTensorError, match=r"int32.*keep integer state"):
        bind(ps, {"w": np.ones(2, "f4"), "step": jnp.zeros((), jnp.int32)}, prefix="m")
    with pytest.raises(BadTensorError, match=r"bfloat16.*cast bfloat16 to float32"):
        bind(ps, {"w": jnp.ones(2, jnp.bfloat16)}, prefix="m")
    with pytest.raises(BadTensorError, match="is a float, not an array"):
        bind(ps, {"w": 0.5}, prefix="m")
    with pytest.raises(BadRequestError, match="no leaves"):
        bind(ps, {}, prefix="m")
    with pytest.raises(BadRequestError, match="optimizers given for names that are no leaf"):
        bind(ps, {"w": np.ones(2, "f4")}, prefix="m", optimizer={"m/v": SGD(lr=0.1)})


def test_init_pull_push_round_trip(ps):
    prefix = fresh("jx")
    params = mlp()
    model = bind(ps, params, prefix=prefix, optimizer=lambda n: SGD(lr=0.5 if "bias" in n else 1))
    created = model.init()
    assert all(r["created"] for r in created.values())
    assert model.names == tuple(leaf_names(params, prefix))
    model.wait_ready(timeout=10)

    pulled = model.pull()
    assert jax.tree_util.tree_structure(pulled) == jax.tree_util.tree_structure(params)
    for got, want in zip(jax.tree_util.tree_leaves(pulled), jax.tree_util.tree_leaves(params)):
        assert isinstance(got, jax.Array) and got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    grads = jax.tree_util.tree_map(jnp.ones_like, pulled)
    model.push(grads).result(timeout=30)  # async by default: a future
    model.flush()
    after = model.pull()
    step = {"kernel": 1.0, "bias": 0.5}
    for name, got, before in zip(
        model.names, jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(params)
    ):
        lr = step[name.rsplit("/", 1)[1]] if "layer1" in name or "bias" in name else 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(before) - lr, rtol=1e-6)
    summaries = {v["name"]: v for v in ps.variables() if v["name"].startswith(prefix)}
    assert {s["updates"] for s in summaries.values()} == {1}

    # A second worker binding the same model gets the first one's values (init keeps them).
    with PSClient(ps._core.settings.shards, worker_id=fresh("w")) as other:
        twin = bind(other, mlp(seed=1), prefix=prefix)
        assert not any(r["created"] for r in twin.init().values())
        for a, b in zip(jax.tree_util.tree_leaves(twin.pull()), jax.tree_util.tree_leaves(after)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # wait=True blocks and returns the shards' answers.
        answers = twin.push(grads, wait=True)
        assert {a["status"] for a in answers.values()} == {"applied"}


def test_a_pulled_leaf_is_the_reply_buffer_and_an_unchanged_one_the_same_array(ps):
    """A 1 MB variable (its reply above the SDK's 64 KB head buffer) becomes a jax array of the
    reply's own memory; pulled again unchanged, the same jax array comes back."""
    prefix = fresh("jx")
    big = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    model = bind(ps, {"big": big, "small": np.ones(3, "f4")}, prefix=prefix)
    model.init()
    first = model.pull()
    # the SDK's own pull returns its cached (unchanged) array: the one the binding wrapped
    view = ps.pull([f"{prefix}/big"])[f"{prefix}/big"]
    assert first["big"].unsafe_buffer_pointer() == view.ctypes.data
    np.testing.assert_array_equal(np.asarray(first["big"]), big)
    second = model.pull()
    assert second["big"] is first["big"] and second["small"] is first["small"]


def test_a_background_push_of_jax_gradients_copies_nothing(ps):
    """tracemalloc counts numpy's allocations: the push of 4 MB of jax gradients, sent and
    applied, allocates less than half of that (a copy of the gradient would be 4 MB; the SDK's
    own checks of a 4 MB push take up to 1 MB, in blocks)."""
    prefix = fresh("jx")
    model = bind(ps, {"w": np.zeros((1024, 1024), np.float32)}, prefix=prefix, optimizer=SGD(1.0))
    model.init()
    model.pull()
    grads = {"w": jnp.ones((1024, 1024), jnp.float32)}
    model.push(grads).result(timeout=30)  # warm: connections, plans
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        model.push(grads).result(timeout=30)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak
    np.testing.assert_array_equal(np.asarray(model.pull()["w"]), -2.0)


def test_a_tree_that_does_not_fit_is_refused_before_anything_is_sent(ps):
    prefix = fresh("jx")
    params = mlp()
    model = bind(ps, params, prefix=prefix, optimizer=SGD(lr=1.0))
    model.init()
    pulled = model.pull()
    ones = jax.tree_util.tree_map(jnp.ones_like, pulled)

    missing = {"layer1": ones["layer1"]}
    with pytest.raises(
        BadRequestError, match=r"no leaf at \['layer2'\]\.kernel, \['layer2'\]\.bias; pass"
    ):
        model.push(missing)
    extra = {**ones, "layer3": jnp.ones(2)}
    with pytest.raises(BadRequestError, match=r"one: extra leaves at \['layer3'\]; pass"):
        model.push(extra)
    as_dict = {**ones, "layer2": {"kernel": ones["layer2"].kernel, "bias": ones["layer2"].bias}}
    with pytest.raises(BadRequestError, match="tree is not the bound one"):
        model.push(as_dict)
    wrong_shape = {**ones, "layer1": {**ones["layer1"], "bias": jnp.ones(3)}}
    with pytest.raises(BadTensorError, match=r"layer1/bias has shape \[3\], its parameter \[8\]"):
        model.push(wrong_shape)
    ints = {**ones, "layer1": {**ones["layer1"], "bias": jnp.ones(8, jnp.int32)}}
    with pytest.raises(BadTensorError, match="int32"):
        model.push(ints)

    @jax.jit
    def inside(g):
        model.push(g)
        return g

    with pytest.raises(BadRequestError, match=r"traced value: call push outside jax.jit"):
        inside(ones)
    model.flush()
    assert {v["updates"] for v in ps.variables() if v["name"].startswith(prefix)} == {0}


def test_a_fleet_variable_of_another_shape_is_refused_on_pull(ps):
    prefix = fresh("jx")
    bind(ps, {"w": np.ones((2, 3), "f4")}, prefix=prefix).init()
    other = bind(ps, {"w": np.ones((3, 2), "f4")}, prefix=prefix)
    with pytest.raises(BadTensorError, match=r"fleet holds shape \[2, 3\].*another prefix"):
        other.pull()


def test_optimizer_per_leaf_by_function(ps):
    prefix = fresh("jx")
    model = bind(
        ps,
        mlp(),
        prefix=prefix,
        optimizer=lambda name: None if name.endswith("bias") else Adagrad(lr=0.1),
    )
    model.init()
    kinds = {v["name"]: v["optimizer"]["type"] for v in ps.variables() if prefix in v["name"]}
    assert kinds == {
        f"{prefix}/layer1/kernel": "adagrad",
        f"{prefix}/layer1/bias": "sgd",
        f"{prefix}/layer2/kernel": "adagrad",
        f"{prefix}/layer2/bias": "sgd",
    }


def test_importing_the_sdk_does_not_import_jax():
    code = "import sys, client_sdk, client_sdk.training; print('jax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
