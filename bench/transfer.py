"""Pull and push of one float32 variable: ``PSClient`` against one shard, over http and over
https (TLS, a certificate made for the run), next to a raw TCP socket moving the same bytes
(and, with ``--peers``, the peers), on loopback.

Per size, one variable is created with the ``Add`` optimizer (the shard adds the pushed tensor
to the value: the cheapest apply there is). In each repetition the SDK does:

1. ``ps.push({name: zeros})`` — timed as a push. It returns when the shard has applied it, so
   it includes the shard's ``value += grad`` (one pass over the bytes) besides the transfer.
   Pushing zeros keeps the value as it was.
2. ``ps.pull([name])`` — timed as a pull. The push before it raised the variable's version,
   so the version the client holds is stale and the shard has to send the whole value: the
   SDK's version cache never short-cuts a timed pull, yet it is used exactly as in training.

The raw socket does the same (a push of the same array, then a pull of as many bytes),
and each peer too, through its driver (:mod:`bench.peers.driver`), which times it. So do two
more clients, made with ``wire_dtype="float16"`` and ``"bfloat16"`` (:data:`SDK_F16`,
:data:`SDK_BF16`), each on a float32 variable of its own beside the first: it travels in half
precision both ways, its MB/s counted in the float32 bytes delivered.

Two more pull rows take the fresh array out of the measure: :data:`SDK_OUT` and
:data:`SDK_F16_OUT` pull (float32, float16) into an ``out=`` buffer of their own, made once,
each on a variable of its own. A pull into a new array pays the allocator for 100 MB of fresh
pages whatever travels on the wire; into ``out=`` only the transfer and the widening are left.
Their turns push too (untimed: the same push the other rows time), so that every pull sends the
whole value.

Interleaving the systems rep by rep lets all see the same background load; the order of the
turns rotates from one repetition to the next. The first ``ctx.warmup`` repetitions of each
size are not counted.

Around every timed call the server's CPU time is read from ``/proc`` (:mod:`bench.cpu`), so
each row also says how many CPU-seconds the server spent per GB it sent or received, and this
process's own (``client_cpu_ms``: per call, every thread, as :func:`time.process_time` counts).

The same repetitions run over a rate-limited link between two network namespaces in
:mod:`bench.link` (:func:`one_size` with its own clients).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from .context import Context
from .cpu import CpuMeter
from .peers.driver import Peer
from .rawsock import RawClient
from .timing import Stopwatch, reps_for, summarize

__all__ = [
    "DEFAULT_SIZES",
    "DESCRIPTION",
    "RAW",
    "SDK",
    "SDK_BF16",
    "SDK_BF16_OUT",
    "SDK_F16",
    "SDK_F16_OUT",
    "SDK_OUT",
    "SDK_TLS",
    "cpu_fields",
    "one_size",
    "push_label",
    "rotated",
    "run",
]

DESCRIPTION = (
    "one float32 variable, 1 shard on loopback; pull and push+apply through PSClient "
    "over http and https vs a raw TCP socket (and peers)"
)
DEFAULT_SIZES = (1_000, 100_000, 1_000_000, 10_000_000, 25_000_000)
SDK, RAW = "paramshard", "raw socket"
#: The same SDK and shard over https (TLS with a certificate made for the run).
SDK_TLS = "paramshard https"
#: The SDK with ``wire_dtype`` (client_sdk/wire/halves.py), by the dtype it pulls and pushes in.
SDK_F16, SDK_BF16 = "paramshard float16", "paramshard bfloat16"
#: Pulls into an ``out=`` buffer made once (pull rows only; their pushes are not timed).
SDK_OUT, SDK_F16_OUT, SDK_BF16_OUT = "out= float32", "out= float16", "out= bfloat16"
#: The variable each client pulls (the suffix of the float32 variable's name).
_OWN = {
    SDK_F16: "float16",
    SDK_BF16: "bfloat16",
    SDK_OUT: "out",
    SDK_F16_OUT: "float16-out",
    SDK_BF16_OUT: "bfloat16-out",
}


#: The out= systems: pull only.
_OUT = (SDK_OUT, SDK_F16_OUT, SDK_BF16_OUT)

T = TypeVar("T")


def rotated(items: Sequence[T], i: int) -> list[T]:
    """``items`` starting at position ``i`` (mod its length): in repetition ``i`` the systems
    take their turns in this order, so none always goes first or right after another."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


