"""Training modes in the store: what each gradient of a push becomes by its variable's mode.

A variable takes gradients in one of three modes (:class:`client_sdk.modes.Mode`, fixed at
init; docs/PROTOCOL.md §3, Training modes):

* **async**: applied at once (as every push was before modes existed);
* **bounded staleness**: applied at once up to ``max_staleness`` versions old; beyond, dropped
  or applied with its step scaled by ``1 / (1 + staleness)``;
* **sync**: joins the round on the variable's version (:mod:`server.store.rounds`) if computed
  on it, and the gradient that fills the round brings the round's mean with it, applied at
  once; one computed on an older version, or a worker's second in one round, is dropped.

A push that names no variable of the last two modes never comes here (the store checks one
int); one that does is sorted by :func:`plan` into a :class:`ModedPush`: the operation, whole,
before anything changes. Its steps, in the store's order (:mod:`server.store.operations`):

1. :func:`check_request`: a gradient of a sync or bounded variable says the version it was
   computed on (400 ``versions`` otherwise: a retry would find the same);
2. the dedup table (the store's): a retry is ``"duplicate"``, whatever has changed since;
3. :func:`plan`: refuses a version above the variable's (400), sorts each gradient by the
   state now, and computes into fresh memory what could fail: a scaled update (checked, 422 if
   not finite), a round's mean; it checks that no round's sum would overflow (422). Then the
   store applies ``now`` (the gradients and round means applied at once, :func:`server.store
   .apply.push`, which refuses an overflowing update with nothing written), and then
   :func:`apply`, which cannot fail: the scaled updates installed, the gradients added to
   their rounds, the rounds filled closed;
4. the store counts it (versions, the dedup table) and answers each variable.

A round that times out closes through :func:`close_timed_out` (:class:`CloseRound`), called by
the store when :func:`server.store.rounds.close_when_due` says the time has come.

Not thread-safe: the event-loop thread only; nothing here awaits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from client_sdk.modes import ASYNC

from ..errors import ShardError
from .apply import checked_update
from .bounds import LIMITS, magnitude
from .checks import tensor_error
from .operations import Push
from .rounds import Round, RoundStats, open_round, sum_dtype
from .variable import Variable

__all__ = [
    "CloseRound",
    "ModedPush",
    "apply",
    "check_request",
    "close_timed_out",
    "is_moded",
    "plan",
]


def is_moded(var: Variable) -> bool:
    """Whether ``var`` is a sync or bounded-staleness variable."""
    return var.mode is not ASYNC


def check_request(op: Push) -> bool:
    """Step 1 for the modes: whether the push names a sync or bounded variable, and if so that
    each of those has its version in ``versions`` (400 ``versions`` otherwise)."""
    moded = [var for var in op.variables if var.mode is not ASYNC]
    if not moded:
        return False
    held = op.versions or {}
    for var in moded:
        if var.name not in held:
            raise ShardError(
                "bad_request",
                f"push: {var.name!r} is a {var.mode.name} variable, so its gradient must say "
                "the version it was computed on: send 'versions' {name: version} (the Python "
                "SDK sends the version it last pulled: pull before you push)",
                {"field": "versions", "variable": var.name},
            )
    return True


@dataclass(eq=False, slots=True)
class Scaled:
    """A gradient applied with its step scaled: its update, computed into fresh memory and
    checked (value, slots, and their bounds)."""

    var: Variable
    scale: float
    value: np.ndarray
    state: dict[str, np.ndarray] | None
    bounds: tuple[float, float]


@dataclass(eq=False, slots=True)
class Join:
    """A gradient joining (or opening) the round on its variable's version, which stays open;
    ``bound``: at least its largest magnitude."""

    var: Variable
    grad: np.ndarray
    bound: float


@dataclass(eq=False, slots=True)
class Fill:
    """A gradient that fills its variable's round: the round's mean (with it) is applied at
    once, in ``now``; ``contributors`` joined in all."""

    var: Variable
    contributors: int


@dataclass(eq=False)
class ModedPush:
    """A push to sync or bounded variables, sorted (:func:`plan`).

    ``now``: the gradients applied at once with their variable's optimizer, unscaled (async,
    bounded within ``max_staleness``, and the mean of each round this push fills), as a push
    of its own for :func:`server.store.apply.push`, or None. ``results``: each variable's
    entry of the reply but ``version`` (the store sets it when it counts), in request order.
    """

    op: Push
    now: Push | None
    scaled: list[Scaled] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    dropped: list[Variable] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Each gradient's staleness, where it had one (for the windows).
    staleness: dict[str, int] = field(default_factory=dict)


def plan(op: Push) -> ModedPush:
    """Step 3 of a push that :func:`check_request` found moded, values checked already
    (``op.grads`` cast and finite, ``op.squares``): sort each gradient by its variable's mode
    and the state now; compute what could fail. Raises :class:`ShardError` (400 for a version
    above the variable's, 422 for a round's sum or a scaled update that would not be finite),
    having changed nothing."""
    held = op.versions or {}
    now_vars: list[Variable] = []
    now_grads: list[np.ndarray] = []
    now_squares: list[float] = []
    moded = ModedPush(op, None)
    results = moded.results
    for var, grad, squares in zip(op.variables, op.grads, op.squares):
        name = var.name
        seen = held.get(name)
        version = var.version
        staleness = None if seen is None else version - seen
        if staleness is not None:
            moded.staleness[name] = staleness
        mode = var.mode
        if mode is ASYNC:
            now_vars.append(var)
            now_grads.append(grad)
            now_squares.append(squares)
            results[name] = {"status": "applied", "staleness": staleness}
            continue
        if staleness < 0:
            raise ShardError(
                "bad_request",
                f"push: the gradient of {name!r} says it was computed on version {seen}, but "
                f"the variable is at version {version}: a worker computes on a version it "
                "pulled (after a shard restart, pull again)",
                {"field": "versions", "variable": name, "version": version},
            )
        if mode.sync is not None:
            _sort_sync(moded, var, grad, squares, staleness, now_vars, now_grads, now_squares)
        elif staleness <= mode.max_staleness:
            now_vars.append(var)
            now_grads.append(grad)
            now_squares.append(squares)
            results[name] = {"status": "applied", "staleness": staleness}
        elif mode.staleness_policy == "drop":
            moded.dropped.append(var)
            results[name] = {
                "status": "dropped",
                "staleness": staleness,
                "reason": "stale",
                "max_staleness": mode.max_staleness,
                "message": f"{name!r}: computed on version {seen}, {staleness} versions behind "
                f"the variable's {version}, more than its max_staleness {mode.max_staleness}: "
                "dropped; pull and compute on newer values",
            }
        else:
            scale = 1.0 / (1.0 + staleness)
            with np.errstate(all="ignore"):
                value, state, bounds = _scaled_update(var, grad, scale)
            moded.scaled.append(Scaled(var, scale, value, state, bounds))
            results[name] = {"status": "applied", "staleness": staleness, "scale": scale}
    if now_vars:
        moded.now = Push(op.worker_id, op.seq, now_vars, now_grads, None, {}, None, now_squares)
    return moded


def _sort_sync(
    moded: ModedPush,
    var: Variable,
    grad: np.ndarray,
    squares: float,
    staleness: int,
    now_vars: list[Variable],
    now_grads: list[np.ndarray],
    now_squares: list[float],
) -> None:
    """:func:`plan`'s part for a gradient of a sync variable."""
    name, version = var.name, var.version
    results = moded.results
    if staleness > 0:
        moded.dropped.append(var)
        results[name] = {
            "status": "dropped",
            "staleness": staleness,
            "reason": "stale",
            "message": f"{name!r}: computed on version {version - staleness}, whose sync round "
            f"has closed; the variable is at version {version}: dropped; pull and compute "
            "on the new values",
        }
        return
    current = var.round
    worker_id = moded.op.worker_id
    if current is not None and worker_id in current.workers:
        moded.dropped.append(var)
        results[name] = {
            "status": "dropped",
            "staleness": 0,
            "reason": "repeat",
            "message": f"{name!r}: worker {worker_id!r} has a gradient in the round on version "
            f"{version} already, and each worker counts once per round: dropped; wait for the "
            "round to close (pull with min_version) before the next step",
        }
        return
    bound = math.sqrt(squares)
    contributors = 1 if current is None else current.count + 1
    if contributors >= var.mode.sync.replicas:
        mean = grad if current is None else current.mean(var.value.dtype, grad)
        mag = bound if current is None else (current.bound + bound) / contributors
        if not math.isfinite(mag) or mag > LIMITS[var.value.itemsize]:
            raise _overflow(var)
        now_vars.append(var)
        now_grads.append(mean)
        now_squares.append(mag * mag)
        moded.fills.append(Fill(var, contributors))
        results[name] = {"status": "applied", "staleness": 0}
        return
    total = bound + (0.0 if current is None else current.bound)
    if not total <= LIMITS[sum_dtype(var.value.dtype).itemsize]:
        raise _overflow(var)
    moded.joins.append(Join(var, grad, bound))
    results[name] = {"status": "accepted", "staleness": 0}


