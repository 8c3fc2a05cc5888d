"""TensorFlow's gRPC parameter server, driven the way TF2's ParameterServerStrategy drives it.

The server is a ``tf.distribute.Server`` of job ``ps`` in its own process (:func:`serve`),
holding the variables. The driver process is task 0 of job ``worker``: it connects with
``tf.config.experimental_connect_to_cluster`` (which starts its own gRPC server, as every
TF worker has) and places each ``tf.Variable`` on ``/job:ps/task:0``.

* **pull** is a ``tf.function`` that reads the variables onto the worker's CPU and returns
  them; ``.numpy()`` of each result is the pulled array. All names of one call go in one
  function call (one step).
* **push** is a ``tf.function`` that runs ``assign_add`` on each variable (placed on the PS,
  so the gradient travels to the PS and is added there) and returns a constant made on the
  worker after them; fetching it waits until the PS has applied every update.

* **init_table / pull_rows / push_rows** (the rows case, :mod:`bench.rows`): the table is one
  ``[rows, dim]`` ``tf.Variable`` on the PS, filled there by a uniform initializer. A pull is
  a ``tf.function`` that makes the ids distinct on the worker (``tf.unique``), gathers those
  rows on the PS (``tf.nn.embedding_lookup``, which runs beside the variable) and expands
  them to the batch's order on the worker. A push sums the gradients of repeated ids on the
  worker (``tf.unique`` + ``unsorted_segment_sum``), then runs the sparse SGD update on the
  PS (``scatter_sub`` of ``lr * grad`` at those rows, an ``IndexedSlices`` update as TF's
  optimizers apply to embeddings) and returns a constant made after it. Both send each
  distinct row once, as paramshard's SDK does.

Both were measured against the alternatives (eager ``read_value().numpy()``, eager
``assign_add``; a TF1 graph ``Session`` against the same server): within noise of each other
for pulls, while eager remote ``assign_add`` returns before the PS has applied it, so it would
time nothing. Functions are traced once per list of names, outside the timing (the first,
untimed repetition).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from .. import processes

__all__ = ["Adapter", "serve"]

_PS = "/job:ps/replica:0/task:0/device:CPU:0"
_WORKER = "/job:worker/replica:0/task:0/device:CPU:0"


def _cluster(ps_port: int, worker_port: int):  # -> tf.train.ClusterSpec
    import tensorflow as tf

    return tf.train.ClusterSpec(
        {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]}
    )


def serve(argv: list[str]) -> None:
    """The PS process: ``serve([ps_port, worker_port])``; prints ``ready`` and serves until
    its stdin closes (or it is killed). Blocks."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    ps_port, worker_port = (int(a) for a in argv)
    server = tf.distribute.Server(
        _cluster(ps_port, worker_port), job_name="ps", task_index=0, protocol="grpc", start=True
    )
    print("ready", flush=True)
    sys.stdin.read()  # the server runs on its own threads until the process exits
    del server


class Adapter:
    """See :mod:`bench.peers`. Blocking; not thread-safe."""

    def __init__(self, logdir: Path) -> None:
        ps_port, worker_port = processes.free_port(), processes.free_port()
        log = logdir / "tf-ps.log"
        self._server = processes.spawn(
            [
                sys.executable,
                "-m",
                "bench.peers.driver",
                "serve",
                "tf",
                str(ps_port),
                str(worker_port),
            ],
            log,
            pipes=True,
            own_session=False,
        )
        self.server_pids = [self._server.pid]
        line = processes.LineReader(self._server, log, "TF parameter server").readline(240)
        if line != "ready":
            raise RuntimeError(f"TF parameter server said {line!r}")
        import tensorflow as tf

        self._tf = tf
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            _cluster(ps_port, worker_port), task_type="worker", task_id=0, rpc_layer="grpc"
        )
        tf.config.experimental_connect_to_cluster(
            resolver, job_name="worker", task_index=0, make_master_device_default=False
        )
        self._vars: dict[str, object] = {}
        self._pulls: dict[tuple[str, ...], object] = {}
        self._pushes: dict[tuple[str, ...], object] = {}
        self._tables: dict[str, tuple[object, object]] = {}

    def init(self, values: dict[str, np.ndarray]) -> None:
        tf = self._tf
        with tf.device(_PS):
            for name, value in values.items():
                self._vars[name] = tf.Variable(value, name=name.replace("/", "_"))

    def pull(self, names: list[str]) -> list[np.ndarray]:
        key = tuple(names)
        fn = self._pulls.get(key)
        if fn is None:
            variables = [self._vars[n] for n in names]
            tf = self._tf

            @tf.function
            def fn():
                with tf.device(_WORKER):
                    return [tf.identity(v) for v in variables]

            self._pulls[key] = fn
        return [t.numpy() for t in fn()]

    def push(self, grads: dict[str, np.ndarray]) -> None:
        key = tuple(grads)
        fn = self._pushes.get(key)
        if fn is None:
            variables = [self._vars[n] for n in grads]
            tf = self._tf

            @tf.function
            def fn(gs):
                for v, g in zip(variables, gs, strict=True):
                    v.assign_add(g, read_value=False)
                with tf.device(_WORKER):
                    return tf.constant(0)

            self._pushes[key] = fn
        fn([self._tf.convert_to_tensor(g) for g in grads.values()]).numpy()

    def init_table(self, name: str, rows: int, dim: int, lr: float = 0.01) -> None:
        tf = self._tf
        with tf.device(_PS):
            table = tf.Variable(
                tf.random.stateless_uniform([rows, dim], seed=[rows, dim]),
                name=name.replace("/", "_"),
            )
        ids_spec = tf.TensorSpec([None], tf.int64)

        @tf.function(input_signature=[ids_spec])
        def pull(ids):
            with tf.device(_WORKER):
                distinct, where = tf.unique(ids)
            got = tf.nn.embedding_lookup(table, distinct)
            with tf.device(_WORKER):
                return tf.gather(got, where)

        @tf.function(input_signature=[ids_spec, tf.TensorSpec([None, dim], tf.float32)])
        def push(ids, grads):
            with tf.device(_WORKER):
                distinct, where = tf.unique(ids)
                step = lr * tf.math.unsorted_segment_sum(grads, where, tf.size(distinct))
            table.scatter_sub(tf.IndexedSlices(step, distinct))
            with tf.device(_WORKER):
                return tf.constant(0)

        self._vars[name] = table
        self._tables[name] = (pull, push)

    def pull_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        return self._tables[name][0](ids).numpy()

    def push_rows(self, name: str, ids: np.ndarray, grads: np.ndarray) -> None:
        self._tables[name][1](ids, grads).numpy()

    def close(self) -> None:
        processes.stop(self._server, grace=5.0)
