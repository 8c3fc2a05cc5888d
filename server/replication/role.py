"""What this replica of a shard index is now: its :class:`Role`.

A shard process is one replica of its index. Its role says whether it is the index's
**primary** (it orders and applies the writes, forwards them to its backups, and acknowledges a
write once every backup of its in-sync set has it) or a **backup** (it applies what the primary
forwards, and refuses clients' writes with 421 ``not_primary`` naming the primary), and at which
**epoch**: a number that only grows, one per primary ever elected for the index. A replica
that is neither (it stepped down, or has not yet learnt who leads) refuses writes too, with no
primary to name.

Who decides: without a coordination service, the flags give a static role
(:meth:`Role.from_config`: ``--replica-group URL|URL|...`` with ``--advertise-url`` naming
this replica; the group's first URL is primary at epoch 1, the others its backups and its
in-sync set). With one, the leadership code calls :meth:`Role.become_primary`,
:meth:`Role.become_backup`, :meth:`Role.step_down` and :meth:`Role.set_in_sync` when
leadership changes; whoever else cares (the forwarder, the routes) reads the role at each
request, or registers a listener (:meth:`Role.subscribe`) called synchronously on every change.
A primary that holds a lease says until when (:meth:`Role.hold_until`): past it, it takes no
write and acknowledges none, whatever runs next.

A shard started without ``--replica-group`` (and without leadership) is ``standalone``: the
primary of a group of one at epoch 0, which replicates nothing and is as fast as a shard that
has never heard of replication.

Thread-safety: none; the event loop's thread changes and reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ShardError

__all__ = [
    "BACKUP",
    "PRIMARY",
    "STANDALONE",
    "UNKNOWN",
    "Role",
    "RoleView",
    "not_primary",
    "stale_epoch",
]

PRIMARY: Literal["primary"] = "primary"
BACKUP: Literal["backup"] = "backup"
#: Not part of a replica group: the only copy of its index (epoch 0).
STANDALONE: Literal["standalone"] = "standalone"
#: Part of a group, but neither primary nor backup of a known primary (stepped down, or not
#: told yet): refuses writes and forwarded entries alike until told.
UNKNOWN: Literal["unknown"] = "unknown"

Kind = Literal["primary", "backup", "standalone", "unknown"]


@dataclass(frozen=True, slots=True)
class RoleView:
    """One moment of a :class:`Role` (what a listener is handed, and ``/v1/cluster`` shows)."""

    kind: Kind
    epoch: int
    #: This replica's own URL as the others reach it (``None``: standalone, not known).
    url: str | None
    #: The primary's URL: this replica's own when primary, ``None`` when not known.
    primary: str | None
    #: The backups a primary waits for before acknowledging a write (empty otherwise).
    in_sync: tuple[str, ...]

    @property
    def acknowledges(self) -> bool:
        """Whether this replica may apply and acknowledge clients' writes."""
        return self.kind in (PRIMARY, STANDALONE)

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.kind,
            "epoch": self.epoch,
            "url": self.url,
            "primary": self.primary,
            "in_sync": list(self.in_sync),
        }


Listener = Callable[[RoleView, RoleView], None]


