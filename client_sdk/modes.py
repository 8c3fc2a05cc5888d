"""How a variable takes gradients: its training mode, given at ``init`` and kept for its life.

    ps.init(params, sync=Sync(replicas=4, timeout=30.0))          # sync rounds of 4 workers
    ps.init(params, max_staleness=4, staleness_policy="scale")    # async, staleness bounded
    ps.init(params)                                               # async (Downpour)

* **async** (the default): every gradient is applied when it arrives.
* **sync**: for each version ``v`` the shard collects the first ``replicas`` gradients computed
  on ``v``, applies their mean once (``v + 1`` follows) and drops gradients computed on older
  versions; a round that has not filled ``timeout`` seconds after its first gradient applies
  what it has, so a dead worker never hangs the others. :class:`~client_sdk.training.SyncLoop`
  runs a worker's side of it.
* **bounded staleness**: a gradient computed more than ``max_staleness`` versions ago is
  dropped (``staleness_policy="drop"``) or applied with its step scaled by
  ``1 / (1 + staleness)`` (``"scale"``).

A push's result says per variable what became of each gradient (``"applied"``,
``"accepted"``, ``"dropped"`` with a ``reason``, ``"duplicate"``). The rules, limits and wire
form are docs/PROTOCOL.md §3, "Training modes"; on the wire a mode is fields of a variable's
init entry (:meth:`Mode.to_wire`, :func:`from_wire`). This module is shared with the shard,
which parses init entries with :func:`from_wire`; it imports nothing but the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ASYNC",
    "DEFAULT_ROUND_TIMEOUT",
    "MAX_REPLICAS",
    "MAX_ROUND_TIMEOUT",
    "MAX_STALENESS",
    "STALENESS_POLICIES",
    "Mode",
    "ModeError",
    "Sync",
    "from_wire",
]

#: The most gradients one sync round may wait for.
MAX_REPLICAS = 10_000
#: The longest a sync round may stay open after its first gradient (seconds), and the default.
MAX_ROUND_TIMEOUT = 3600.0
DEFAULT_ROUND_TIMEOUT = 30.0
#: The largest ``max_staleness``.
MAX_STALENESS = 1_000_000
#: What becomes of a gradient staler than ``max_staleness``.
STALENESS_POLICIES = ("drop", "scale")
#: The init entry's fields that make up a mode.
_FIELDS = ("sync", "max_staleness", "staleness_policy")


class ModeError(ValueError):
    """A mode setting out of its range; ``field`` names it as the protocol does
    (``sync``, ``sync.replicas``, ``sync.timeout``, ``max_staleness``, ``staleness_policy``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sync:
    """Sync rounds: ``replicas`` gradients per version (1..:data:`MAX_REPLICAS`; may be fewer
    than the workers: the slowest gradients of a step are then dropped), and how long a round
    waits after its first gradient before it applies what it has (``timeout`` seconds, above 0
    and at most :data:`MAX_ROUND_TIMEOUT`). Raises :class:`ModeError` (a ``ValueError``) for
    settings out of range."""

    replicas: int
    timeout: float = DEFAULT_ROUND_TIMEOUT

    def __post_init__(self) -> None:
        if not _is_int(self.replicas) or not 1 <= self.replicas <= MAX_REPLICAS:
            raise ModeError(
                "sync.replicas",
                f"Sync.replicas must be an int in 1..{MAX_REPLICAS:,} (how many gradients a "
                f"round averages), got {self.replicas!r}",
            )
        if (
            not _is_number(self.timeout)
            or not math.isfinite(self.timeout)
            or not 0 < self.timeout <= MAX_ROUND_TIMEOUT
        ):
            raise ModeError(
                "sync.timeout",
                f"Sync.timeout must be a number of seconds above 0 and at most "
                f"{MAX_ROUND_TIMEOUT:g} (how long a round waits for its last gradients), got "
                f"{self.timeout!r}",
            )

    def to_wire(self) -> dict[str, Any]:
        return {"replicas": int(self.replicas), "timeout": float(self.timeout)}


@dataclass(frozen=True)
class Mode:
    """A variable's training mode: ``sync`` rounds, or a ``max_staleness`` bound with its
    ``staleness_policy`` (``"drop"`` when not given), or neither (async). Equal modes compare
    equal. Raises :class:`ModeError` for a contradictory or out-of-range combination."""

    sync: Sync | None = None
    max_staleness: int | None = None
    staleness_policy: str | None = None

    def __post_init__(self) -> None:
        if self.sync is not None and not isinstance(self.sync, Sync):
            raise ModeError(
                "sync", f"sync must be a Sync(replicas=..., timeout=...), got {self.sync!r}"
            )
        if self.max_staleness is not None and (
            not _is_int(self.max_staleness) or not 0 <= self.max_staleness <= MAX_STALENESS
        ):
            raise ModeError(
                "max_staleness",
                f"max_staleness must be an int in 0..{MAX_STALENESS:,} (how many versions old "
                f"a gradient may be), got {self.max_staleness!r}",
            )
        if self.staleness_policy is not None:
            if self.staleness_policy not in STALENESS_POLICIES:
                raise ModeError(
                    "staleness_policy",
                    f"staleness_policy must be 'drop' or 'scale', got {self.staleness_policy!r}",
                )
            if self.max_staleness is None:
                raise ModeError(
                    "staleness_policy",
                    "staleness_policy needs max_staleness: it says what becomes of a gradient "
                    "staler than that",
                )
        if self.max_staleness is not None and self.staleness_policy is None:
            # "drop" is the default: spelled out, so that equal modes compare equal
            object.__setattr__(self, "staleness_policy", "drop")
        if self.sync is not None and self.max_staleness is not None:
            raise ModeError(
                "sync",
                "sync and max_staleness are two modes, and a variable takes one: a sync round "
                "drops every gradient computed on an older version already",
            )

    @property
    def name(self) -> str:
        """``"sync"``, ``"bounded"`` or ``"async"``."""
        if self.sync is not None:
            return "sync"
        return "bounded" if self.max_staleness is not None else "async"

    def to_wire(self) -> dict[str, Any]:
        """The init entry's mode fields (none for async)."""
        out: dict[str, Any] = {}
        if self.sync is not None:
            out["sync"] = self.sync.to_wire()
        if self.max_staleness is not None:
            out["max_staleness"] = self.max_staleness
            out["staleness_policy"] = self.staleness_policy
        return out

    def summary(self) -> dict[str, Any]:
        """The mode as the shard shows it (docs/PROTOCOL.md §4): every field, null if unset."""
        return {
            "mode": self.name,
            "sync": None if self.sync is None else self.sync.to_wire(),
            "max_staleness": self.max_staleness,
            "staleness_policy": self.staleness_policy,
        }

    def conflicts(self, entry: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The mode fields an init ``entry`` states (not nil) that differ from this mode, each
        as ``{"existing": ..., "requested": ...}`` in wire form; fields it leaves out are not
        compared (a restarted worker may init with the value alone). ``entry`` must parse
        (:func:`from_wire`)."""
        stated = from_wire(entry)
        out = {}
        if entry.get("sync") is not None and stated.sync != self.sync:
            out["sync"] = {
                "existing": None if self.sync is None else self.sync.to_wire(),
                "requested": None if stated.sync is None else stated.sync.to_wire(),
            }
        for key in ("max_staleness", "staleness_policy"):
            if entry.get(key) is not None and getattr(stated, key) != getattr(self, key):
                out[key] = {"existing": getattr(self, key), "requested": getattr(stated, key)}
        return out


ASYNC = Mode()


def from_wire(entry: Mapping[str, Any]) -> Mode:
    """The mode of an init entry (its ``sync``, ``max_staleness`` and ``staleness_policy``;
    other keys are not looked at, nil is absent); raises :class:`ModeError` naming the field."""
    if not any(entry.get(k) is not None for k in _FIELDS):
        return ASYNC
    sync = entry.get("sync")
    if sync is not None:
        if not isinstance(sync, Mapping):
            raise ModeError(
                "sync", f"sync must be a map {{'replicas': int, 'timeout': seconds}}, got {sync!r}"
            )
        extra = sorted(map(str, set(sync) - {"replicas", "timeout"}))
        if extra:
            raise ModeError(
                "sync", f"sync has no field(s) {extra}; its fields are 'replicas' and 'timeout'"
            )
        if sync.get("replicas") is None:
            raise ModeError(
                "sync.replicas", "sync needs 'replicas': how many gradients a round takes"
            )
        timeout = sync.get("timeout")
        sync = Sync(sync["replicas"], DEFAULT_ROUND_TIMEOUT if timeout is None else timeout)
    return Mode(sync, entry.get("max_staleness"), entry.get("staleness_policy"))
