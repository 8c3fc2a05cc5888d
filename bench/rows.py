"""Rows of an embedding table: ``pull_rows`` and ``push_rows`` of batches of ids, through 1 and
2 shards, next to a raw TCP socket moving the rows' bytes (and, with ``--peers tf``,
TensorFlow's gRPC parameter server doing the same lookup and sparse update).

A size is the table's row count (default 10^6); rows are :data:`DIM` float32 wide. Every
system first holds every row: paramshard's table is filled by pushing zero gradients to all
ids (rows come into being on first touch), TensorFlow's is one ``[rows, DIM]`` variable on the
PS. Each repetition ``i`` then takes :func:`batch` ``(rows, i)``: :data:`BATCH` ids, half of
them repeats (``BATCH / 2`` distinct ids, each drawn from the whole table, and as many more
drawn from those), the same ids for every system. In each repetition a system does:

1. a push of zero gradients for the batch's ids, timed as *push*. The table's optimizer is
   plain SGD: repeats are summed, then each distinct row moves by ``-lr * grad`` (zeros keep
   the rows as they were, which is checked at the end). It returns once the update is
   applied.
2. a pull of the batch's rows, timed as *pull*: ``[BATCH, DIM]`` float32 in the batch's
   order, repeats included.

*Reference*: the raw socket (:mod:`bench.rawsock`) pushing the ``[BATCH, DIM]`` gradient's
bytes and pulling as many (it sends no ids and looks nothing up). Rows/s is ``BATCH`` / the
median time (the table's ``ops/s`` times ``BATCH``), in the ``rows_per_s`` field of the JSON.
The systems take turns repetition by repetition in a rotating order, as in the transfer case.
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
from .transfer import RAW, rotated

__all__ = [
    "BATCH",
    "DEFAULT_SIZES",
    "DESCRIPTION",
    "DIM",
    "LR",
    "ONE_SHARD",
    "TWO_SHARDS",
    "batch",
    "run",
]

DIM = 64
BATCH = 4_096
LR = 0.01
#: ids a fill push carries (the table is filled before the timing)
FILL = 16_384
DEFAULT_SIZES = (1_000_000,)
DESCRIPTION = (
    f"embedding table of N rows x {DIM} float32, batches of {BATCH:,} ids (half repeats); "
    "pull_rows and push_rows (SGD) through 1 and 2 shards vs a raw TCP socket (and TF's PS)"
)
ONE_SHARD, TWO_SHARDS = "paramshard 1 shard", "paramshard 2 shards"


def batch(rows: int, i: int) -> np.ndarray:
    """The int64 ids of repetition ``i`` on a table of ``rows`` rows: ``min(BATCH, 2 * rows)``
    ids, half of them distinct ids drawn from ``range(rows)``, half drawn again from those,
    shuffled. A pure function of ``(rows, i)``, so every system (and every peer's process)
    gets the same batch; ``i`` is a repetition (0, 1, ...) or -1, the batch whose rows are
    read before and after the timing."""
    n = min(BATCH, 2 * rows)
    rng = np.random.default_rng([rows, i + 1])
    distinct = rng.choice(rows, n // 2, replace=False).astype(np.int64)
    ids = np.concatenate([distinct, distinct[rng.integers(0, distinct.size, n - distinct.size)]])
    rng.shuffle(ids)
    return ids


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient  # the SDK is what is measured: import it when running

    raw_server = ctx.raw()
    peers = [p for p in ctx.peers() if p.tables]
    rows: list[dict] = []
    with (
        PSClient(ctx.shard_urls(1), worker_id="bench-rows-1") as one,
        PSClient(ctx.shard_urls(2), worker_id="bench-rows-2") as two,
        RawClient(raw_server.host, raw_server.port) as raw,
    ):
        for n in ctx.sizes_for(DEFAULT_SIZES):
            rows += _one_size(ctx, n, {ONE_SHARD: one, TWO_SHARDS: two}, raw, peers)
    order = {s: k for k, s in enumerate([RAW, ONE_SHARD, TWO_SHARDS, *(p.label for p in peers)])}
    rows.sort(key=lambda r: (r["op"] != "pull", r["size"], order.get(r["system"], 99)))
    return rows


def _fill(ps: Any, name: str, n: int) -> None:
    zeros = np.zeros((FILL, DIM), dtype=np.float32)
    for start in range(0, n, FILL):
        ids = np.arange(start, min(n, start + FILL), dtype=np.int64)
        ps.push_rows(name, ids, zeros[: ids.size])


def _one_size(
    ctx: Context, n: int, clients: dict[str, Any], raw: RawClient, peers: Sequence[Peer]
) -> list[dict]:
    from client_sdk.optimizers import SGD

    name = f"bench/rows/{n}x{DIM}"
    for ps in clients.values():
        ps.create_table(name, DIM, optimizer=SGD(lr=LR), seed=n)
        _fill(ps, name, n)
    for peer in peers:
        peer.init_table(name, n, DIM)
    b = batch(n, 0).size
    grads = np.zeros((b, DIM), dtype=np.float32)
    nbytes = grads.nbytes
    probe = batch(n, -1)  # rows read before and after the timing: pushing zeros changes none
    before = {label: ps.pull_rows(name, probe) for label, ps in clients.items()}
    systems = [RAW, *clients, *(p.label for p in peers)]
    watches = {(op, s): Stopwatch() for op in ("push", "pull") for s in systems}

    def sdk_turn(label: str, i: int) -> None:
        ps, ids = clients[label], batch(n, i)
        with watches["push", label]:
            ps.push_rows(name, ids, grads)
        with watches["pull", label]:
            got = ps.pull_rows(name, ids)
        if got.shape != (b, DIM) or got.dtype != np.float32:
            raise RuntimeError(f"{label}: pulled {got.dtype}{got.shape}; expected float32 {b, DIM}")

    def raw_turn(i: int) -> None:
        with watches["push", RAW]:
            raw.push(grads)
        with watches["pull", RAW]:
            raw.pull(nbytes)

    def peer_turn(peer: Peer, i: int) -> None:
        watches["push", peer.label].samples.append(peer.push_rows(name, n, i))
        watches["pull", peer.label].samples.append(peer.pull_rows(name, n, i))

    turns = [
        raw_turn,
        *(functools.partial(sdk_turn, label) for label in clients),
        *(functools.partial(peer_turn, p) for p in peers),
    ]
    for i in range(ctx.warmup + reps_for(nbytes, ctx.reps, ctx.min_reps)):
        if i == ctx.warmup:
            for w in watches.values():
                w.samples.clear()
        for turn in rotated(turns, i):
            turn(i)
    for label, ps in clients.items():
        if not np.array_equal(ps.pull_rows(name, probe), before[label]):
            raise RuntimeError(f"{label}: rows changed by pushing zeros through SGD")
    if not np.array_equal(before[ONE_SHARD], before[TWO_SHARDS]):
        raise RuntimeError("1 and 2 shards gave different initial rows for the same ids")
    for peer in peers:
        peer.check_rows(name, n)
    out = []
    for (op, system), w in watches.items():
        row = {
            "case": "rows",
            "op": op,
            "size": n,
            "label": f"{n:,}x{DIM}",
            "ids": b,
            "system": system,
            "reference": system == RAW,
            **summarize(w.samples, nbytes),
        }
        row["rows_per_s"] = b * row["ops_per_s"]
        out.append(row)
    return out
