"""Pull and push of one float32 variable: ``PSClient`` against one shard, next to a raw TCP
socket moving the same bytes, on loopback.

Per size, one variable is created with the ``Add`` optimizer (the shard adds the pushed tensor
to the value: the cheapest apply there is). Each repetition then does, in this order:

1. ``ps.push({name: zeros})`` — timed as a push. It returns when the shard has applied it, so
   it includes the shard's ``value += grad`` (one pass over the bytes) besides the transfer.
   Pushing zeros keeps the value as it was.
2. ``ps.pull([name])`` — timed as a pull. The push before it raised the variable's version,
   so the version the client holds is stale and the shard has to send the whole value: the
   SDK's version cache never short-cuts a timed pull, yet it is used exactly as in training.
3. the raw socket does the same: a push of the same array, then a pull of as many bytes.

Interleaving the two systems rep by rep lets both see the same background load. The first
``ctx.warmup`` repetitions of each size are not counted.
"""

from __future__ import annotations

import numpy as np

from .context import Context
from .rawsock import RawClient
from .timing import Stopwatch, reps_for, summarize

__all__ = ["DEFAULT_SIZES", "DESCRIPTION", "run"]

DESCRIPTION = ("one float32 variable, 1 shard on loopback; pull and push through PSClient vs "
               "a raw TCP socket")
DEFAULT_SIZES = (100_000, 1_000_000, 25_000_000)
SDK, RAW = "paramshard", "raw socket"


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient  # the SDK is what is measured: import it when running
    from client_sdk.optimizers import Add

    urls = ctx.shard_urls(1)
    host, port = ctx.raw_address()
    rows: list[dict] = []
    with PSClient(urls, worker_id="bench-transfer") as ps, RawClient(host, port) as raw:
        for n in ctx.sizes_for(DEFAULT_SIZES):
            name = f"bench/transfer/f32-{n}"
            value = np.random.default_rng(n).random(n, dtype=np.float32)
            grad = np.zeros(n, dtype=np.float32)
            nbytes = value.nbytes
            ps.init({name: value}, optimizer=Add())
            reps = reps_for(nbytes, ctx.reps, ctx.min_reps)
            timers = {(op, sys): Stopwatch() for op in ("pull", "push") for sys in (SDK, RAW)}
            last_version = None
            for i in range(ctx.warmup + reps):
                with timers["push", SDK]:
                    version = ps.push({name: grad})[name]["version"]
                with timers["pull", SDK]:
                    pulled = ps.pull([name])[name]
                with timers["push", RAW]:
                    raw.push(grad)
                with timers["pull", RAW]:
                    got = raw.pull(nbytes)
                if last_version is not None and version != last_version + 1:
                    raise RuntimeError(f"{name}: push {i} moved the version from {last_version} "
                                       f"to {version}; pulls may have been served from cache")
                last_version = version
                if pulled.shape != (n,) or pulled.dtype != np.float32 or got.nbytes != nbytes:
                    raise RuntimeError(f"{name}: pulled {pulled.dtype}{pulled.shape}, raw "
                                       f"{got.nbytes} bytes; expected float32 ({n},)")
                del pulled, got
            if not np.array_equal(ps.pull([name])[name], value):
                raise RuntimeError(f"{name}: value changed by pushing zeros through Add")
            for (op, system), sw in timers.items():
                rows.append({"case": "transfer", "op": op, "size": n, "dtype": "float32",
                             "system": system, "reference": system == RAW,
                             **summarize(sw.samples[ctx.warmup:], nbytes)})
    rows.sort(key=lambda r: (r["op"] != "pull", r["size"], not r["reference"]))
    return rows
