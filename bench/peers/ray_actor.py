"""A Ray actor as a parameter server.

The driver process starts a one-node Ray cluster (``ray.init``; every Ray process listening on
127.0.0.1 only; no dashboard; a 2 GB object store; logs under the run's log directory) and one
actor that holds the variables as numpy arrays:

* **pull**: ``ray.get(actor.pull.remote(names))``. The actor returns the arrays; Ray puts
  big results into its object store (one copy) and the driver maps them from there without
  copying (read-only arrays, as the SDK's are).
* **push**: ``ray.get(actor.push.remote(grads))``. Ray puts big arguments into the object
  store (one copy); the actor reads them in place and runs ``value += grad``.

On one node Ray moves big objects through shared memory, not a socket: no system in the table
has that advantage over loopback, and across machines Ray's object manager would send the
bytes over gRPC instead. The actor's process is the server for CPU accounting; Ray's own
daemons (GCS, raylet with the object store) are not counted.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["Adapter"]

_OBJECT_STORE_BYTES = 2_000_000_000


class _Store:
    """The actor: name -> ndarray."""

    def __init__(self) -> None:
        self._values: dict[str, np.ndarray] = {}

    def pid(self) -> int:
        return os.getpid()

    def init(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            self._values[name] = value.copy()  # arguments arrive as read-only views

    def pull(self, names: list[str]) -> list[np.ndarray]:
        return [self._values[n] for n in names]

    def push(self, grads: dict[str, np.ndarray]) -> None:
        for name, grad in grads.items():
            self._values[name] += grad


class Adapter:
    """See :mod:`bench.peers`. Blocking; not thread-safe."""

    def __init__(self, logdir: Path) -> None:
        # A one-machine Ray: its daemons and workers listen on 127.0.0.1. (By default Ray
        # advertises the host's first non-loopback address, even when given 127.0.0.1.) Read
        # when ray is first imported.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        self._ray = ray
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=_OBJECT_STORE_BYTES,
            _temp_dir=str(logdir / "ray"),
            log_to_driver=False,
            logging_level="warning",
        )
        self._actor = ray.remote(_Store).remote()
        self.server_pids = [ray.get(self._actor.pid.remote())]

    def init(self, values: dict[str, np.ndarray]) -> None:
        self._ray.get(self._actor.init.remote(values))

    def pull(self, names: list[str]) -> list[np.ndarray]:
        return self._ray.get(self._actor.pull.remote(names))

    def push(self, grads: dict[str, np.ndarray]) -> None:
        self._ray.get(self._actor.push.remote(grads))

    def close(self) -> None:
        self._ray.shutdown()
