"""Replication: a shard index served by a group of replicas, one primary and its backups.

Where each concept lives:

* ``role``: what this replica is now (primary, backup, standalone, unknown), at which epoch,
  who the primary is and which backups it waits for; the methods leadership calls.

Nothing here imports the web stack's routes; the routes call in.
"""

from __future__ import annotations

from .role import BACKUP, PRIMARY, STANDALONE, UNKNOWN, Role, RoleView, not_primary

__all__ = ["BACKUP", "PRIMARY", "STANDALONE", "UNKNOWN", "Role", "RoleView", "not_primary"]
