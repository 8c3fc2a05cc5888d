"""Many small variables in one step: 100 float32 variables of 1,000 elements (4 KB each)
pulled, and pushed, in one call, next to a raw TCP socket moving the same 400 KB in one message
(and, with ``--peers``, the peers, each in one call: TF one ``tf.function``, PyTorch one RPC,
Ray one actor call, Redis one ``MGET``/``MSET``).

This is the per-variable cost of a step: a model is many tensors, and a worker pulls and
pushes all of them every step. ``ops/s`` in the table is steps per second.

Two SDK rows: ``paramshard`` is the per-variable API (``ps.pull(names)``, ``ps.push({name:
grad})``), ``paramshard group`` a step group of the same variables (``g = ps.group(names)``
once; ``g.push(flat)`` of one flat gradient buffer, ``g.pull()`` into the group's own flat
buffer: :mod:`client_sdk.groups`). The goals against the raw socket judge the group: it is the
API a step of many small variables should use; the per-variable rows stay beside it.

As in :mod:`bench.transfer`, the variables use the ``Add`` optimizer and each repetition
pushes zeros to all 100 (timed as push), then pulls all 100 (timed as pull): the push made
every cached version stale, so every pull receives all 400 KB.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .context import Context
from .peers.driver import Peer
from .rawsock import RawClient
from .timing import Stopwatch, reps_for, summarize
from .transfer import RAW, SDK, push_label, rotated

__all__ = ["COUNT", "DEFAULT_SIZES", "DESCRIPTION", "GROUP", "run"]

#: The SDK through a step group (``ps.group(names)``).
GROUP = "paramshard group"

COUNT = 100
DESCRIPTION = (
    f"{COUNT} float32 variables in one step, 1 shard, per variable and as a step group (the "
    "goals' row); ops/s is steps/s; raw socket: the same bytes in one message"
)
DEFAULT_SIZES = (1_000,)


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient

    fleet = ctx.fleet(1)
    raw_server = ctx.raw()
    peers = ctx.peers()
    rows: list[dict] = []
    with (
        PSClient(fleet.urls, worker_id="bench-step") as ps,
        RawClient(raw_server.host, raw_server.port) as raw,
    ):
        for n in ctx.sizes_for(DEFAULT_SIZES):
            rows += _one_size(ctx, n, ps, raw, peers)
    rows.sort(key=lambda r: (r["op"] != "pull", r["size"], not r["reference"]))
    return rows


def _one_size(ctx: Context, n: int, ps: Any, raw: RawClient, peers: Sequence[Peer]) -> list[dict]:
    from client_sdk.optimizers import Add

    names = [f"bench/step/f32-{n}/v{i:03d}" for i in range(COUNT)]
    value = np.random.default_rng(n).random(n, dtype=np.float32)
    zeros = np.zeros(n, dtype=np.float32)
    grads = {name: zeros for name in names}
    flat = np.zeros(n * COUNT, dtype=np.float32)
    nbytes = flat.nbytes
    ps.init({name: value for name in names}, optimizer=Add())
    group = ps.group(names)
    for peer in peers:
        peer.init(names, n)
    systems = [SDK, GROUP, RAW, *(p.label for p in peers)]
    watches = {(op, s): Stopwatch() for op in ("push", "pull") for s in systems}

    def sdk_turn() -> None:
        with watches["push", SDK]:
            ps.push(grads)
        with watches["pull", SDK]:
            pulled = ps.pull(names)
        if len(pulled) != COUNT or any(v.shape != (n,) for v in pulled.values()):
            raise RuntimeError(f"pulled {len(pulled)} variables; expected {COUNT} of ({n},)")

    def group_turn() -> None:
        with watches["push", GROUP]:
            group.push(flat)
        with watches["pull", GROUP]:
            pulled = group.pull()
        if len(pulled) != COUNT or group.flat.nbytes != nbytes:
            raise RuntimeError(f"the group pulled {len(pulled)} variables; expected {COUNT}")

    def raw_turn() -> None:
        with watches["push", RAW]:
            raw.push(flat)
        with watches["pull", RAW]:
            raw.pull(nbytes)

    def peer_turn(peer: Peer) -> None:
        watches["push", peer.label].samples.append(peer.push(names))
        watches["pull", peer.label].samples.append(peer.pull(names))

    turns = [sdk_turn, group_turn, raw_turn, *(functools.partial(peer_turn, p) for p in peers)]
    for i in range(ctx.warmup + reps_for(nbytes, ctx.reps, ctx.min_reps)):
        if i == ctx.warmup:
            for w in watches.values():
                w.samples.clear()
        for turn in rotated(turns, i):
            turn()
    if not all(np.array_equal(v, value) for v in ps.pull(names).values()):
        raise RuntimeError("values changed by pushing zeros through Add")
    if not all(np.array_equal(v, value) for v in group.pull().values()):
        raise RuntimeError("the group pulled other values than were made")
    for peer in peers:
        peer.check(names)
    return [
        {
            "case": "step",
            "op": op,
            "size": n,
            "variables": COUNT,
            "label": f"{COUNT}x{n:,}",
            "system": push_label(system, peers) if op == "push" else system,
            "reference": system == RAW,
            **summarize(w.samples, nbytes),
        }
        for (op, system), w in watches.items()
    ]