def _overflow(var: Variable) -> ShardError:
    return tensor_error(
        var.name,
        "this gradient would make the sync round's sum (or mean) NaN or infinite in "
        f"{var.value.dtype.str}, so none of the push was applied: clip the gradient",
    )


def _scaled_update(
    var: Variable, grad: np.ndarray, scale: float
) -> tuple[np.ndarray, dict[str, np.ndarray] | None, tuple[float, float]]:
    """``grad`` applied to ``var`` with its step scaled by ``scale``, into fresh memory and
    checked (422 if not finite)."""
    return checked_update(var, grad, scale=scale)


def apply(moded: ModedPush, now: float) -> None:
    """Step 3's writes after ``moded.now`` was applied: install the scaled updates, add the
    joining gradients to their rounds (opening them), and close the rounds filled. Cannot
    fail. ``now``: ``time.monotonic()``."""
    for s in moded.scaled:
        var = s.var
        var.replace(s.value)
        if s.state is not None:
            var.state = s.state
            var.state_shared = False
        var.bound, var.slot_bound = s.bounds
    worker_id, seq = moded.op.worker_id, moded.op.seq
    for j in moded.joins:
        var = j.var
        current = var.round
        if current is None:
            var.round = open_round(var.version, j.grad, worker_id, seq, j.bound, _timeout(var))
            var.round.opened = now
        else:
            current.add(j.grad, worker_id, seq, j.bound)
    for f in moded.fills:
        var = f.var
        var.round = None
        _stats(var).closed(var.version, f.contributors, "filled")