class Role:
    """The role of this replica (module docstring); every change goes through a method here and
    is told to the listeners, old view and new, before the method returns."""

    def __init__(self, url: str | None = None, *, replicated: bool = False) -> None:
        #: Whether this shard is one replica of a group at all (``False``: standalone).
        self.replicated = replicated
        self._view = (
            RoleView(UNKNOWN, 0, url, None, ())
            if replicated
            else RoleView(STANDALONE, 0, url, url, ())
        )
        self._listeners: list[Listener] = []
        self._deadline: float | None = None

    @classmethod
    def from_config(cls, group: Iterable[str], advertise_url: str | None) -> Role:
        """The static role ``--replica-group`` and ``--advertise-url`` state (module
        docstring); standalone when ``group`` is empty. The config checked already that
        ``advertise_url`` is one of ``group``."""
        urls = tuple(group)
        if not urls:
            return cls(advertise_url)
        role = cls(advertise_url, replicated=True)
        if advertise_url == urls[0]:
            role.become_primary(1, urls[1:])
        else:
            role.become_backup(urls[0], 1)
        return role

    # -- reading ----------------------------------------------------------------------------

    @property
    def view(self) -> RoleView:
        return self._view

    @property
    def kind(self) -> Kind:
        return self._view.kind

    @property
    def epoch(self) -> int:
        return self._view.epoch

    @property
    def primary(self) -> str | None:
        return self._view.primary

    @property
    def in_sync(self) -> tuple[str, ...]:
        return self._view.in_sync

    @property
    def acknowledges(self) -> bool:
        """Whether clients' writes may be applied and acknowledged here now: a primary (or a
        standalone shard) whose lease, if it holds one (:meth:`hold_until`), has not run out."""
        deadline = self._deadline
        return self._view.acknowledges and (deadline is None or time.monotonic() < deadline)

    def hold_until(self, deadline: float | None) -> None:
        """A primary holds its leadership until ``deadline`` (``time.monotonic()`` seconds;
        ``None``: no lease, as with static roles): from then on it acknowledges nothing, even
        before the leadership code runs again (a process stopped past its lease and resumed
        serves no write before it learns whether it still leads)."""
        self._deadline = deadline

    def check_writable(self) -> None:
        """421 ``not_primary`` (naming the primary when known) unless this replica takes
        clients' writes now."""
        if not self.acknowledges:
            raise not_primary(self._view)

    # -- changes (called by leadership, or once by from_config) -----------------------------

    def become_primary(self, epoch: int, in_sync: Iterable[str] = ()) -> None:
        """Primary at ``epoch`` (not below the current one), waiting for ``in_sync``'s
        acknowledgements before acknowledging a write."""
        self._check_epoch(epoch)
        url = self._view.url
        self._set(RoleView(PRIMARY, epoch, url, url, tuple(u for u in in_sync if u != url)))

    def become_backup(self, primary: str, epoch: int) -> None:
        """Backup of ``primary`` (a URL) at ``epoch`` (not below the current one): clients'
        writes are refused, forwarded entries of ``epoch`` or above applied."""
        self._check_epoch(epoch)
        self._set(RoleView(BACKUP, epoch, self._view.url, primary, ()))

    def step_down(self) -> None:
        """Stop acknowledging at once (a primary whose lease may be lost): writes are refused
        from now on, until :meth:`become_primary` or :meth:`become_backup`. The epoch stays."""
        view = self._view
        self._set(RoleView(UNKNOWN, view.epoch, view.url, None, ()))

    def set_in_sync(self, in_sync: Iterable[str]) -> None:
        """A primary's in-sync set changed (a backup dropped, or one caught up)."""
        view = self._view
        if view.kind != PRIMARY:
            raise RuntimeError(f"set_in_sync on a replica that is {view.kind}, not primary")
        url = view.url
        self._set(RoleView(PRIMARY, view.epoch, url, url, tuple(u for u in in_sync if u != url)))

    def accept_forwarded(self, epoch: int, primary: str) -> None:
        """Entries forwarded by ``primary`` at ``epoch`` came: refuse them (409
        ``stale_epoch``) if ``epoch`` is below the highest this replica has seen, or is its
        own epoch as primary; otherwise this replica is (or becomes, at once) a backup of
        ``primary`` at ``epoch``: a primary that sees a higher epoch has been replaced."""
        view = self._view
        if not self.replicated:
            raise ShardError(
                "conflict",
                "this shard is not a replica of a group (no --replica-group, no leadership): "
                "it takes no forwarded entries",
                {"role": view.kind},
            )
        if epoch < view.epoch or (epoch == view.epoch and view.kind == PRIMARY):
            raise stale_epoch(epoch, view.epoch)
        if view.kind != BACKUP or epoch != view.epoch or view.primary != primary:
            self._set(RoleView(BACKUP, epoch, view.url, primary, ()))

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(old, new)`` on every change from now on."""
        self._listeners.append(listener)

    # -- internals --------------------------------------------------------------------------

    def _check_epoch(self, epoch: int) -> None:
        if not self.replicated:
            raise RuntimeError("a standalone shard (no --replica-group) has no leadership")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < self._view.epoch:
            raise ValueError(f"epoch {epoch!r} is below this replica's epoch {self._view.epoch}")

    def _set(self, view: RoleView) -> None:
        old, self._view = self._view, view
        for listener in list(self._listeners):
            listener(old, view)


def not_primary(view: RoleView) -> ShardError:
    """421 ``not_primary``: this replica does not take clients' writes; ``details.primary`` is
    the primary's URL when known (retry there, with the same ``seq``), else ``None`` (ask
    another replica of the group)."""
    where = (
        f"the primary is {view.primary}: send writes there"
        if view.primary is not None
        else "it does not know the primary now: ask another replica of the group (GET /v1/cluster)"
    )
    return ShardError(
        "not_primary",
        f"this replica of the shard is {view.kind} at epoch {view.epoch}, not the primary; "
        f"{where}, with the same worker_id and seq",
        {"role": view.kind, "epoch": view.epoch, "primary": view.primary},
    )


def stale_epoch(epoch: int, highest: int) -> ShardError:
    """409 ``stale_epoch``: entries forwarded at an epoch below one this replica has seen."""
    return ShardError(
        "stale_epoch",
        f"entries of epoch {epoch} refused: this replica has seen epoch {highest}, so a newer "
        "primary exists; the sender must step down",
        {"epoch": epoch, "highest_epoch": highest},
    )
