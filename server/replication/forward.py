"""A primary's side of replication: its log forwarded to each backup, and writes acknowledged
once the backups have them.

:class:`Forwarder` keeps one :class:`Link` per backup while this replica is primary: a task
with a persistent HTTP connection (the SDK's own keep-alive HTTP/1.1 pool,
``client_sdk._http.asyncpool``: a batch's tensors are written from the log's arrays, never
joined into one buffer) that sends the log's entries the backup lacks as one
``POST /v1/replicate`` batch (docs/PROTOCOL.md §6), waits for the answer (the lsn the backup
applied up to), and sends what was added meanwhile as the next batch: while one batch is in
flight the writes that follow gather into the next (group commit), so many small writes share
one round trip. A link starts by sending an empty batch, which tells it where the backup is.

A link waiting for entries does not wait for its task's turn on the loop to send the next: the
log calls :meth:`Forwarder.kick` as it commits an entry (a push on the loop: before it applies),
which encodes the batch and hands the socket as much of it as it takes at once (the request's
own tensor memory: nothing joined or copied), so the backup receives and applies it while this
replica applies it; the link's task sends the rest, if any, and waits for the answer.

:meth:`Forwarder.synced` is what a write's answer waits for: every backup of the role's
in-sync set has applied the log up to the write's lsn. A backup that has not for
``timeout`` seconds is dropped from the in-sync set (:attr:`Forwarder.drop`: without a
coordination service, the role's set changes here; with one, leadership changes it first, so
that no replica that lacks a write acknowledged can be elected); the writes waiting go on
without it. Its link keeps sending, and once it has applied everything the log holds it is
let back into the set (:attr:`Forwarder.rejoin`). A backup that needs entries the log no
longer holds is ``behind``: it needs a snapshot, not the tail. Each batch of entries names the
(lsn, epoch) it follows, and the backup applies it only where its log agrees
(:mod:`server.replication.replay`); a backup whose log holds a write this primary's does not (a
former primary's write that was never acknowledged) is ``diverged``: a state has no undo, so it
is sent this primary's whole state, as a ``behind`` one is. A backup that answers 409
``stale_epoch`` knows a newer primary: this replica steps down at once.

A link waiting for the log's next entry counts its backup as holding every write; one that
restarted meanwhile (empty, or from an older snapshot) says otherwise when leadership's survey
asks it (:meth:`Forwarder.recheck`), and its link then asks it where it is and feeds it at once,
with no write coming. A link's task that fails (a bug) is logged and starts over
(:meth:`Forwarder._run`).

Once every backup this primary was given has said it applied the log up to some lsn (the last
it said, for one that stopped answering: it will ask for what follows), the entries up to it
are let go (:meth:`ReplicationLog.release <server.replication.log.ReplicationLog.release>`),
and each batch tells the backups that lsn (``stable``), so that they let go of theirs too: as
primary, none of them would have to send those again either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from client_sdk import wire
from client_sdk._http.asyncpool import AsyncHTTPPool, Begun
from client_sdk._http.http11 import Exchange, Origin

from ..errors import ShardError
from .log import TENSOR, ReplicationLog
from .role import PRIMARY, Role, RoleView, not_primary
from .stages import Stager, Staging

__all__ = ["Forwarder", "Link", "StageMissing"]

logger = logging.getLogger("paramshard.replication")

#: A link's pause after a failed send: doubled per failure in a row, up to :data:`MAX_BACKOFF`.
FIRST_BACKOFF = 0.02
MAX_BACKOFF = 0.5
#: The largest answer a backup may send (a batch's answer is a few dozen bytes).
MAX_REPLY = 1 << 20
#: A link whose task fails again and again logs it at most once per this many seconds.
LOG_EVERY = 10.0


class StageMissing(Exception):
    """A backup does not hold stages a batch named (:mod:`server.replication.stages`)."""

    def __init__(self, ids: list[str]) -> None:
        super().__init__(f"missing stages {ids}")
        self.ids = ids


class Link:
    """One backup, as its primary's forwarder sees it."""

    def __init__(self, url: str) -> None:
        self.url = url
        #: The lsn the backup said it applied up to (None: not heard from yet).
        self.acked: int | None = None
        #: The last lsn it said it applied up to, kept while it does not answer (None: not
        #: heard from, or its log is not this primary's): the log holds what follows it.
        self.known: int | None = None
        #: ``time.monotonic()`` of its last answer (or of the link's start).
        self.heard = time.monotonic()
        #: ``starting``, ``streaming``, ``behind`` (it needs entries the log let go),
        #: ``unreachable``, ``failed`` (its task failed: a bug, logged; it starts over),
        #: ``diverged`` (its log holds a write this primary's does not: it is sent this
        #: primary's whole state), ``ahead`` (it holds writes this primary lacks, and this
        #: primary is not authoritative: nothing is sent to it).
        self.state = "starting"
        self.batches = 0
        #: Catch-ups sent (the whole state, when it needed writes the log let go).
        self.installs = 0
        self.failures = 0
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None
        #: Whether its task waits for the log's next entry (a batch may start at once).
        self.idle = False
        #: A batch :meth:`Forwarder.kick` started for it (entries, exchange), not yet finished.
        self.started: tuple[list[Any], Begun] | None = None
        #: ``time.monotonic()`` of the last failure of its task logged (:meth:`Forwarder._run`).
        self.logged = -LOG_EVERY

    def stats(self, head: int) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "acked": self.acked,
            "lag": None if self.acked is None else max(0, head - self.acked),
            "batches": self.batches,
            "installs": self.installs,
            "failures": self.failures,
            "error": self.error,
        }