def _timeout(var: Variable) -> float:
    sync = var.mode.sync
    assert sync is not None
    return float(sync.timeout)


def _stats(var: Variable) -> RoundStats:
    stats = var.training.rounds
    if stats is None:
        stats = var.training.rounds = RoundStats()
    return stats


@dataclass(eq=False, slots=True)
class CloseRound:
    """Close ``var``'s round on ``version`` that timed out: apply ``mean`` (the mean of what
    it had) with the optimizer, or, when that update would not be finite (``mean`` None, the
    round ``discarded``), leave the value; either way the version goes up by one."""

    var: Variable
    version: int
    contributors: int
    mean: np.ndarray | None
    #: The update, computed into fresh memory and checked: value, slots, bounds.
    update: tuple[np.ndarray, dict[str, np.ndarray] | None, tuple[float, float]] | None


def close_timed_out(var: Variable, version: int) -> CloseRound | None:
    """The close of ``var``'s round on ``version`` that timed out, or None if that round is no
    longer open (it filled, or the variable was assigned or deleted meanwhile). Computes the
    update into fresh memory; nothing changes until :func:`apply_close`."""
    current = var.round
    if current is None or current.version != version or var.version != version:
        return None
    mean = current.mean(var.value.dtype)
    try:
        with np.errstate(all="ignore"):
            update = checked_update(var, mean)
    except ShardError:
        return CloseRound(var, version, current.count, None, None)
    return CloseRound(var, version, current.count, mean, update)


def apply_close(close: CloseRound) -> str:
    """Write a :class:`CloseRound`; returns how the round closed (``"timed_out"`` or
    ``"discarded"``). The caller counts the version."""
    var = close.var
    var.round = None
    how = "discarded"
    if close.update is not None:
        value, state, bounds = close.update
        var.replace(value)
        if state is not None:
            var.state = state
            var.state_shared = False
        var.bound, var.slot_bound = bounds
        how = "timed_out"
    _stats(var).closed(close.version, close.contributors, how)
    return how


def discard(var: Variable) -> None:
    """Drop ``var``'s open round without applying it (an assign replaced the value its
    gradients were computed on)."""
    current = var.round
    if current is not None:
        var.round = None
        _stats(var).closed(current.version, current.count, "discarded")


def restored(var: Variable, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Give a variable read from a snapshot its mode, counts, rounds and open round (from
    ``meta``, the manifest's entry, and ``arrays["round"]``, the round's sum). ``ValueError``
    for a field that is not what a snapshot holds."""
    from client_sdk.modes import ModeError
    from client_sdk.modes import from_wire as mode_from_wire

    try:
        var.mode = mode_from_wire(meta)
    except ModeError as exc:
        raise ValueError(f"bad mode: {exc}") from None
    counts = meta.get("counts") or {}
    if not isinstance(counts, dict):
        raise ValueError("'counts' is not an object")
    for key, attr in (
        ("dropped", "dropped"),
        ("scaled", "scaled"),
        ("accepted", "accepted"),
        ("duplicate", "duplicates"),
    ):
        n = counts.get(key, 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"'counts.{key}' is not an int >= 0")
        setattr(var.training, attr, n)
    if var.mode.sync is not None:
        var.training.rounds = RoundStats.load(meta["rounds"]) if "rounds" in meta else RoundStats()
    raw = meta.get("round")
    total = arrays.get("round")
    if raw is None and total is None:
        return
    if var.mode.sync is None or not isinstance(raw, dict) or total is None:
        raise ValueError("an open round on a variable that is not a sync one, or without its sum")
    contributors = raw.get("contributors")
    if not (
        isinstance(contributors, list)
        and contributors
        and all(
            isinstance(c, list)
            and len(c) == 2
            and isinstance(c[0], str)
            and isinstance(c[1], int)
            and not isinstance(c[1], bool)
            for c in contributors
        )
        and raw.get("count") == len(contributors)
        and raw.get("version") == var.version
    ):
        raise ValueError("'round' is not an open round on the variable's version")
    if total.shape != var.value.shape or total.dtype != sum_dtype(var.value.dtype):
        raise ValueError(f"the round's sum has shape {total.shape} and dtype {total.dtype}")
    owned = np.array(total, order="C", copy=True)
    bound = magnitude(owned)
    if not math.isfinite(bound):
        raise ValueError("the round's sum is not finite")
    var.round = Round(
        var.version,
        owned,
        [(w, s) for w, s in contributors],
        bound,
        0.0,  # the store sets when it times out, at the restart
        _timeout(var),
    )