class _Series:
    """The samples and server CPU of one (op, system) at one size."""

    def __init__(self, server_pids: list[int]) -> None:
        self.watch = Stopwatch()
        self.cpu = CpuMeter(server_pids)
        self.client_cpu: float | None = None

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        t0 = time.process_time()
        with self.cpu, self.watch:
            yield
        self.client_cpu = (self.client_cpu or 0.0) + time.process_time() - t0

    def add(self, seconds: float) -> None:
        self.watch.samples.append(seconds)

    def forget_warmup(self) -> None:
        self.watch.samples.clear()
        if self.cpu.seconds is not None:
            self.cpu.seconds = 0.0
        if self.client_cpu is not None:
            self.client_cpu = 0.0


def cpu_fields(cpu_seconds: float | None, nbytes: int, reps: int) -> dict:
    """``server_cpu_s``, ``server_gb`` and ``server_cpu_s_per_gb`` of a row (``None`` where
    the CPU time could not be read)."""
    gb = nbytes * reps / 1e9
    return {
        "server_cpu_s": cpu_seconds,
        "server_gb": gb,
        "server_cpu_s_per_gb": cpu_seconds / gb if cpu_seconds is not None and gb else None,
    }


def push_label(system: str, peers: Sequence[Peer]) -> str:
    """How a push row names ``system``: a peer whose push cannot apply says so."""
    peer = next((p for p in peers if p.label == system), None)
    return f"{system} (no apply)" if peer is not None and not peer.applies else system


def run(ctx: Context) -> list[dict]:
    from client_sdk import PSClient  # the SDK is what is measured: import it when running

    fleet = ctx.fleet(1)
    tls_fleet, ca = ctx.tls_fleet()
    raw_server = ctx.raw()
    peers = ctx.peers()
    rows: list[dict] = []
    with (
        PSClient(fleet.urls, worker_id="bench-transfer") as ps,
        PSClient(tls_fleet.urls, worker_id="bench-transfer-tls", verify=ca) as tls,
        PSClient(fleet.urls, worker_id="bench-transfer-f16", wire_dtype="float16") as f16,
        PSClient(fleet.urls, worker_id="bench-transfer-bf16", wire_dtype="bfloat16") as bf16,
        RawClient(raw_server.host, raw_server.port) as raw,
    ):
        pids = {
            SDK: fleet.pids,
            SDK_TLS: tls_fleet.pids,
            SDK_F16: fleet.pids,
            SDK_BF16: fleet.pids,
            SDK_OUT: fleet.pids,
            SDK_F16_OUT: fleet.pids,
            RAW: [raw_server.pid],
            **{p.label: p.server_pids for p in peers},
        }
        for n in ctx.sizes_for(DEFAULT_SIZES):
            clients = {
                SDK: ps,
                SDK_TLS: tls,
                SDK_F16: f16,
                SDK_BF16: bf16,
                SDK_OUT: ps,
                SDK_F16_OUT: f16,
            }
            rows += one_size(ctx, n, clients, raw, peers, pids)
    systems = [
        RAW,
        SDK,
        SDK_OUT,
        SDK_TLS,
        SDK_F16,
        SDK_F16_OUT,
        SDK_BF16,
        *(p.label for p in peers),
    ]
    order = {system: k for k, system in enumerate(systems)}
    rows.sort(
        key=lambda r: (
            r["op"] != "pull",
            r["size"],
            order.get(r["system"].removesuffix(" (no apply)"), 99),
        )
    )
    return rows


