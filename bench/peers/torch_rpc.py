"""PyTorch RPC (TensorPipe backend) as a parameter server.

The server is rank 0 (``ps``) of a two-process RPC group in its own process (:func:`serve`);
the driver is rank 1. The variables are CPU tensors in a dict on the server; the driver calls
module-level functions there with ``rpc.rpc_sync``:

* **pull**: ``_ps_pull(names)`` returns the tensors (TensorPipe sends their storage);
  ``.numpy()`` of each (no copy) is the pulled array. All names of one call in one RPC.
* **push**: ``_ps_push({name: grad})`` runs ``value.add_(grad)`` for each; ``rpc_sync``
  returns once it has. The gradients are ``torch.from_numpy`` views (no copy).

TensorPipe is limited to its TCP transport and its basic channel (``_transports=["uv"]``,
``_channels=["basic"]``). Left to choose, it moves tensors between processes on one host
through shared memory or cross-memory attach, never through a socket; that is faster here
but is not what happens between two machines, which
is what every other system in the table is made to do over loopback. Both processes listen on
the loopback interface only (``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME``, set by the
driver).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .. import processes

__all__ = ["Adapter", "serve"]

#: name -> tensor, in the server process.
_STORE: dict = {}


def _ps_init(values: dict) -> None:
    _STORE.update(values)


def _ps_pull(names: list[str]) -> list:
    return [_STORE[n] for n in names]


def _ps_push(grads: dict) -> None:
    for name, grad in grads.items():
        _STORE[name].add_(grad)


def _options(port: int):  # -> rpc.TensorPipeRpcBackendOptions
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=300,
        _transports=["uv"],
        _channels=["basic"],
    )


def serve(argv: list[str]) -> None:
    """The server process: ``serve([port])``; joins the group as ``ps`` and serves until the
    driver shuts the group down. Blocks."""
    from torch.distributed import rpc

    (port,) = (int(a) for a in argv)
    rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=_options(port))
    rpc.shutdown()  # waits for the driver's shutdown


class Adapter:
    """See :mod:`bench.peers`. Blocking; not thread-safe."""

    def __init__(self, logdir: Path) -> None:
        port = processes.free_port()
        self._server = processes.spawn(
            [sys.executable, "-m", "bench.peers.driver", "serve", "torch", str(port)],
            logdir / "torch-ps.log",
            own_session=False,
        )
        self.server_pids = [self._server.pid]
        import torch
        from torch.distributed import rpc

        self._torch, self._rpc = torch, rpc
        rpc.init_rpc("worker", rank=1, world_size=2, rpc_backend_options=_options(port))
        self._up = True

    def init(self, values: dict[str, np.ndarray]) -> None:
        tensors = {n: self._torch.from_numpy(v.copy()) for n, v in values.items()}
        self._rpc.rpc_sync("ps", _ps_init, args=(tensors,))

    def pull(self, names: list[str]) -> list[np.ndarray]:
        return [t.numpy() for t in self._rpc.rpc_sync("ps", _ps_pull, args=(names,))]

    def push(self, grads: dict[str, np.ndarray]) -> None:
        from_numpy = self._torch.from_numpy
        self._rpc.rpc_sync("ps", _ps_push, args=({n: from_numpy(g) for n, g in grads.items()},))

    def close(self) -> None:
        if self._up:
            self._up = False
            self._rpc.shutdown()
        processes.stop(self._server, grace=10.0)
