"""paramshard shard server: one shard of a fleet, as a FastAPI app on uvicorn.

    from server.app import create_app
    from server.config import ShardConfig
    app = create_app(ShardConfig(shard_index=0, num_shards=2, port=7100))

Run it with ``paramshard serve`` (``server/serve.py``). Modules: ``config`` (flags + env),
``store`` (package: variables, the verbs, applying updates, gradient checks, which writes each
worker had applied, big buffers reused from the heap; no HTTP), ``optim`` (optimizer math),
``persistence`` (package: snapshot files, a data dir's snapshots, restoring), ``durability``
(restore, periodic and final snapshots), ``admission`` (restore/drain phases, bounded work,
pauses), ``app`` (create_app, serving_app, error rendering, headers), ``routes_data`` (msgpack
data plane; ``routes_control``: set_optimizer and delete; ``routes_tables``: embedding tables),
``bodies`` (a request's body in, its reply out, without copies), ``direct_routes`` (data-plane
requests straight to their endpoints), ``httptools_protocol`` (uvicorn's httptools protocol
without its body copies), ``routes_checkpoint`` (fleet checkpoints), ``routes_inspect`` (JSON
for people), ``reshard`` (offline resharding). The command line: ``cli`` (the commands: serve |
up | demo | status | reshard | health | get), ``cli_args`` (their flags), ``serve`` (one shard
on uvicorn), ``launcher`` (shards as local processes), ``supervisor`` (``up``: a fleet kept
running), ``probes`` (``status``/``health``'s HTTP clients), ``demo`` (package: the demo and its
worker). A shard is one event loop and at most a worker thread or two: its BLAS (numpy's dot
products, the finiteness check) runs on one thread. OpenBLAS would otherwise start a thread per
core and keep them spinning after each call (several times the CPU of a small dot product
itself), taking cores from the shards and workers next to it. Importing this package sets
``OPENBLAS_NUM_THREADS=1`` unless the environment says otherwise; it takes effect if numpy was
not imported before (``paramshard serve`` imports this package first).
"""

from __future__ import annotations

import os
from importlib import metadata

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

try:
    __version__ = metadata.version("paramshard")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
