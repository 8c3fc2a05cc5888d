"""``client_sdk.torch.bind``: a torch module's parameters as a fleet's variables, against a real
2-shard fleet.

In place is read off the memory: a parameter's ``data_ptr()`` is the same after a pull, and
the values are those the fleet holds. A push is checked by what the shard did with it (SGD with
lr 1: the new value is the old minus the gradient) and by each ``.grad`` being handed over.
The errors are raised before anything is sent, which the variables read back show. One test
binds a ``torch.compile``d module (the eager backend: no C compiler involved) and one shows
that ``import client_sdk`` never loads torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from client_sdk import BadRequestError, BadTensorError, PSClient
from client_sdk.optimizers import SGD, Adagrad
from tests.conftest import ROOT
from tests.helpers.names import fresh

torch = pytest.importorskip("torch")
from client_sdk.torch import bind  # noqa: E402  (after the skip: it needs torch)


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def test_init_creates_if_absent_and_pull_refreshes_the_parameters_in_place(fleet2):
    prefix = fresh("t") + "/"
    first, second = mlp(0), mlp(1)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as a, PSClient(fleet2.urls) as b:
        bound_a = bind(a, first, prefix=prefix, optimizer=SGD(lr=1.0))
        assert bound_a.names == [prefix + n for n, _ in first.named_parameters()]
        bound_a.init()
        addresses = [p.data_ptr() for p in second.parameters()]
        bound_b = bind(b, second, prefix=prefix, optimizer=SGD(lr=1.0))
        bound_b.init()  # the first init won: b's module now holds a's values
        assert [p.data_ptr() for p in second.parameters()] == addresses
        for p, q in zip(first.parameters(), second.parameters()):
            assert torch.equal(p, q)
        fleet = b.pull(bound_b.names)
        for name, p in zip(bound_b.names, second.parameters()):
            assert np.array_equal(fleet[name], p.detach().numpy())


def test_push_hands_the_gradients_over_and_the_shards_apply_them(fleet2):
    prefix = fresh("t") + "/"
    model = mlp()
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        bound = bind(ps, model, prefix=prefix, optimizer=SGD(lr=1.0))
        bound.init()
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(5, 4)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        future = bound.push()
        assert all(p.grad is None for p in model.parameters())
        assert {r["status"] for r in future.result(timeout=30).values()} == {"applied"}
        bound.pull()
        for p, old, g in zip(model.parameters(), before, grads):
            assert torch.allclose(p, old - g)
        model(torch.ones(5, 4)).sum().backward()
        result = bound.push(wait=True)
        assert set(result) == set(bound.names)
        bound.flush()
        with pytest.raises(BadRequestError, match="backward"):
            bound.push()


def test_optimizers_per_parameter_group(fleet2):
    prefix = fresh("t") + "/"
    model = mlp()
    first, second = model[0], model[2]
    groups = [
        {"params": first.parameters(), "optimizer": SGD(lr=1.0)},
        {"params": second.parameters(), "optimizer": Adagrad(lr=0.5)},
    ]
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        bind(ps, model, prefix=prefix, optimizer=groups).init()
        found = {
            v["name"]: v["optimizer"]["type"]
            for v in ps.variables()
            if v.get("name", "").startswith(prefix)
        }
        assert found == {
            prefix + "0.weight": "sgd",
            prefix + "0.bias": "sgd",
            prefix + "2.weight": "adagrad",
            prefix + "2.bias": "adagrad",
        }
        with pytest.raises(BadRequestError, match="no optimizer given"):
            bind(ps, model, optimizer=groups[:1])
        with pytest.raises(BadRequestError, match="lacks"):
            bind(ps, model, optimizer={"3.weight": SGD(lr=1.0)})


def test_a_compiled_module_is_bound_through_its_parameters(fleet2):
    prefix = fresh("t") + "/"
    model = mlp()
    compiled = torch.compile(model, backend="eager")  # traced on its first call, not compiled
    x = torch.ones(2, 4)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        bound = bind(ps, compiled, prefix=prefix, optimizer=SGD(lr=1.0))
        assert bound.names == [prefix + n for n, _ in model.named_parameters()]
        assert all(a is b for a, b in zip(bound.params.values(), model.parameters()))
        bound.init()
        ps.assign({name: np.full(p.shape, 0.5, np.float32) for name, p in bound.params.items()})
        bound.pull()
        with torch.no_grad():
            assert torch.allclose(compiled(x), torch.full((2, 2), 0.5 + 0.5 * 3 * np.tanh(2.5)))


def test_batchnorm_statistics_follow_the_chief_or_stay_local(fleet2):
    prefix = fresh("bn") + "/"

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))

    chief_model, other_model, local_model = net(), net(), net()
    with PSClient(fleet2.urls, worker_id=fresh("w")) as a, PSClient(fleet2.urls) as b:
        chief = bind(
            a, chief_model, prefix=prefix, optimizer=SGD(lr=0.1), buffers="chief", chief=True
        )
        other = bind(b, other_model, prefix=prefix, optimizer=SGD(lr=0.1), buffers="chief")
        assert prefix + "1.running_mean" in chief.names
        chief.init()
        other.init()
        chief_model(torch.randn(8, 3) + 5).sum().backward()  # training mode: stats move
        chief.push(wait=True)
        other.pull()
        assert torch.equal(other_model[1].running_mean, chief_model[1].running_mean)
        assert other_model[1].num_batches_tracked.item() == 1
        local = bind(b, local_model, prefix=prefix, optimizer=SGD(lr=0.1))
        assert not any("running" in n for n in local.names)
        local.pull()
        assert not local_model[1].running_mean.any()  # its own, untouched


def test_tensors_the_sdk_cannot_use_in_place_are_refused_before_anything_is_sent(fleet2):
    prefix = fresh("bad") + "/"
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        with pytest.raises(BadTensorError, match=r"meta.*module\.cpu"):
            bind(ps, torch.nn.Linear(2, 2, device="meta"), prefix=prefix)
        lin = torch.nn.Linear(3, 2)
        lin.weight = torch.nn.Parameter(torch.ones(2, 3).T.contiguous().T)
        with pytest.raises(BadTensorError, match="not contiguous"):
            bind(ps, lin, prefix=prefix)
        with pytest.raises(BadTensorError, match="no numpy view"):
            bind(ps, torch.nn.Linear(2, 2, dtype=torch.bfloat16), prefix=prefix)
        odd = torch.nn.Module()
        odd.count = torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)
        with pytest.raises(BadTensorError, match="float"):
            bind(ps, odd, prefix=prefix)
        with pytest.raises(BadRequestError, match=r"torch\.nn\.Module"):
            bind(ps, [torch.ones(2)], prefix=prefix)  # type: ignore[arg-type]
        emb = torch.nn.Embedding(5, 2, sparse=True)
        bound = bind(ps, emb, prefix=prefix, optimizer=SGD(lr=1.0))
        bound.init()
        emb(torch.tensor([1])).sum().backward()
        with pytest.raises(BadTensorError, match="sparse"):
            bound.push()
        assert not [
            v for v in ps.variables() if v.get("name", "").startswith(prefix) and v["version"]
        ]


def test_a_parameter_replaced_after_binding_is_pulled_into_its_new_storage(fleet2):
    prefix = fresh("t") + "/"
    model = mlp()
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        bound = bind(ps, model, prefix=prefix, optimizer=SGD(lr=1.0))
        bound.init()
        expected = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.data = torch.zeros_like(p)  # new storage under the same parameter
        bound.pull()
        for p, e in zip(model.parameters(), expected):
            assert torch.equal(p, e)


def test_import_client_sdk_never_loads_torch():
    code = "import sys, client_sdk, client_sdk.client; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr
