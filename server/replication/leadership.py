"""Who leads a shard index, decided through etcd: :class:`Leadership`.

Each replica of shard index ``i`` runs one :class:`Leadership` task on its event loop. It
campaigns for the key ``<prefix>/shard/<i>/primary`` with a lease of its own (``--lease-ttl``
seconds), created only if absent (one etcd transaction). The winner is primary at **epoch = the
key's create_revision**: etcd's revisions only grow, so each new primary of an index has a
higher epoch than every one before it, with no counter of ours. It keeps its lease alive every
third of the TTL; the others become backups of the URL the key names and watch the key. When
the primary's lease ends (the process died, was frozen, or lost etcd), etcd deletes the key, the
watchers see it and campaign again.

A primary stops acknowledging writes **before** its lease can end: after each keepalive it
tells the role it may acknowledge until ``sent + 2/3 TTL`` (:meth:`Role.hold_until`), a
deadline the role checks at every write, so a primary that was frozen (SIGSTOP) or cut from
etcd refuses writes as soon as it runs again, before any task of its own had a chance to
notice; it then steps down and comes back as a backup of whoever holds the key.

Who may campaign: only a replica that has every acknowledged write. The primary keeps the set
of such replicas in ``<prefix>/shard/<i>/in-sync`` (``{"epoch", "replicas": [URL, ...],
"processes": {URL: incarnation}}``,
every change a revision-checked transaction: :meth:`Leadership.drop` when a backup stopped
acknowledging, :meth:`Leadership.add` once one caught up). A replica campaigns when that key
is absent (a new fleet: every replica starts empty) or lists it **and** was written since this
process started: a replica restarted under the same URL lost what it held in memory. The set also
names the process (its ``incarnation``, new at every start) of each member known to hold every
write, and a replica is eligible only under its own process's name. The primary writes the set
again as it is, at most once per lease TTL, when every backup of it says, asked then, that it
holds the primary's newest write of that moment or a later one (:meth:`Leadership._confirm`;
writes may keep coming meanwhile), naming the processes that
answered: a listed replica that restarted becomes eligible once it has caught up, never on the
strength of what the process before it acknowledged. One that answers holding less than its
link last heard (it restarted, with no write since) is fed at once by the forwarder
(:meth:`Forwarder.recheck <server.replication.forward.Forwarder.recheck>`), not at the next
write.

A replica whose whole state its primary replaced (a catch-up: it lagged past the log, or its
log diverged: it held a write of an older epoch that the primary never had) is ``resyncing``:
not eligible until the primary writes the set listing it again after that.

When the whole group restarted (stopped and started again, or a power cut), no replica is
eligible: each was listed before it started. No primary holds the key then, so a listed
replica that restarted (``restarted``) may campaign once its state is restored (from its
snapshot, which records the (epoch, lsn) of its newest write) if no listed replica it reaches is
eligible, still restoring, or more complete; one that does not answer is waited for
:data:`RESTART_GRACE_TTLS` lease TTLs, then led without, unless this replica holds nothing (an
empty replica never leads while a listed one is away). Writes after the snapshots it restored
from are lost then, unless the replicas stopped cleanly (their final snapshots hold them).

A new primary asks the other replicas what they hold (``GET /v1/cluster``, one second each):
the (epoch, lsn) of their newest write, compared epoch first (a write of a newer epoch was
ordered after every write of an older one, whatever its lsn). Its in-sync set lists only
those that hold the same newest write: one that does not answer (the writes would wait for it in
vain), lags (listed, it could be elected before it has every acknowledged write) or holds a
write this one never had is left out, and the forwarder lets it back in once it has every write
this one holds. One that may campaign and holds more makes it stand aside for a TTL, so that
the most complete replica leads.

One module past 600 lines: the campaign, the survey of the other replicas and the in-sync set
are one protocol whose rules (who may campaign, who is listed, which process is named) read the
same keys and state; split, each part would have to restate the others' rules.

Not thread-safe: everything runs on the shard's event loop, as the role requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import httpx2

from .etcd import EtcdClient, EtcdError, KeyValue, LeaseLost
from .role import PRIMARY, Role, RoleView

__all__ = ["DEFAULT_LEASE_TTL", "Leadership"]

logger = logging.getLogger("paramshard.leadership")

#: Default ``--lease-ttl``: the shortest lease etcd grants with its default election timeout
#: (1 s: its minimum TTL is 1.5 election timeouts, rounded up); a failover takes about this long.
DEFAULT_LEASE_TTL = 2
#: How long a new primary waits for each replica's ``GET /v1/cluster`` (seconds).
SURVEY_SECONDS = 1.0
#: How long a backup waits on one watch before reading the keys again anyway (seconds).
WATCH_SECONDS = 10.0
#: Lease TTLs a replica of a whole group restarted waits for a listed replica that does not
#: answer before it leads without it (module docstring).
RESTART_GRACE_TTLS = 5


class Peer(NamedTuple):
    """Another replica of the group, as its ``GET /v1/cluster`` said."""

    #: ``(epoch, lsn)`` of its newest write.
    position: tuple[int, int]
    #: Whether it may campaign (it holds every acknowledged write).
    eligible: bool
    #: Whether its state is restored (``False`` while it still reads its snapshot).
    restored: bool
    #: The process that answered (its ``incarnation``: a new one at every start).
    process: str


def _json(kv: KeyValue | None) -> dict[str, Any] | None:
    """The JSON object a key of ours holds; ``None`` for an absent key or another value."""
    if kv is None:
        return None
    try:
        doc = json.loads(kv.value)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class Leadership:
    """The campaign of one replica (``url``, one of ``group``) for shard index ``index``.

    ``position()`` is how complete this replica's log is: ``(epoch, lsn)`` of its newest write
    (``(0, 0)``: nothing written yet, so any replica is as complete as this one). Start it
    with :meth:`start`; :meth:`stop` hands the lead over at once (revokes the lease) when this
    replica is primary.
    """

    def __init__(
        self,
        role: Role,
        etcd: EtcdClient,
        *,
        prefix: str,
        index: int,
        url: str,
        group: Sequence[str],
        ttl: int = DEFAULT_LEASE_TTL,
        position: Callable[[], tuple[int, int]] = lambda: (0, 0),
        caught_up: Callable[[], bool] = lambda: False,
        restored: Callable[[], bool] = lambda: True,
        headers: dict[str, str] | None = None,
        process: str = "",
    ) -> None:
        self.role = role
        #: This process's incarnation: the in-sync set names the process of each replica it
        #: lists as holding every write (module docstring).
        self.process = process
        self.etcd = etcd
        self.url = url
        self.group = tuple(group)
        self.ttl = ttl
        self.position = position
        self.caught_up = caught_up
        self.restored = restored
        #: Told of each backup that answered :meth:`_confirm`'s survey as a process the in-sync
        #: set does not name, holding another (epoch, lsn) than this primary: it restarted,
        #: and the forwarder feeds it if its link waits for a write meanwhile.
        self.behind: Callable[[str, tuple[int, int]], None] = lambda url, position: None
        #: When (monotonic) the in-sync set was last written again as it was (:meth:`_confirm`).
        self._confirmed = 0.0
        self._confirming: asyncio.Task[None] | None = None
        self.base = base = f"{prefix.rstrip('/')}/shard/{index}"
        self.primary_key = f"{base}/primary"
        self.in_sync_key = f"{base}/in-sync"
        #: Whether this replica may campaign (it has every acknowledged write), as last read.
        self.eligible = False
        #: Its whole state was replaced by its primary's (a catch-up: it lagged past the log,
        #: or its log diverged from the primary's): it may campaign only once the primary has
        #: written the in-sync set listing it after that (:meth:`replaced`).
        self.resyncing = False
        #: The store's revision first read after the replacement (``None``: not read yet).
        self._resync_revision: int | None = None
        #: Listed in the in-sync set from before this process started, and no primary: the
        #: whole group restarted (module docstring); since when (monotonic), or ``None``.
        self.restarted = False
        self._restarted_since: float | None = None
        #: The lease this replica holds the primary key with (0: none).
        self.lease = 0
        #: The store's revision when this process first read it.
        self.started_revision: int | None = None
        #: The last error talking to etcd (shown by /v1/cluster), ``None`` once it answers.
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: Set by :meth:`stop`: no campaign starts and no lead is taken after it.
        self._stopping = False
        #: Until when (monotonic) this replica does not campaign: it found a replica holding
        #: more writes than itself when it won last.
        self._stand_aside = 0.0
        #: For asking the other replicas what they hold (their ``GET /v1/cluster``).
        # https replicas are verified with the system's CAs (OpenSSL's store, SSL_CERT_FILE),
        # as the forwarder verifies them; httpx2's own default would be certifi's bundle.
        self._http = httpx2.AsyncClient(
            headers=headers or {}, trust_env=False, verify=ssl.create_default_context()
        )
        self._logged = 0.0

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        # httpx2 logs every request at INFO: leadership makes a few a second, for nobody.
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        self.role.subscribe(self._role_changed)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="leadership")

    async def stop(self) -> None:
        """Stop campaigning; a primary steps down and revokes its lease, so another replica
        takes over at once instead of after the lease's TTL.

        The task is cancelled again until it ends: a cancellation that lands as a library's own
        timeout fires (an HTTP survey, an etcd call) can be turned into that timeout and lost,
        and a replica stopping while its primary stops too would then win the key, lead and
        keep its lease alive with its shutdown waiting on it (``docker compose stop`` stops
        every replica at once). :attr:`_stopping` keeps it from taking the lead meanwhile."""
        self._stopping = True
        task = self._task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled():
            with contextlib.suppress(Exception):
                task.result()
        if self.role.kind == PRIMARY:
            self.role.step_down()
        if self.lease:
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(self.lease)
            self.lease = 0
        await self.etcd.close()
        await self._http.aclose()

    def status(self) -> dict[str, Any]:
        """What ``GET /v1/cluster`` shows of the campaign."""
        return {
            "etcd": self.etcd.endpoints,
            "key": self.primary_key,
            "lease_ttl": self.ttl,
            "holds_lease": bool(self.lease),
            "eligible": self.eligible,
            "resyncing": self.resyncing,
            "restarted": self.restarted,
            "restored": self.restored(),
            "error": self.error,
        }

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._round()
                self.error = None
            except EtcdError as exc:
                self.error = str(exc)
                self._warn("shard %s: etcd: %s", self.primary_key, exc)
                await asyncio.sleep(self.ttl / 3)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: say so, and keep campaigning rather than end silently
                logger.exception("leadership of %s failed; campaigning again", self.primary_key)
                await asyncio.sleep(self.ttl)

    async def _round(self) -> None:
        """Read the index's keys once and act: follow the primary key's holder, or campaign;
        then wait until one of the keys changes."""
        held, revision = await self.etcd.get(self.primary_key)
        if self.started_revision is None:
            self.started_revision = revision
        if self.resyncing and self._resync_revision is None:
            self._resync_revision = revision
        in_sync, _ = await self.etcd.get(self.in_sync_key)
        self.eligible = self._eligible(in_sync)
        self.restarted = held is None and not self.eligible and self._restarted(in_sync)
        if not self.restarted:
            self._restarted_since = None
        wait = WATCH_SECONDS
        if held is not None:
            self._follow(held)
        elif not self.restored():
            wait = self.ttl / 3  # no campaign before its state is restored
        elif self.eligible or self.restarted:
            aside = self._stand_aside - time.monotonic()
            if aside <= 0 and (self.eligible or await self._may_lead_restarted(in_sync)):
                await self._campaign(in_sync, restarted=not self.eligible)
                return
            # A replica holding more writes may take the lead meanwhile; one restarted asks
            # the others again a TTL later (their state changes without any key changing).
            wait = max(aside, 0.0) if self.eligible else max(aside, self.ttl)
        await self.etcd.watch(self.base + "/", revision, wait, prefix=True)

    def _follow(self, held: KeyValue) -> None:
        """Become a backup of the key's holder (at its epoch), unless it is this URL (a key
        left by this replica's previous process: wait until its lease ends)."""
        doc = _json(held)
        primary = doc.get("url") if doc else None
        epoch = held.create_revision
        role = self.role
        if not isinstance(primary, str) or primary == self.url or epoch < role.epoch:
            if role.kind == PRIMARY:
                role.step_down()
            return
        if role.kind != "backup" or role.primary != primary or role.epoch != epoch:
            logger.info("shard %s: backup of %s at epoch %d", self.primary_key, primary, epoch)
            role.become_backup(primary, epoch)

    def _eligible(self, in_sync: KeyValue | None) -> bool:
        """Whether this replica has every acknowledged write (module docstring)."""
        if self.resyncing and self._resync_revision is None:
            return False
        if in_sync is None:
            return not self.resyncing
        doc = _json(in_sync)
        replicas = doc.get("replicas") if doc else None
        if not isinstance(replicas, list) or self.url not in replicas:
            return False
        if self.started_revision is None or in_sync.mod_revision <= self.started_revision:
            return False
        processes = doc.get("processes") if doc else None
        if isinstance(processes, dict) and processes.get(self.url) != self.process:
            return False  # listed, but as a process before this one: what it held is gone
        if self.resyncing:
            assert self._resync_revision is not None
            if in_sync.mod_revision <= self._resync_revision:
                return False
            self.resyncing, self._resync_revision = False, None
            logger.info("shard %s: confirmed in-sync after its state was replaced", self.base)
        return True

    def _restarted(self, in_sync: KeyValue | None) -> bool:
        """Whether the in-sync set lists this replica from before it started (so the whole
        group may have restarted: module docstring)."""
        doc = _json(in_sync)
        replicas = doc.get("replicas") if doc else None
        return (
            in_sync is not None
            and isinstance(replicas, list)
            and self.url in replicas
            and not self.resyncing
            and self.started_revision is not None
            and in_sync.mod_revision <= self.started_revision
        )

    async def _may_lead_restarted(self, in_sync: KeyValue | None) -> bool:
        """Whether this restarted replica may campaign now (module docstring): no listed
        replica it reaches is eligible, still restoring, or more complete; and every listed
        one answered, or :data:`RESTART_GRACE_TTLS` TTLs passed and this one holds writes."""
        others = [u for u in self._members(in_sync) if u != self.url]
        reached = await self._survey(others)
        mine = self.position()
        if any(p.eligible or not p.restored or p.position > mine for p in reached.values()):
            return False
        if len(reached) == len(others):
            return True
        now = time.monotonic()
        if self._restarted_since is None:
            self._restarted_since = now
            logger.warning(
                "shard %s: no primary and no eligible replica: the group restarted; %s do not "
                "answer: this replica (epoch %d, lsn %d) leads without them in %d s if they "
                "still do not",
                self.base,
                ", ".join(u for u in others if u not in reached),
                *mine,
                RESTART_GRACE_TTLS * self.ttl,
            )
        return mine != (0, 0) and now - self._restarted_since >= RESTART_GRACE_TTLS * self.ttl

    def _role_changed(self, old: RoleView, new: RoleView) -> None:
        """A primary that stops being one (a newer epoch reached it) is not eligible until its
        next round reads the in-sync set again: the set it was listed in may be gone."""
        if old.kind == PRIMARY and new.kind != PRIMARY:
            self.eligible = False

    def replaced(self) -> None:
        """This replica's whole state was just replaced by its primary's (a catch-up): it is
        not eligible until its primary writes the in-sync set listing it again, after this (a
        listing from before says nothing of the state it holds now)."""
        self.resyncing, self._resync_revision = True, None
        self.eligible = False

    async def _campaign(self, in_sync: KeyValue | None, restarted: bool = False) -> None:
        """Campaign for the primary key; lead if won (``restarted``: as a replica of a whole
        group restarted, which stands aside for any replica it reaches that is eligible,
        restoring or more complete)."""
        if self._stopping:
            return
        lease, ttl = await self.etcd.grant(self.ttl)
        granted = time.monotonic()
        self.lease = lease
        try:
            value = json.dumps({"url": self.url}).encode()
            epoch, _ = await self.etcd.create(self.primary_key, value, lease)
            if not epoch:
                return  # another replica won: the next round follows it
            members = self._members(in_sync)
            reached = await self._survey([u for u in members if u != self.url])
            if self._stopping:
                return  # the finally below gives the key back
            mine = self.position()
            ahead = [
                u
                for u, peer in reached.items()
                if (peer.eligible and (restarted or peer.position > mine))
                or (restarted and (not peer.restored or peer.position > mine))
            ]
            if ahead:  # a replica holds writes this one does not: let it lead instead
                logger.warning(
                    "shard %s: %s holds more writes than this replica (epoch %d, lsn %d): "
                    "not leading",
                    self.base,
                    ", ".join(ahead),
                    *mine,
                )
                self._stand_aside = time.monotonic() + self.ttl
                return
            # In the in-sync set: the replicas that answered holding what this one holds, the
            # same newest write (so the same log up to it). One that lags, or holds a write this
            # one never had, is left out: listed, it could be elected before it has every
            # acknowledged write; the forwarder brings it back once it has them.
            same = [u for u in members if u in reached and reached[u].position == mine]
            members = [self.url, *same]
            processes = {self.url: self.process, **{u: reached[u].process for u in same}}
            if not await self._write_in_sync(
                members, epoch, in_sync.mod_revision if in_sync else 0, processes
            ):
                return  # changed under us: nobody may lead on an in-sync set it did not read
            self.eligible, self.restarted = True, False  # listed in a set written just now
            self.role.hold_until(granted + ttl * 2 / 3)
            # Primary with every replica of the group first, then only the in-sync ones: the
            # forwarder keeps a link (and so feeds and lets back in) every backup it was
            # ever given, and nothing is acknowledged between the two calls.
            self.role.become_primary(epoch, [u for u in self.group if u != self.url])
            self.role.set_in_sync([u for u in members if u != self.url])
            logger.info(
                "shard %s: primary at epoch %d (lease %ds), in-sync %s",
                self.primary_key,
                epoch,
                ttl,
                ", ".join(members),
            )
            await self._hold(lease, ttl, epoch)
        finally:
            if self._confirming is not None:
                self._confirming.cancel()
                self._confirming = None
            if self.role.kind == PRIMARY:
                self.role.step_down()
            self.role.hold_until(None)
            self.lease = 0
            with contextlib.suppress(EtcdError):
                await self.etcd.revoke(lease)

    async def _survey(self, urls: list[str]) -> dict[str, Peer]:
        """The replicas of ``urls`` that answer ``GET /v1/cluster`` now: their (epoch, lsn)
        (the newest write they hold), whether they may campaign and are restored. One that
        does not answer within :data:`SURVEY_SECONDS` is left out of a new primary's in-sync
        set: writes would wait for it in vain."""

        async def ask(url: str) -> tuple[str, Peer | None]:
            try:
                reply = await self._http.get(url + "/v1/cluster", timeout=SURVEY_SECONDS)
                info = reply.json() if reply.status_code == 200 else None
            except (httpx2.HTTPError, ValueError):
                return url, None
            if not isinstance(info, dict):
                return url, None
            view, campaign = info.get("replication"), info.get("leadership")
            if not isinstance(view, dict):
                return url, None
            lsn, epoch = view.get("lsn"), view.get("lsn_epoch")
            eligible = isinstance(campaign, dict) and campaign.get("eligible") is True
            restored = not isinstance(campaign, dict) or campaign.get("restored") is not False
            process = info.get("incarnation")
            if type(lsn) is not int or type(epoch) is not int or not isinstance(process, str):
                return url, None
            return url, Peer((epoch, lsn), eligible, restored, process)

        found = await asyncio.gather(*(ask(u) for u in urls))
        return {url: answer for url, answer in found if answer is not None}

    def _members(self, in_sync: KeyValue | None) -> list[str]:
        """The in-sync set of a new primary: this replica and the replicas the previous set
        listed (every replica of the group for a new fleet)."""
        doc = _json(in_sync)
        listed = doc.get("replicas") if doc else None
        if in_sync is None or not isinstance(listed, list):
            listed = list(self.group)
        return [self.url] + [u for u in self.group if u in listed and u != self.url]

    async def _write_in_sync(
        self, members: list[str], epoch: int, mod_revision: int, processes: dict[str, str]
    ) -> bool:
        """Write the in-sync set (``processes``: the process of each member known to hold
        every write, kept for members only) if its key is still at ``mod_revision``."""
        known = {u: processes[u] for u in members if u in processes}
        value = json.dumps({"epoch": epoch, "replicas": members, "processes": known}).encode()
        done, _ = await self.etcd.replace(self.in_sync_key, value, mod_revision)
        return bool(done)

    async def _hold(self, lease: int, ttl: int, epoch: int) -> None:
        """Keep the lease alive every third of its TTL while this replica is primary at
        ``epoch``; return when it is lost (or about to be: the role stopped acknowledging)."""
        deadline = time.monotonic() + ttl * 2 / 3
        while not self._stopping:
            await asyncio.sleep(ttl / 3)
            role = self.role
            if role.kind != PRIMARY or role.epoch != epoch:
                return  # stepped down meanwhile (a backup told it a newer epoch exists)
            sent = time.monotonic()
            try:
                await asyncio.wait_for(self.etcd.keepalive(lease), max(0.01, deadline - sent))
            except LeaseLost:
                logger.warning("shard %s: lease lost at epoch %d", self.primary_key, epoch)
                return
            except (EtcdError, asyncio.TimeoutError, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "shard %s: no keepalive within 2/3 of the lease (%s): stepping down",
                        self.primary_key,
                        exc,
                    )
                    return
                continue
            deadline = sent + ttl * 2 / 3
            role.hold_until(deadline)
            if (
                sent - self._confirmed >= ttl
                and self.caught_up()
                and (self._confirming is None or self._confirming.done())
            ):
                # Asking the backups may take a second: never in the way of the keepalives.
                self._confirmed = sent
                self._confirming = asyncio.get_running_loop().create_task(self._confirm(epoch))

    async def _confirm(self, epoch: int) -> None:
        """Write the in-sync set again as it is, naming each member's process, once every
        backup of it says that it holds every write this primary held when it asked: a replica
        of it that restarted since the set was last written becomes eligible. Its own answer is what
        counts, not what the forwarder last heard from it: a backup that restarted empty is
        counted as caught up by the forwarder until this answer tells it otherwise
        (:attr:`behind`), and its link then feeds it."""
        mine = self.position()
        backups = self.role.in_sync
        reached = await self._survey(list(backups))
        found, _ = await self.etcd.get(self.in_sync_key)
        doc = _json(found)
        named = doc.get("processes") if doc else None
        confirmed = named if isinstance(named, dict) else {}
        for url, peer in reached.items():
            # A process the set does not name that lags: it restarted since it was confirmed
            # (one confirmed that lags has writes on the way), and its link may count it as
            # holding what the process before it held.
            if peer.position < mine and confirmed.get(url) != peer.process:
                self.behind(url, peer.position)
        # A backup holds every write this primary held when the survey began if its newest
        # is that one or a later one of this primary's (writes keep coming while it is asked:
        # one that must match exactly is never confirmed while a worker writes without pause).
        if any(u not in reached or reached[u].position < mine for u in backups):
            return  # one does not answer, or lags: its process is not confirmed
        if found is None or doc is None or doc.get("epoch") != epoch:
            return
        members = [self.url, *backups]
        processes = {self.url: self.process, **{u: reached[u].process for u in backups}}
        if self.role.kind == PRIMARY and self.role.epoch == epoch and self.role.in_sync == backups:
            await self._write_in_sync(members, epoch, found.mod_revision, processes)

    # -- the in-sync set --------------------------------------------------------------------

    async def drop(self, url: str) -> bool:
        """Remove ``url`` from the in-sync set (it stopped acknowledging): only once etcd has
        it may the primary acknowledge writes without it. ``False`` when this replica is no
        longer primary at its epoch (it must not acknowledge then)."""
        return await self._change(lambda members: [u for u in members if u != url], url)

    async def add(self, url: str) -> bool:
        """Add ``url`` (one of the group, caught up) to the in-sync set."""
        if url not in self.group:
            return False
        return await self._change(
            lambda members: [*members, url] if url not in members else members, url
        )

    async def _change(self, change: Callable[[list[str]], list[str]], url: str) -> bool:
        try:
            return await self._try_change(change)
        except EtcdError as exc:  # the set stays as it was: the writes waiting keep waiting
            self._warn("shard %s: cannot change the in-sync set for %s: %s", self.base, url, exc)
            return False

    async def _try_change(self, change: Callable[[list[str]], list[str]]) -> bool:
        epoch = self.role.epoch
        for _ in range(5):
            if self.role.kind != PRIMARY or self.role.epoch != epoch:
                return False
            found, _ = await self.etcd.get(self.in_sync_key)
            doc = _json(found)
            listed = doc.get("replicas") if doc else None
            if (
                found is None
                or doc is None
                or doc.get("epoch") != epoch
                or not isinstance(listed, list)
            ):
                return False  # another primary wrote it: this one is no longer primary
            members = change([u for u in listed if isinstance(u, str)])
            processes = doc.get("processes")
            kept = processes if isinstance(processes, dict) else {}
            if await self._write_in_sync(members, epoch, found.mod_revision, kept):
                if self.role.kind == PRIMARY and self.role.epoch == epoch:
                    self.role.set_in_sync(members)
                    return True
                return False
        return False

    def _warn(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged >= 5.0:
            self._logged = now
            logger.warning(fmt, *args)


def from_state(state: Any) -> Leadership | None:
    """The campaign a shard's ``app.state`` asks for (``--etcd``), ``None`` without etcd; it
    takes over the forwarder's changes of the in-sync set (``replication.forwarder``'s
    ``drop`` and ``rejoin``: in etcd first, then in the role)."""
    config = state.config
    if not config.etcd:
        return None
    replication = state.replication
    log, role, links = replication.log, state.role, replication.forwarder.links

    held = [0]  # the log's head at the previous call

    def caught_up() -> bool:
        """Every backup of the in-sync set has applied every write this primary held at the
        previous call (a keepalive or more earlier): a write still on its way to a backup is
        not a lag, or a primary written to without pause would never confirm its backups."""
        head, before = log.head, held[0]
        held[0] = head
        for url in role.in_sync:
            link = links.get(url)
            acked = link.acked if link is not None else None
            if before and (acked is None or acked < before):
                return False
        return True

    leadership = Leadership(
        state.role,
        EtcdClient(config.etcd),
        prefix=config.etcd_prefix,
        index=config.shard_index,
        url=config.advertise_url,
        group=config.replica_group,
        ttl=config.lease_ttl,
        position=lambda: log.position,
        caught_up=caught_up,
        restored=lambda: state.gate.phase not in ("restoring", "failed"),
        headers={"authorization": f"Bearer {config.token[0]}"} if config.token else None,
        process=state.incarnation,
    )

    async def drop(url: str) -> None:
        await leadership.drop(url)

    async def rejoin(url: str) -> None:
        await leadership.add(url)

    replication.forwarder.drop = drop
    replication.forwarder.rejoin = rejoin
    leadership.behind = replication.forwarder.recheck
    # Elected holding every acknowledged write: a backup holding writes it lacks holds only
    # unacknowledged ones, and is replaced by its state.
    replication.forwarder.authoritative = True
    replication.replayer.replaced = leadership.replaced
    return leadership
