"""paramshard shard server: one shard of a fleet, as a FastAPI app on uvicorn.

    from server.app import create_app
    from server.config import ShardConfig
    app = create_app(ShardConfig(shard_index=0, num_shards=2, port=7100))

Run it with ``paramshard serve`` (``server/cli.py``). Modules: ``config`` (flags + env),
``store`` (variables and verbs, no HTTP), ``dedup`` (which writes each worker had applied),
``optim`` (optimizer math), ``persistence`` (snapshot files), ``durability`` (restore,
periodic and final snapshots), ``admission`` (restore/drain phases, bounded work, pauses),
``app`` (create_app, serving_app, error rendering, headers), ``routes_data`` (msgpack data
plane), ``fastpath`` (data-plane requests straight to their endpoints), ``protocol`` (uvicorn's
httptools protocol without its body copies), ``memory`` (big buffers reused from the heap),
``routes_checkpoint`` (fleet checkpoints), ``routes_inspect`` (JSON for people), ``reshard``
(offline resharding), ``cli`` (serve | up | demo | status | reshard).
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("paramshard")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