def one_size(
    ctx: Context,
    n: int,
    clients: dict[str, Any],
    raw: RawClient,
    peers: Sequence[Peer],
    pids: dict[str, list[int]],
    case: str = "transfer",
) -> list[dict]:
    """The rows of one size: each of ``clients`` (system -> its ``PSClient``; the out= systems
    pull into buffers, the others push and pull), ``raw`` and ``peers`` take their turns
    rep by rep; ``pids`` names each system's server processes (whose CPU is read)."""
    from client_sdk.optimizers import Add

    name = f"bench/transfer/f32-{n}"
    value = np.random.default_rng(n).random(n, dtype=np.float32)
    grad = np.zeros(n, dtype=np.float32)
    nbytes = value.nbytes
    # Each client but the plain and https ones on a variable of its own: each system's
    # versions go up by one per repetition
    names = {s: f"{name}/{_OWN[s]}" if s in _OWN else name for s in clients}
    buffers = {s: np.empty(n, np.float32) for s in clients if s in _OUT}
    for system, ps in clients.items():
        ps.init({names[system]: value}, optimizer=Add())
    for peer in peers:
        peer.init([name], n)
    reps = reps_for(nbytes, ctx.reps, ctx.min_reps)
    series = {
        (op, system): _Series(server_pids)
        for op in ("push", "pull")
        for system, server_pids in pids.items()
        if op == "pull" or system not in _OUT
    }
    last_version: dict[str, int] = {}

    def sdk_turn(system: str, i: int) -> None:
        ps, own = clients[system], names[system]
        if system in buffers:
            version = ps.push({own: grad})[own]["version"]
            with series["pull", system].timed():
                pulled = ps.pull([own], out={own: buffers[system]})[own]
        else:
            with series["push", system].timed():
                version = ps.push({own: grad})[own]["version"]
            with series["pull", system].timed():
                pulled = ps.pull([own])[own]
        last = last_version.get(system)
        if last is not None and version != last + 1:
            raise RuntimeError(
                f"{name} ({system}): push {i} moved the version from {last} to "
                f"{version}; pulls may have been served from cache"
            )
        last_version[system] = version
        if pulled.shape != (n,) or pulled.dtype != np.float32:
            raise RuntimeError(
                f"{name}: pulled {pulled.dtype}{pulled.shape}; expected float32 ({n},)"
            )
        if system in buffers and not np.may_share_memory(pulled, buffers[system]):
            raise RuntimeError(f"{name} ({system}): the pull did not land in its out= buffer")

    def raw_turn(i: int) -> None:
        with series["push", RAW].timed():
            raw.push(grad)
        with series["pull", RAW].timed():
            got = raw.pull(nbytes)
        if got.nbytes != nbytes:
            raise RuntimeError(f"raw socket pulled {got.nbytes} bytes, not {nbytes}")

    def peer_turn(peer: Peer, i: int) -> None:
        with series["push", peer.label].cpu:
            series["push", peer.label].add(peer.push([name]))
        with series["pull", peer.label].cpu:
            series["pull", peer.label].add(peer.pull([name]))

    turns = [
        *(functools.partial(sdk_turn, system) for system in clients),
        raw_turn,
        *(functools.partial(peer_turn, p) for p in peers),
    ]
    for i in range(ctx.warmup + reps):
        if i == ctx.warmup:
            for s in series.values():
                s.forget_warmup()
        for turn in rotated(turns, i):
            turn(i)
    for system in clients:  # the value as kept, in float32
        if not np.array_equal(clients[SDK].pull([names[system]])[names[system]], value):
            raise RuntimeError(f"{name} ({system}): value changed by pushing zeros through Add")
    for peer in peers:
        peer.check([name])
    return [
        {
            "case": case,
            "op": op,
            "size": n,
            "dtype": "float32",
            "system": push_label(system, peers) if op == "push" else system,
            "reference": system == RAW,
            **summarize(s.watch.samples, nbytes),
            **cpu_fields(s.cpu.seconds, nbytes, reps),
            "client_cpu_ms": None if s.client_cpu is None else s.client_cpu / reps * 1e3,
        }
        for (op, system), s in series.items()
    ]
