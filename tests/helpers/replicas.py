"""A replica group of one shard index, as real processes on loopback: :func:`start_group`.

A static group (``--replica-group URL|URL|...``) needs every replica's URL before any starts,
so the ports are picked first: each is bound to port 0 by this process, noted and let go, and
the replicas are started on them. A port taken by something else in between makes a replica
fail to start; the whole group is then started again on new ports (a few times at most), so
the race costs a retry, never a failed test.

:class:`Group` is a :class:`tests.conftest.Fleet` whose every process serves the same shard
index (``--shard-index 0 --num-shards 1`` unless told otherwise): ``urls[0]`` is the primary,
the others its backups; ``kill(i)``, ``stop(i)`` and ``start(i)`` act on one replica;
``data=True`` gives each a data dir of its own; ``prelude=CODE`` runs CODE in each replica
before it serves (as :class:`tests.conftest.Fleet` does).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from server.launcher import LaunchError
from tests.conftest import Fleet, http_json

__all__ = ["Group", "cluster", "free_ports", "start_group"]

ATTEMPTS = 4


class Group(Fleet):
    """Replicas of one shard index (module docstring)."""

    def __init__(
        self,
        n: int,
        workdir: Path,
        ports: list[int],
        extra_args: tuple[str, ...] = (),
        shard: tuple[int, int] = (0, 1),
        env: dict[str, str] | None = None,
        data: bool = False,
        prelude: str = "",
    ) -> None:
        self.shard = shard
        scheme = "https" if "--tls-cert" in extra_args else "http"
        self.group_urls = [f"{scheme}://127.0.0.1:{p}" for p in ports]
        group = "|".join(self.group_urls)
        self._fixed_ports = ports
        super().__init__(
            n, workdir, ("--replica-group", group, *extra_args), env, data, prelude=prelude
        )

    def serve_args(self, i: int) -> list[str]:
        args = super().serve_args(i)
        args[args.index("--shard-index") + 1] = str(self.shard[0])
        args[args.index("--num-shards") + 1] = str(self.shard[1])
        args[args.index("--port") + 1] = str(self._fixed_ports[i])
        return [*args, "--advertise-url", self.group_urls[i]]


def free_ports(n: int) -> list[int]:
    """``n`` ports free a moment ago (module docstring: the caller retries on new ones when one
    was taken in between), for groups whose replicas must know each other's URLs."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_group(workdir: Path, n: int = 2, *extra_args: str, **kwargs: Any) -> Group:
    """``n`` replicas of one shard index, started and answering (module docstring)."""
    error: Exception | None = None
    for attempt in range(ATTEMPTS):
        where = workdir / f"group{attempt}"
        where.mkdir(parents=True, exist_ok=True)
        try:
            return Group(n, where, free_ports(n), tuple(extra_args), **kwargs)
        except LaunchError as exc:
            error = exc
    raise AssertionError(f"a replica group did not start in {ATTEMPTS} attempts: {error}")


def cluster(url: str) -> dict[str, Any]:
    """A replica's ``GET /v1/cluster`` ``replication``."""
    return http_json(url + "/v1/cluster")["replication"]
