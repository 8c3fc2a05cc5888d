"""Zero-copy in and out of the SDK, against a real 2-shard fleet: writes take anything numpy can
view without a copy (the buffer protocol, ``__array_interface__``, DLPack in host memory),
device tensors are refused saying to move them to the host, and ``pull(names, out={...})``
writes into the caller's buffers (plain and partitioned variables, ``wire_dtype``, both
clients), checking every buffer before it writes any.

"Without a copy" is read off the memory: the array the SDK sends shares the caller's memory
(``np.shares_memory``, a torch tensor's ``data_ptr``), and a buffer pulled into keeps its
address. A refused call is shown to change nothing by reading the variables back.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client_sdk import AsyncPSClient, BadRequestError, BadTensorError, PSClient, _args
from client_sdk._verbs.push import PushJob, merge_push
from client_sdk.optimizers import SGD
from client_sdk.placement import shard_for
from tests.helpers.names import fresh

torch = pytest.importorskip("torch")


def on_both(prefix: str) -> list[str]:
    """Two fresh names, one on each shard of a 2-shard fleet."""
    names: dict[int, str] = {}
    while len(names) < 2:
        name = fresh(prefix)
        names.setdefault(shard_for(name, 2), name)
    return [names[0], names[1]]


class Interface:
    """An object offering only ``__array_interface__`` (over an ndarray's memory)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.__array_interface__ = array.__array_interface__


class OnDevice:
    """A DLPack tensor that says it lives on a GPU (no GPU needed to be refused)."""

    def __dlpack__(self, stream=None):  # pragma: no cover - must never be called
        raise AssertionError("a device tensor was asked for its memory")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


def test_writes_view_dlpack_array_interface_and_buffers_without_a_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert _args.as_array("t", t).ctypes.data == t.data_ptr()
    base = np.arange(6, dtype=np.float64)
    assert np.shares_memory(_args.as_array("i", Interface(base)), base)
    raw = bytearray(np.arange(4, dtype=np.int32).tobytes())
    view = _args.as_array("m", memoryview(raw).cast("i"))
    view_before = view.copy()
    raw[0] = 99
    assert view[0] == 99 and view_before[0] == 0  # the caller's bytes, not a copy of them
    # a non-contiguous tensor is the one thing copied (into C order)
    assert np.array_equal(_args.as_array("tt", t.T), t.T.numpy())


def test_push_assign_and_init_take_torch_tensors_and_array_interfaces(fleet2):
    names = on_both("in")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init(
            {names[0]: torch.ones(3, 2), names[1]: Interface(np.zeros(5, np.float32))},
            optimizer=SGD(lr=1.0),
        )
        ps.push({names[0]: torch.full((3, 2), 0.5), names[1]: Interface(np.ones(5, np.float32))})
        got = ps.pull(names)
        assert np.array_equal(got[names[0]], np.full((3, 2), 0.5, np.float32))
        assert np.array_equal(got[names[1]], np.full(5, -1.0, np.float32))
        ps.assign({names[0]: torch.zeros(3, 2)})
        ps.push_async({names[1]: torch.ones(5)}).result(timeout=30)
        got = ps.pull(names)
        assert not got[names[0]].any() and np.array_equal(got[names[1]], np.full(5, -2.0))


def test_device_tensors_and_tensors_that_require_grad_are_refused_and_change_nothing(fleet2):
    name = fresh("dev")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({name: np.ones(4, np.float32)}, optimizer=SGD(lr=1.0))
        with pytest.raises(BadTensorError, match=r"cuda:0.*host") as info:
            ps.push({name: OnDevice()})
        assert info.value.details["device"] == "cuda:0"
        with pytest.raises(BadTensorError, match="cuda:0"):
            ps.push_async({name: OnDevice()})
        with pytest.raises(BadTensorError, match="detach"):
            ps.assign({name: torch.nn.Parameter(torch.zeros(4))})
        with pytest.raises(BadTensorError, match="numpy cannot view"):
            ps.push({name: torch.ones(4, dtype=torch.bfloat16)})
        assert np.array_equal(ps.pull([name])[name], np.ones(4, np.float32))


def test_pull_out_writes_into_the_callers_buffers_every_pull(fleet2):
    names = on_both("out")
    values = {names[0]: np.arange(6, dtype=np.float32).reshape(2, 3), names[1]: np.ones(4)}
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init(values, optimizer=SGD(lr=1.0))
        param = torch.zeros(2, 3)
        address = param.data_ptr()
        buf = np.zeros(4)
        got = ps.pull(names, out={names[0]: param, names[1]: buf})
        assert param.data_ptr() == address
        assert torch.equal(param, torch.from_numpy(values[names[0]]))
        assert np.array_equal(buf, values[names[1]])
        assert got[names[0]].ctypes.data == address and got[names[0]].flags.writeable
        assert got[names[1]] is buf
        # unchanged since (the shard sends nothing): the cached value is written again
        param.zero_()
        ps.pull(names, out={names[0]: param})
        assert torch.equal(param, torch.from_numpy(values[names[0]]))
        # changed: the new value
        ps.push({names[0]: np.ones((2, 3), np.float32)})
        ps.pull([names[0]], out={names[0]: param.numpy()})
        assert torch.equal(param, torch.from_numpy(values[names[0]] - 1))
        # a poll writes what changed
        ps.push({names[1]: np.ones(4)})
        ps.pull(names, newer_than="cached", timeout=10, out={names[1]: buf})
        assert np.array_equal(buf, np.zeros(4))


def test_bad_buffers_are_refused_before_anything_is_sent_and_nothing_is_written(fleet2):
    names = on_both("bad")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({n: np.ones((2, 2), np.float32) for n in names})
        good = np.full((2, 2), 7, np.float32)
        cases = [
            ({names[0]: good, names[1]: np.zeros((2, 3), np.float32)}, BadTensorError, r"\[2, 3\]"),
            ({names[0]: good, names[1]: np.zeros((2, 2))}, BadTensorError, "float64"),
            ({names[0]: good, names[1]: [[0, 0], [0, 0]]}, BadRequestError, "writable"),
            ({names[0]: good, fresh("other"): good}, BadRequestError, "not among"),
            ({names[0]: good, names[1]: np.zeros(4, "U1")}, BadTensorError, "dtype"),
        ]
        readonly = np.zeros((2, 2), np.float32)
        readonly.flags.writeable = False
        cases.append(({names[0]: good, names[1]: readonly}, BadRequestError, "read-only"))
        for out, error, match in cases:
            with pytest.raises(error, match=match):
                ps.pull(names, out=out)
            assert (good == 7).all(), out
        with pytest.raises(BadRequestError, match="dict"):
            ps.pull(names, out=[good])


def test_a_value_that_no_longer_fits_its_buffer_leaves_every_buffer_as_it_was(fleet2):
    names = on_both("remade")
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps, PSClient(fleet2.urls) as other:
        ps.init({n: np.ones(3, np.float32) for n in names})
        a, b = np.zeros(3, np.float32), np.zeros(3, np.float32)
        ps.pull(names, out={names[0]: a, names[1]: b})  # shapes known from here on
        a[:] = b[:] = 5
        other.delete([names[1]])
        other.init({names[1]: np.ones(4, np.float32)})  # made again, with another shape
        other.assign({names[1]: np.ones(4, np.float32)})  # (and version than the cached one)
        with pytest.raises(BadTensorError, match=r"\[4\]"):
            ps.pull(names, out={names[0]: a, names[1]: b})
        assert (a == 5).all() and (b == 5).all()


def test_pull_out_of_a_partitioned_variable_writes_its_parts_into_the_buffers_rows(fleet2):
    name = fresh("parts")
    value = np.arange(40, dtype=np.float32).reshape(10, 4)
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({name: value}, partitions=3)
        buf = torch.zeros(10, 4)
        ps.pull([name], out={name: buf})
        assert torch.equal(buf, torch.from_numpy(value))
        with pytest.raises(BadTensorError, match=r"\[10, 4\]"):
            ps.pull([name], out={name: np.zeros((9, 4), np.float32)})
    with PSClient(fleet2.urls, worker_id=fresh("w")) as fresh_client:  # layout not known yet
        buf = np.zeros((10, 4), np.float32)
        fresh_client.pull([name], out={name: buf})
        assert np.array_equal(buf, value)


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_pull_out_with_a_wire_dtype_writes_the_widened_values(fleet2, wire_dtype):
    pytest.importorskip("ml_dtypes")
    name = fresh("half")
    value = np.arange(-16, 16, dtype=np.float32) / 8  # exact in both half dtypes
    with PSClient(fleet2.urls, worker_id=fresh("w")) as ps:
        ps.init({name: value})
    with PSClient(fleet2.urls, worker_id=fresh("w"), wire_dtype=wire_dtype) as ps:
        buf = np.zeros(32, np.float32)
        ps.pull([name], out={name: buf})
        assert np.array_equal(buf, value)


def test_the_async_client_pulls_into_buffers_and_lends_its_gradients(fleet2):
    name = fresh("async")
    buf = np.zeros(3, np.float32)

    async def run():
        async with AsyncPSClient(fleet2.urls, worker_id=fresh("w")) as ps:
            await ps.init({name: np.ones(3, np.float32)}, optimizer=SGD(lr=1.0))
            await ps.pull([name], out={name: buf})
            assert (buf == 1).all()
            grad = np.full(3, 0.25, np.float32)
            await (await ps.push_async({name: grad}, copy=False))
            await ps.pull([name], out={name: buf})
            assert (buf == 0.75).all()

    asyncio.run(run())


def test_coalescing_never_adds_into_a_lent_gradient():
    lent = np.ones(3, np.float32)
    job = PushJob({"g": lent}, {}, 1, owned=False)
    merge_push(job, PushJob({"g": np.ones(3, np.float32)}, {}, 2, owned=True))
    assert (lent == 1).all() and (job.grads["g"] == 2).all()
    own = PushJob({"g": np.ones(3, np.float32)}, {}, 3, owned=True)
    mine = own.grads["g"]
    lent2 = np.ones(3, np.float32)
    merge_push(own, PushJob({"g": lent2}, {}, 4, owned=False))
    assert own.grads["g"] is mine and (mine == 2).all() and not own.owned
    merge_push(own, PushJob({"h": lent2}, {}, 5, owned=False))
    merge_push(own, PushJob({"h": np.ones(3, np.float32)}, {}, 6, owned=True))
    assert (lent2 == 1).all()