class Forwarder:
    """Forwards this primary's log to its backups (module docstring)."""

    def __init__(
        self,
        role: Role,
        log: ReplicationLog,
        *,
        timeout: float,
        batch_bytes: int,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.role = role
        self.log = log
        self.timeout = timeout
        self.batch_bytes = batch_bytes
        self.headers = {"content-type": wire.FRAME, "accept": wire.MSGPACK, **(headers or {})}
        self.links: dict[str, Link] = {}
        self._pool: AsyncHTTPPool | None = None
        self._origins: dict[str, Origin] = {}
        self._changed = asyncio.Event()
        self._dropping: set[str] = set()
        #: Take a backup out of the in-sync set / let it back in (awaited before the writes
        #: waiting for it go on). Leadership replaces them; by default the role changes here.
        self.drop: Callable[[str], Awaitable[None]] = self._drop_here
        self.rejoin: Callable[[str], Awaitable[None]] = self._rejoin_here
        #: The state now as a catch-up's files (:func:`server.replication.catchup.capture_files`),
        #: for a backup that needs writes the log let go; ``None``: such a backup stays behind.
        self.snapshot: Callable[[], Awaitable[dict[str, Any]]] | None = None
        #: Whether this primary's log is the group's (it was elected holding every acknowledged
        #: write, leadership sets it): a backup holding writes it lacks is then replaced by its
        #: state (``diverged``). Without (static roles) such a backup is ``ahead``: left alone.
        self.authoritative = False
        self._running = False
        #: Streams big bodies to the backups while they arrive (:mod:`.stages`).
        self.stager = Stager(self.headers)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Follow the role from now on (on the event loop)."""
        self._running = True
        self.log.on_commit = self.kick
        self.role.subscribe(self._role_changed)
        self._role_changed(self.role.view, self.role.view)

    def kick(self) -> None:
        """Start the next batch now for each link waiting for one (module docstring): called
        as an entry commits, maybe in the middle of a write, so it never raises nor waits."""
        if not self._running or self.role.kind != PRIMARY:
            return
        for link in self.links.values():
            if not link.idle or link.started is not None or link.acked is None:
                continue
            try:
                entries = self.log.since(link.acked, self.batch_bytes)
                if entries:
                    link.started = (entries, self._http().begin(self._exchange(link, entries)))
            except Exception:  # the link's task sends it the usual way
                logger.exception("starting a batch to %s failed", link.url)

    def stage_body(self, buf: memoryview) -> Staging | None:
        """Stream the big body ``buf`` receives to the backups that are streaming (module
        docstring of :mod:`.stages`); ``None`` when none is, or when the body is above the
        log's bound (which bounds the stages a backup holds too)."""
        if not self._running or self.role.kind != PRIMARY or buf.nbytes > self.log.max_bytes:
            return None
        urls = [u for u, link in self.links.items() if link.state == "streaming"]
        return self.stager.begin(urls, buf) if urls else None

    async def stop(self) -> None:
        self._running = False
        self.stager.stop()
        if self.log.on_commit == self.kick:
            self.log.on_commit = None
        for link in list(self.links.values()):
            await self._stop_link(link)
        self.links.clear()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        self._wake()

    def _role_changed(self, old: RoleView, new: RoleView) -> None:
        if not self._running:
            return
        if new.kind != PRIMARY:
            for link in list(self.links.values()):
                if link.task is not None:
                    link.task.cancel()
            self.links.clear()
        else:
            for url in new.in_sync:
                if url not in self.links:
                    link = self.links[url] = Link(url)
                    self._start_link(link)
        self._wake()

    async def _stop_link(self, link: Link) -> None:
        if link.task is not None:
            link.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await link.task

    # -- acknowledging ------------------------------------------------------------------------

    async def synced(self, lsn: int) -> None:
        """Return once every backup of the in-sync set has applied the log up to ``lsn``
        (backups that stay behind for ``timeout`` seconds dropped from the set meanwhile);
        421 ``not_primary`` if this replica stops acknowledging (or its epoch changes)
        before."""
        role = self.role
        epoch = role.epoch
        since = time.monotonic()
        while True:
            if not role.acknowledges or role.epoch != epoch:
                raise not_primary(role.view)
            missing = [
                url
                for url in role.in_sync
                if (link := self.links.get(url)) is None or link.acked is None or link.acked < lsn
            ]
            if not missing:
                return
            changed = self._changed
            left = since + self.timeout - time.monotonic()
            if left > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
                continue
            for url in missing:
                await self._drop(url)
            since = time.monotonic()

    async def _drop(self, url: str) -> None:
        if url in self._dropping or url not in self.role.in_sync:
            return
        self._dropping.add(url)
        try:
            logger.warning(
                "backup %s has not applied the writes waiting for it within %.3g s "
                "(--replica-timeout): dropped from the in-sync set; it rejoins once it has "
                "caught up",
                url,
                self.timeout,
            )
            await self.drop(url)
        finally:
            self._dropping.discard(url)
            self._wake()

    async def _drop_here(self, url: str) -> None:
        if self.role.kind == PRIMARY:
            self.role.set_in_sync([u for u in self.role.in_sync if u != url])

    async def _rejoin_here(self, url: str) -> None:
        if self.role.kind == PRIMARY and url not in self.role.in_sync:
            self.role.set_in_sync([*self.role.in_sync, url])

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- one backup ---------------------------------------------------------------------------

    def _http(self) -> AsyncHTTPPool:
        if self._pool is None:
            self._pool = AsyncHTTPPool(
                max_idle=1,
                connect_timeout=min(self.timeout, 2.0),
                timeout=self.timeout,
                max_reply=MAX_REPLY,
            )
        return self._pool

    def _start_link(self, link: Link) -> None:
        link.task = asyncio.get_running_loop().create_task(
            self._run(link), name=f"paramshard-forward-{link.url}"
        )

    async def _run(self, link: Link) -> None:
        """Feed the backup of ``link`` until cancelled (or it knows a newer primary). A failed
        exchange is handled in the feed; anything else raised there is a bug, which must not end
        the link (its backup would never be fed again, nor let back into the in-sync set): it is
        logged with the backup's URL and traceback, and the link starts over, asking the backup
        where it is first. It is not dropped at once: a write waiting for it drops it after
        ``timeout`` if the link fails again, as for any backup that stops applying writes."""
        backoff = FIRST_BACKOFF
        batches = link.batches
        while True:
            try:
                await self._feed(link)
                return
            except Exception as exc:
                link.failures += 1
                link.error = f"{type(exc).__name__}: {exc}"[:300]
                link.state, link.acked = "failed", None
                if link.batches > batches:  # batches went through since the last failure
                    backoff = FIRST_BACKOFF
                batches = link.batches
                now = time.monotonic()
                if now - link.logged >= LOG_EVERY:
                    link.logged = now
                    logger.exception(
                        "forwarding to backup %s failed (a bug: please report it with this "
                        "traceback); its link starts over in %.3g s",
                        link.url,
                        backoff,
                    )
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
            finally:
                started, link.started = link.started, None
                if started is not None and started[1].conn is not None:
                    started[1].conn.close()  # begun, never finished: mid-request

    def recheck(self, url: str, position: tuple[int, int]) -> None:
        """The backup of ``url`` said (asked by leadership's survey) that it holds the log up
        to ``position`` (epoch, lsn of its newest write). When its link waits for the log's next
        entry, counting it as holding every write, and that is not what it said (it restarted
        since it last answered: empty, or from an older snapshot), the link asks it where it is
        now, and sends it what it lacks, without waiting for a write to come."""
        link = self.links.get(url)
        if (
            link is None
            or link.task is None
            or not link.idle
            or link.started is not None
            or link.acked is None
            or position == (self.log.epoch_at(link.acked), link.acked)
        ):
            return
        logger.info(
            "backup %s holds lsn %d of epoch %d, not the lsn %d it applied: it restarted; "
            "it is sent what it lacks",
            url,
            position[1],
            position[0],
            link.acked,
        )
        link.task.cancel()  # waiting for the log's next entry: nothing begun is lost
        link.acked, link.idle, link.state = None, False, "starting"
        self._start_link(link)

    async def _feed(self, link: Link) -> None:
        backoff = FIRST_BACKOFF
        log = self.log
        while True:
            install = None
            begun = None
            if link.acked is None:
                entries: list[Any] | None = []  # where is it? (or: it is sent a snapshot)
            else:
                if link.acked >= log.head:
                    if link.url not in self.role.in_sync:
                        await self.rejoin(link.url)
                    link.idle = True
                    try:
                        await log.added_after(link.acked)
                    finally:
                        link.idle = False
                started, link.started = link.started, None
                if started is not None:  # the kick sent it, or began to
                    entries, begun = started
                else:
                    entries = log.since(link.acked, self.batch_bytes)
                if entries is None:
                    if link.state != "behind":
                        logger.warning(
                            "backup %s applied up to lsn %d, but this primary holds entries "
                            "from %d only (--replication-log-bytes): it catches up from a "
                            "snapshot of this primary's state",
                            link.url,
                            link.acked,
                            log.first,
                        )
                    link.state = "behind"
                    if self.snapshot is None:
                        await log.added_after(log.head)
                        continue
                    entries = []
            try:
                if begun is None:
                    if link.state in ("behind", "diverged") and self.snapshot is not None:
                        install = await self.snapshot()
                    begun = self._http().begin(self._exchange(link, entries, install))
                applied, applied_epoch = await self._finish(begun)
            except ShardError as exc:  # stale_epoch: a newer primary exists
                logger.warning("backup %s: %s; stepping down", link.url, exc.message)
                self.role.step_down()
                return
            except StageMissing as exc:  # sent again, the bytes inline
                if not self.stager.missed(link.url, exc.ids, entries):
                    await asyncio.sleep(MAX_BACKOFF)  # stages it was not sent: never in a loop
                continue
            except Exception as exc:
                link.failures += 1
                link.error = f"{type(exc).__name__}: {exc}"[:300]
                link.state = "unreachable"
                link.acked = None  # where is it now? (it may have restarted): asked first
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
                continue
            backoff = FIRST_BACKOFF
            await self._answered(link, applied, applied_epoch, install)

    async def _answered(
        self, link: Link, applied: int, applied_epoch: int, install: dict[str, Any] | None
    ) -> None:
        """The backup of ``link`` answered a batch: it applied up to ``applied``, a write of
        ``applied_epoch``."""
        log = self.log
        link.heard = time.monotonic()
        if install is not None:
            link.installs += 1
        known = log.epoch_at(applied)
        if (known is not None and known != applied_epoch) or (
            applied > log.head and self.authoritative
        ):
            # Its log holds a write this primary never had (it led at an older epoch and that
            # write's answer never went out): its state is replaced by this one's.
            if link.state != "diverged":
                logger.warning(
                    "backup %s holds lsn %d of epoch %d, which this primary's log does not (it "
                    "holds lsn %d of epoch %d): a write only it applied; it is sent this "
                    "primary's whole state",
                    link.url,
                    applied,
                    applied_epoch,
                    min(applied, log.head),
                    known if known is not None else log.last_epoch,
                )
            link.state, link.acked, link.known = "diverged", None, None
            if self.snapshot is None:
                await asyncio.sleep(MAX_BACKOFF)
            return
        if applied > log.head:  # it holds writes this primary lacks: never overwrite them
            if link.state != "ahead":
                logger.error(
                    "backup %s holds writes up to lsn %d, this primary only up to %d (it "
                    "came back from an older snapshot): nothing is forwarded to it; make "
                    "the most complete replica the primary (list it first in "
                    "--replica-group) and restart this one",
                    link.url,
                    applied,
                    log.head,
                )
            link.state, link.acked, link.known = "ahead", None, None
            await asyncio.sleep(MAX_BACKOFF)
            return
        link.acked = link.known = applied
        link.state = "streaming"
        link.error = None
        link.batches += 1
        stable = self.stable()
        if stable is not None:
            log.release(stable)
        self._wake()

    def stable(self) -> int | None:
        """The lsn up to which every backup this primary was given has applied its log (each
        as it last said), so no replica will be sent those entries again (module docstring);
        ``None`` while one has not said where it is."""
        known = [link.known for link in self.links.values()]
        if not known or None in known:
            return None
        return min(known)  # type: ignore[type-var]

    def _exchange(
        self, link: Link, entries: list[Any], install: dict[str, Any] | None = None
    ) -> Exchange:
        """The ``POST /v1/replicate`` of a batch (with a catch-up's snapshot first, if
        ``install``), its tensors the entries' own memory; entries name the write they follow
        (``prev``: its lsn and epoch, which the log holds as the one before them)."""
        role = self.role
        wired = []
        stages: list[str] = []
        for e in entries:
            stage = e.stage
            if stage is not None and link.url in stage.links:
                wired.append(stage.refer(e.to_wire()))
                stages.append(stage.id)
            else:
                wired.append(e.to_wire())
        msg: dict[str, Any] = {"epoch": role.epoch, "primary": role.view.url, "entries": wired}
        if stages:
            msg["stages"] = stages
        if entries:
            after = entries[0].lsn - 1
            msg["prev"] = [after, self.log.epoch_at(after)]
            stable = self.stable()
            if stable is not None:
                msg["stable"] = stable
        if install is not None:
            msg["install"] = {**install, "values": {TENSOR: install["values"]}}
        encoded = wire.encode(msg, frame=True)
        origin = self._origins.get(link.url)
        if origin is None:
            origin = self._origins[link.url] = Origin(link.url)
        headers = {**self.headers, "content-length": str(encoded.nbytes)}
        return Exchange(origin, "POST", "/v1/replicate", headers, encoded.chunks)

    async def _finish(self, begun: Begun) -> tuple[int, int]:
        """The rest of a batch begun sent; the lsn the backup applied up to and that write's
        epoch. Raises ``ShardError`` for ``stale_epoch``, another exception for any other
        failure."""
        reply = await self._http().finish(begun)
        msg = wire.unpack(reply.content, reply.headers.get("content-type"))
        if reply.status == 200:
            applied, epoch = msg.get("applied_lsn"), msg.get("lsn_epoch")
            if type(applied) is not int or type(epoch) is not int:
                raise ValueError(f"answer without applied_lsn and lsn_epoch: {str(msg)[:200]}")
            return applied, epoch
        error = msg.get("error") if isinstance(msg.get("error"), dict) else {}
        code, details = error.get("code"), error.get("details") or {}
        if code == "stale_epoch":
            raise ShardError("stale_epoch", str(error.get("message")), details)
        missing = details.get("missing_stages")
        if code == "conflict" and type(missing) is list and missing:
            raise StageMissing([str(i) for i in missing])
        applied, epoch = details.get("applied_lsn"), details.get("lsn_epoch")
        if code == "conflict" and type(applied) is int and type(epoch) is int:
            return applied, epoch  # its log is elsewhere than we thought
        raise RuntimeError(f"{reply.status} {code}: {str(error.get('message'))[:200]}")

    def stats(self) -> list[dict[str, Any]]:
        head = self.log.head
        return [link.stats(head) for link in self.links.values()]
