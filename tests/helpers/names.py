"""Variable names for tests on a shared fleet: fresh ones (unique per call, so tests sharing a
fleet never meet), and ones placed on chosen shards by :func:`client_sdk.placement.shard_for`
(a shard refuses its part of a request whole while the others apply theirs, so where names land
decides what a test sees).
"""

from __future__ import annotations

import uuid

from client_sdk.placement import shard_for


def fresh(prefix: str = "v") -> str:
    """A name no other call returns: ``prefix`` and 10 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def spread(run: str, num_shards: int, each: int = 2) -> list[str]:
    """Names under ``run/``, ``each`` on every one of ``num_shards`` shards."""
    names: list[str] = []
    for i in range(1000):
        name = f"{run}/layer{i}"
        if sum(shard_for(n, num_shards) == shard_for(name, num_shards) for n in names) < each:
            names.append(name)
        if len(names) == each * num_shards:
            return names
    raise AssertionError("placement left a shard without names")


def beside(name: str, prefix: str, num_shards: int) -> str:
    """A fresh name under ``prefix`` on ``name``'s shard."""
    home = shard_for(name, num_shards)
    for _ in range(1000):
        candidate = fresh(prefix)
        if shard_for(candidate, num_shards) == home:
            return candidate
    raise AssertionError(f"no name under {prefix!r} on shard {home} of {num_shards}")
