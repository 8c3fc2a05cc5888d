"""Redis as a parameter store: one key per variable, its value the array's raw bytes.

The driver starts Debian's ``redis-server`` on a free loopback port (no persistence: no RDB
snapshots, no AOF) and talks to it with redis-py over one connection, replies parsed by
hiredis (the ``redis[hiredis]`` extra: several times quicker than redis-py's Python parser on
big replies):

* **pull**: ``GET`` for one name, ``MGET`` for several (one round trip); each reply becomes
  an array with ``np.frombuffer`` (no copy; read-only, as the SDK's are).
* **push**: ``SET`` / ``MSET`` of the gradients' own memory. Redis has no way to add a float
  vector to a stored one on the server, so its push *stores* and applies nothing
  (``APPLIES = False``; the table marks it): a Redis-backed parameter server would have to
  read, add and write back from a client, at least twice these bytes.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from .. import processes

__all__ = ["APPLIES", "Adapter"]

APPLIES = False


class Adapter:
    """See :mod:`bench.peers`. Blocking; not thread-safe."""

    def __init__(self, logdir: Path) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: apt-get install -y redis-server")
        port = processes.free_port()
        self._server = processes.spawn(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(logdir),
                "--daemonize",
                "no",
            ],
            logdir / "redis-server.log",
            own_session=False,
        )
        self.server_pids = [self._server.pid]
        # hiredis parses replies (a big GET is read into one buffer instead of being joined
        # from chunks); commands are packed by redis-py's own serializer, which sends a
        # memoryview argument as it is, where hiredis's packer would copy it into one bytes.
        from redis.connection import Encoder, PythonRespSerializer

        packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        self._db = redis.Redis(
            connection_pool=redis.ConnectionPool(
                host="127.0.0.1", port=port, socket_timeout=300, command_packer=packer
            )
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self._db.ping()
                break
            except redis.ConnectionError:
                if self._server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start:\n"
                        f"{processes.tail(logdir / 'redis-server.log')}"
                    ) from None
                time.sleep(0.05)

    def init(self, values: dict[str, np.ndarray]) -> None:
        self.push(values)

    def pull(self, names: list[str]) -> list[np.ndarray]:
        raw = [self._db.get(names[0])] if len(names) == 1 else self._db.mget(names)
        return [np.frombuffer(b, dtype=np.float32) for b in raw]

    def push(self, grads: dict[str, np.ndarray]) -> None:
        views = {n: memoryview(g).cast("B") for n, g in grads.items()}
        if len(views) == 1:
            ((name, view),) = views.items()
            self._db.set(name, view)
        else:
            self._db.mset(views)

    def close(self) -> None:
        self._db.close()
        processes.stop(self._server, grace=5.0)
