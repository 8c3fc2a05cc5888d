"""Other systems that do a parameter server's job, measured next to paramshard (``--peers``).

Each peer is a small adapter of our own (one module here) that drives the peer the way its
users would, through its public API, and offers the same four calls:

``Adapter(logdir)``
    start the peer's server process(es) on free loopback ports and connect; blocks.
``init(values)``
    create float32 variables ``{name: ndarray}`` on the server.
``pull(names) -> list[ndarray]``
    fetch their current values into this process, as numpy arrays.
``push(grads)``
    send ``{name: ndarray}`` and return once the server has *applied* ``value += grad`` (the
    same apply as paramshard's ``Add`` optimizer), unless ``APPLIES`` is false.
``server_pids``
    the processes that do the server's work, for CPU accounting (may be empty).

plus ``serve(argv)`` for the server process when the peer needs one of ours. Adapters run in
a driver process each (:mod:`bench.peers.driver`), so TensorFlow, PyTorch and Ray never share
a process with each other or with the SDK, and each times its own calls.

The peers install from the ``peers`` extra into their own virtualenv (``make bench-peers``);
Redis also needs Debian's ``redis-server`` binary.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass

__all__ = ["PEERS", "PeerInfo", "missing", "parse_peers"]


@dataclass(frozen=True)
class PeerInfo:
    """A peer: where its adapter lives, how the table calls it, what it needs installed."""

    module: str
    label: str
    imports: tuple[str, ...] = ()
    binaries: tuple[str, ...] = ()


#: ``--peers`` name -> peer, in the order the table lists them.
PEERS: dict[str, PeerInfo] = {
    "tf": PeerInfo("bench.peers.tf_grpc", "TF gRPC PS", imports=("tensorflow",)),
    "torch": PeerInfo("bench.peers.torch_rpc", "PyTorch RPC", imports=("torch",)),
    "ray": PeerInfo("bench.peers.ray_actor", "Ray actor", imports=("ray",)),
    "redis": PeerInfo(
        "bench.peers.redis_kv", "Redis", imports=("redis",), binaries=("redis-server",)
    ),
}


def parse_peers(text: str) -> tuple[str, ...]:
    """``"all"`` or a comma-separated subset of :data:`PEERS`, returned in :data:`PEERS` order;
    raises ValueError naming the known ones otherwise."""
    if text.strip() == "all":
        return tuple(PEERS)
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in names if p not in PEERS]
    if unknown or not names:
        raise ValueError(f"unknown peer(s) {unknown or [text]}; known: all, {', '.join(PEERS)}")
    return tuple(p for p in PEERS if p in names)


def missing(names: tuple[str, ...]) -> list[str]:
    """What the given peers need but this environment lacks, one line each."""
    out = []
    for name in names:
        info = PEERS[name]
        out += [
            f"{name}: Python package {m!r} is not installed"
            for m in info.imports
            if importlib.util.find_spec(m) is None
        ]
        out += [
            f"{name}: program {b!r} is not on PATH"
            for b in info.binaries
            if shutil.which(b) is None
        ]
    return out
