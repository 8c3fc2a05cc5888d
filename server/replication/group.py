"""A replica group read from what its replicas say of themselves: which one is the primary, and
how far behind it each other one is. The one rule for ``paramshard status``, the fleet view
(``GET /v1/fleet``, the dashboard) and ``GET /v1/replicas``, so the three never disagree.

A *report* is the ``replication`` object of a replica's ``GET /v1/cluster`` (``role``,
``epoch``, ``lsn``, ``url``; a primary's also ``in_sync`` and ``backups``, one entry per backup
it forwards to, with its ``lag``), or ``None`` / ``{}`` for a replica that did not answer.

* The **primary** is the replica that says ``role: primary`` at the highest epoch. Two saying
  so at the same epoch cannot both hold etcd's lease; should reports taken at slightly
  different moments show it, the one holding more writes (higher ``lsn``) is shown, then the
  first listed: the choice never depends on the order the answers came in.
* A backup's **lag** is what the primary's forwarder counts for it (entries the primary holds
  that the backup has not confirmed): the primary's figure is the one that decides whether a
  write is acknowledged. A backup the primary does not forward to (not listed, or listed under
  another URL it did not advertise) has the difference of the two lsns, never below 0.
* A backup is **in sync** when the primary's ``in_sync`` lists its advertised URL.

Pure functions over plain dicts: no I/O, no web stack (``paramshard status`` imports this).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["in_sync", "lag", "primary_of"]

Report = Mapping[str, Any] | None


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def primary_of(reports: Sequence[Report]) -> int | None:
    """The position in ``reports`` of the group's primary (module docstring); ``None`` when
    no replica says it is one."""
    best: tuple[int, int, int] | None = None
    for k, rep in enumerate(reports):
        if not rep or rep.get("role") != "primary" or (epoch := _int(rep.get("epoch"))) is None:
            continue
        key = (epoch, _int(rep.get("lsn")) or -1, -k)
        if best is None or key > best:
            best = key
    return None if best is None else -best[2]


def _advertised(rep: Mapping[str, Any], listed: str) -> str:
    url = rep.get("url")
    return url if isinstance(url, str) and url else listed


def lag(primary: Mapping[str, Any], rep: Mapping[str, Any], listed: str) -> int | None:
    """How many writes replica ``rep`` (listed as ``listed``) is behind ``primary`` (module
    docstring): 0 for the primary itself, ``None`` when neither figure is known."""
    if rep is primary:
        return 0
    url = _advertised(rep, listed)
    for link in primary.get("backups") or ():
        if isinstance(link, Mapping) and link.get("url") == url:
            if (counted := _int(link.get("lag"))) is not None:
                return counted
            break
    head, own = _int(primary.get("lsn")), _int(rep.get("lsn"))
    return None if head is None or own is None else max(0, head - own)


def in_sync(primary: Mapping[str, Any], rep: Mapping[str, Any], listed: str) -> bool:
    """Whether the primary's in-sync set lists replica ``rep`` (listed as ``listed``)."""
    members = primary.get("in_sync")
    return isinstance(members, list) and _advertised(rep, listed) in members
