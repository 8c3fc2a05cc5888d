"""Replication: a shard index served by a group of replicas, one primary and its backups.

Where each concept lives:

* ``role``: what this replica is now (primary, backup, standalone, unknown), at which epoch,
  who the primary is and which backups it waits for; the methods leadership calls.
* ``log``: every write of the store in the order it took effect (the store's journal), kept
  in memory within a bound for the backups.
* ``forward``: a primary's log sent to each backup in batches, and a write's answer held
  until the in-sync backups have it.
* ``replay``: a backup's side: forwarded batches applied in lsn order through the same store
  methods.
* ``catchup``: a backup that needs writes the log let go: the primary's whole state sent as a
  snapshot's files, installed, and the log from there.
* ``replica``: the pieces joined, as the shard's app uses them.
* ``etcd``: a small client of etcd v3's HTTP/JSON gateway (leases, revision-checked
  transactions, watches).
* ``leadership``: the campaign of a replica in etcd (``--etcd``): who is primary, at which epoch
  (the primary key's create_revision), the in-sync set; it drives the role.

Nothing here imports the web stack's routes; the routes call in.
"""

from __future__ import annotations

from .role import BACKUP, PRIMARY, STANDALONE, UNKNOWN, Role, RoleView, not_primary

__all__ = ["BACKUP", "PRIMARY", "STANDALONE", "UNKNOWN", "Role", "RoleView", "not_primary"]
