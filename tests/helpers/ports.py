"""Loopback ports for tests, without the race of finding a free port and letting it go.

A port found free, closed, and used later may be taken in between by anything else on the
machine (another test run, a shard of another fleet). A server a test starts binds port 0 in
the process that serves and reports the port it got (tests/helpers/dropproxy.py, the scripted
servers of tests/sdk/test_http_pools.py, the shards' own ``--port 0``). For a port where nothing
listens, :func:`refused_port` holds one for the test's duration instead.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

__all__ = ["refused_port"]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections for the duration of the block: bound by this
    process and not listening, so nobody else can start listening on it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
