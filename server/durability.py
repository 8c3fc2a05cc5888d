"""A shard's life around its snapshots: restore at start, snapshot periodically, on request and
on shutdown.

:class:`Durability` is driven by the app's lifespan (``server/app.py``):

* :meth:`start` runs the restore in a background task: the newest valid snapshot of
  ``--data-dir`` (or the one of ``--restore <checkpoint>``) is read in a worker thread while
  ``/healthz`` already answers, then installed in the store; the gate turns ``ready``. A data
  dir that cannot be used turns it ``failed`` and asks the server to exit with status 1.
* every ``--snapshot-interval`` seconds, if anything changed, :meth:`snapshot` writes one;
* :meth:`begin_snapshot` serves a fleet checkpoint (``POST /v1/snapshot`` captures and starts
  the write, ``POST /v1/resume`` waits for it: ``server/routes_checkpoint.py``);
* :meth:`stop` (after uvicorn has finished the requests in flight) writes the final snapshot.

**When the disk refuses** a snapshot (full, over quota, read-only, gone), nothing that is on
disk is touched, and: out of space, the write first frees what no restore needs (temporary
files, plain snapshots older than the newest one known to be whole; never that one, never a
fleet checkpoint) and tries once more; this is what lets the final snapshot on SIGTERM succeed
on a full disk. If it still fails, the shard **cannot persist**: it logs an error naming the
data dir and the cause, refuses writes with 503 (``Gate.cannot_persist``: none is acknowledged
that a restart could lose; reads go on), reports it in ``/readyz`` and ``/v1/cluster``, and
tries again every :data:`PERSIST_RETRY` seconds; the first snapshot that succeeds ends it.

A snapshot is captured while the gate is quiesced (no write being applied), which costs no
copy (``ParameterStore.capture``), then written in a worker thread while the shard serves on;
so a fleet checkpoint pauses writes only while every shard captures, not while they write.
One snapshot is written at a time. Without ``--data-dir`` there are no snapshots and the shard
is ready at once.

Coroutines run on the event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import persistence
from .admission import Gate
from .config import ShardConfig
from .embedding import EmbeddingTables
from .errors import ShardError
from .progress import Progress
from .store import Capture, ParameterStore

__all__ = ["Durability"]

logger = logging.getLogger("paramshard.server")

#: Checkpoint writes remembered, so that a retried resume still finds its snapshot.
_RECENT_CHECKPOINTS = 8
#: Seconds between attempts to write a snapshot while the shard cannot persist.
PERSIST_RETRY = 5.0
#: A write that fails with one of these frees space (older snapshots) and tries once more.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class Durability:
    """Snapshots of one shard (see the module). ``on_fatal`` is called when the shard cannot
    go on (its data dir cannot be restored) and should make the server exit with status 1."""

    def __init__(
        self,
        config: ShardConfig,
        store: ParameterStore,
        gate: Gate,
        incarnation: str,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.gate = gate
        self.incarnation = incarnation
        self.on_fatal = on_fatal
        self.data_dir = Path(config.data_dir) if config.data_dir else None
        #: What the shard came back from (``Snapshot.info()`` plus timings), or ``None``.
        self.restored: dict[str, Any] | None = None
        #: The last snapshot written by this process, or ``None``.
        self.last: dict[str, Any] | None = None
        self.failed: str | None = None
        #: While the last snapshot write failed: ``error`` (its cause, without paths),
        #: ``since`` (Unix seconds) and ``attempts``; else ``None``.
        self.cannot_persist: dict[str, Any] | None = None
        #: The newest snapshot known to be whole (written or restored by this process).
        self._good: int | None = None
        self._failed = asyncio.Event()
        self._saved_mutations = 0
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._checkpoints: dict[str, asyncio.Task] = {}
        self._number = 1
        #: The shard's embedding tables, restored with the store (set by the app).
        self.tables: EmbeddingTables | None = None
        #: A replica's replication (server/replication), if the shard is one: a snapshot
        #: records where it is in the log, and a restore resumes the log there.
        self.replication: Any = None

    @property
    def enabled(self) -> bool:
        return self.data_dir is not None

    # -- lifespan ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin the restore (in the background) and the periodic snapshots."""
        if not self.enabled:
            self.gate.set_phase("ready")
            return
        self._tasks.append(asyncio.create_task(self._restore(), name="paramshard-restore"))

    async def _restore(self) -> None:
        assert self.data_dir is not None
        try:
            found = await asyncio.to_thread(self._read)
        except Exception as exc:  # whatever it is, this shard cannot serve
            self.failed = str(exc)
            if isinstance(exc, (persistence.SnapshotMismatch, OSError)):
                logger.error(
                    "cannot restore shard %s from %s: %s",
                    self.config.fleet,
                    self.data_dir,
                    exc,
                    extra={"event": "restore", "outcome": "failed"},
                )
            else:
                logger.exception(
                    "cannot restore shard %s from %s",
                    self.config.fleet,
                    self.data_dir,
                    extra={"event": "restore", "outcome": "failed"},
                )
            self.gate.set_phase("failed", str(exc).replace(str(self.data_dir), "<data dir>"))
            if self.on_fatal is not None:
                self.on_fatal(str(exc))
            return
        if found is not None:
            self.store.restore(found.variables, found.dedup, found.layouts)
            if self.tables is not None:
                self.tables.restore(found.tables)
            if self.replication is not None:
                self.replication.restored(found.snapshot.manifest.get("replication"))
            self._good = found.snapshot.number
            self.restored = {
                **found.snapshot.info(),
                "seconds": found.seconds,
                "skipped": found.skipped,
            }
            logger.info(
                "shard %s restored snapshot %s (%d variables, %d bytes, state version %d) in %.2fs",
                self.config.fleet,
                found.snapshot.manifest_path.name,
                len(found.variables),
                found.snapshot.manifest["values_bytes"],
                found.snapshot.state_version,
                found.seconds,
                extra={
                    "event": "restore",
                    "outcome": "restored",
                    "snapshot": found.snapshot.manifest_path.name,
                    "variables": len(found.variables),
                    "bytes": found.snapshot.manifest["values_bytes"],
                    "seconds": round(found.seconds, 3),
                },
            )
        else:
            logger.info(
                "shard %s: no snapshot in %s, starting empty",
                self.config.fleet,
                self.data_dir,
                extra={"event": "restore", "outcome": "empty"},
            )
        self._saved_mutations = self.store.mutations
        if self.gate.phase != "restoring":  # SIGTERM arrived meanwhile
            return
        self.gate.set_phase("ready")
        self._tasks.append(asyncio.create_task(self._periodic(), name="paramshard-snapshots"))

    def _read(self) -> persistence.Restorable | None:
        assert self.data_dir is not None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        removed = persistence.clean(self.data_dir)
        if removed:
            logger.warning(
                "removed leftovers of an interrupted snapshot write in %s: %s",
                self.data_dir,
                ", ".join(removed),
            )
        self._number = persistence.next_number(self.data_dir)
        return persistence.find_restorable(
            self.data_dir,
            self.config.shard_index,
            self.config.num_shards,
            self.config.restore,
            self.config.max_table_rows,
            progress=Progress(),  # on standard error, when it is a terminal
        )

    async def _periodic(self) -> None:
        """Every ``--snapshot-interval`` seconds, a snapshot if anything changed; while the
        shard cannot persist, one every :data:`PERSIST_RETRY` seconds, changed or not."""
        interval = self.config.snapshot_interval
        while True:
            if self.cannot_persist is not None:
                await asyncio.sleep(PERSIST_RETRY)
            else:
                self._failed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._failed.wait(), interval if interval > 0 else None)
                if self.cannot_persist is not None:
                    continue  # a write failed meanwhile: the next try is PERSIST_RETRY away
            retry = self.cannot_persist is not None
            if self._lock.locked() or (not retry and self.store.mutations == self._saved_mutations):
                continue
            try:
                await self.snapshot(reason="retry" if retry else "periodic")
            except OSError:
                pass  # logged by _write; the next period tries again
            except Exception:  # logged; the next period tries again
                logger.exception("periodic snapshot of shard %s failed", self.config.fleet)

    async def stop(self) -> None:
        """Stop the background tasks and write a final snapshot if anything changed since the
        last one. Raises what the write raised (the server then exits non-zero)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # cancelled on purpose
                pass
        self._tasks.clear()
        if (
            self.enabled
            and self.gate.phase in ("ready", "draining")
            and self.store.mutations != self._saved_mutations
        ):
            await self.snapshot(reason="shutdown")

    # -- snapshots --------------------------------------------------------------------------

    def require(self) -> None:
        """Raise :class:`ShardError` ``no_data_dir`` unless snapshots can be written."""
        if self.data_dir is None:
            raise ShardError(
                "no_data_dir",
                f"shard {self.config.fleet} was started without "
                "--data-dir, so it cannot write snapshots: restart every shard "
                "with --data-dir DIR (or PARAMSHARD_DATA_DIR)",
            )

    async def snapshot(
        self, checkpoint: str | None = None, *, reason: str = "request"
    ) -> dict[str, Any]:
        """Capture the state at one instant and write it; returns the snapshot's info once it
        is on disk. Raises :class:`ShardError` ``no_data_dir`` without ``--data-dir``, and
        ``OSError`` if the disk refuses."""
        task = await self.begin_snapshot(checkpoint, reason=reason)
        return await asyncio.shield(task)

    async def begin_snapshot(
        self, checkpoint: str | None = None, *, reason: str = "request"
    ) -> asyncio.Task:
        """Capture the state at one instant, now, and start writing it; returns the write's
        task (its result: the snapshot's info). One write at a time: this waits for the one
        before to finish before it captures. A checkpoint's write is found again with
        :meth:`checkpoint_write`."""
        self.require()
        await self._lock.acquire()
        try:
            async with self.gate.quiesce():
                if self.replication is None:
                    capture = self.store.capture()
                else:  # between two forwarded batches on a backup
                    async with self.replication.quiet():
                        capture = self.store.capture()
                        capture.replication = self.replication.position()
            task = asyncio.create_task(self._write(capture, checkpoint, reason))
        except BaseException:
            self._lock.release()
            raise
        task.add_done_callback(self._log_failure)
        if checkpoint is not None:
            self._checkpoints[checkpoint] = task
            while len(self._checkpoints) > _RECENT_CHECKPOINTS:
                del self._checkpoints[next(iter(self._checkpoints))]
        return task

    def checkpoints(self) -> list[dict[str, Any]]:
        """The fleet checkpoints in the data dir, oldest first: ``checkpoint``, ``snapshot``
        (its number) and ``bytes`` (of its two files). Reads only the directory."""
        self.require()
        assert self.data_dir is not None
        out = []
        for number, checkpoint, manifest in persistence.list_snapshots(self.data_dir):
            if checkpoint is not None:
                out.append(
                    {
                        "checkpoint": checkpoint,
                        "snapshot": number,
                        "bytes": _size(manifest) + _size(manifest.with_suffix(".safetensors")),
                    }
                )
        return out

    async def delete_checkpoint(self, checkpoint: str) -> list[str]:
        """Delete the snapshot(s) of fleet checkpoint ``checkpoint``; returns the file names
        removed. Raises :class:`ShardError`: ``not_found`` if there is none, ``conflict`` if
        one is the newest snapshot in the data dir (the state a restart would come back to:
        it goes once a newer snapshot is written)."""
        self.require()
        assert self.data_dir is not None
        async with self._lock:  # no snapshot is written or pruned meanwhile
            snapshots = persistence.list_snapshots(self.data_dir)
            doomed = [path for _, c, path in snapshots if c == checkpoint]
            if not doomed:
                raise ShardError(
                    "not_found",
                    f"shard {self.config.fleet} holds no snapshot of "
                    f"checkpoint {checkpoint!r} (GET /v1/checkpoints lists them)",
                    {"checkpoint": checkpoint},
                )
            if snapshots[-1][2] in doomed:
                raise ShardError(
                    "conflict",
                    f"checkpoint {checkpoint!r} is shard "
                    f"{self.config.fleet}'s newest snapshot, the state it would "
                    "restart from: write a newer one first (POST /v1/snapshot with "
                    "{}), then delete it",
                    {"checkpoint": checkpoint},
                )
            removed = await asyncio.to_thread(persistence.remove, self.data_dir, doomed)
            self._checkpoints.pop(checkpoint, None)
        logger.info(
            "shard %s deleted checkpoint %s (%s)",
            self.config.fleet,
            checkpoint,
            ", ".join(removed),
            extra={"event": "checkpoint", "outcome": "deleted", "checkpoint": checkpoint},
        )
        return removed

    def checkpoint_write(self, checkpoint: str) -> asyncio.Task | None:
        """The write of ``checkpoint``'s snapshot, if this process captured one recently."""
        return self._checkpoints.get(checkpoint)

    async def _write(self, capture: Capture, checkpoint: str | None, reason: str) -> dict[str, Any]:
        """Write ``capture`` (holding the lock, which this releases). Out of space, it frees
        what it safely can and tries once more; if the disk still refuses, the shard cannot
        persist (:meth:`_cannot_persist`) until a later write succeeds."""
        assert self.data_dir is not None
        try:
            number = self._number
            started = time.perf_counter()
            try:
                snap = await self._write_freeing(number, capture, checkpoint)
            except OSError as exc:
                self._number = number + 1  # never reuse a number a leftover may carry
                self._cannot_persist(exc, reason)
                raise
            seconds = time.perf_counter() - started
            self._number = number + 1
            self._good = number
            if self.cannot_persist is not None:
                logger.warning(
                    "shard %s can persist again: snapshot %s written to %s after %d "
                    "failed attempt(s); writes are taken again",
                    self.config.fleet,
                    snap.manifest_path.name,
                    self.data_dir,
                    self.cannot_persist["attempts"],
                )
                self.cannot_persist = None
                self.gate.cannot_persist(None)
            self._saved_mutations = max(self._saved_mutations, capture.mutations)
            removed = await asyncio.to_thread(
                persistence.prune,
                self.data_dir,
                self.config.keep_snapshots,
                self.config.keep_checkpoints,
            )
            self.last = {**snap.info(), "seconds": seconds, "reason": reason}
            logger.info(
                "shard %s wrote snapshot %s (%s: %d variables, %d bytes) in %.2fs%s",
                self.config.fleet,
                snap.manifest_path.name,
                reason,
                len(capture.variables),
                snap.manifest["values_bytes"],
                seconds,
                f"; removed {len(removed)} old file(s)" if removed else "",
                extra={
                    "event": "snapshot",
                    "outcome": "written",
                    "snapshot": snap.manifest_path.name,
                    "checkpoint": checkpoint,
                    "variables": len(capture.variables),
                    "bytes": snap.manifest["values_bytes"],
                    "seconds": round(seconds, 3),
                },
            )
            return self.last
        finally:
            self._lock.release()

    async def _write_freeing(
        self, number: int, capture: Capture, checkpoint: str | None
    ) -> persistence.Snapshot:
        assert self.data_dir is not None
        write = (persistence.write_snapshot, self.data_dir, number, capture)
        try:
            return await asyncio.to_thread(
                *write, incarnation=self.incarnation, checkpoint=checkpoint
            )
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            removed = await asyncio.to_thread(self._free_space)
            if not removed:
                raise
            logger.warning(
                "shard %s: out of space in %s (%s); removed %s to make room and "
                "writes snapshot %d again",
                self.config.fleet,
                self.data_dir,
                exc.strerror,
                ", ".join(removed),
                number,
            )
        return await asyncio.to_thread(*write, incarnation=self.incarnation, checkpoint=checkpoint)

    def _free_space(self) -> list[str]:
        """Remove what no restore needs (holding the lock: no write is under way): temporary
        files, and plain snapshots older than the newest one known to be whole. Never that
        one, never a fleet checkpoint."""
        assert self.data_dir is not None
        removed = persistence.clean(self.data_dir)
        if self._good is not None:
            older = [
                path
                for n, c, path in persistence.list_snapshots(self.data_dir)
                if c is None and n < self._good
            ]
            removed += persistence.remove(self.data_dir, older)
        return removed

    def _cannot_persist(self, exc: OSError, reason: str) -> None:
        """Enter (or stay in) the state where snapshots fail: writes are refused (503) so
        none is acknowledged that a restart could lose, ``/readyz`` says why, and
        :meth:`_periodic` tries again every :data:`PERSIST_RETRY` seconds."""
        problem = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
        state = self.cannot_persist
        if state is None:
            state = self.cannot_persist = {
                "error": problem,
                "errno": exc.errno,
                "since": time.time(),
                "attempts": 0,
            }
        state.update(error=problem, errno=exc.errno)
        state["attempts"] += 1
        self.gate.cannot_persist(
            f"{problem}; the shard retries every {PERSIST_RETRY:g}s", PERSIST_RETRY
        )
        self._failed.set()
        logger.error(
            "shard %s cannot persist: writing a snapshot (%s) to %s failed: %s; "
            "writes are refused until a snapshot succeeds (retried every %gs; "
            "attempt %d): free space in the data dir or fix its permissions",
            self.config.fleet,
            reason,
            self.data_dir,
            exc,
            PERSIST_RETRY,
            state["attempts"],
        )

    def _log_failure(self, task: asyncio.Task) -> None:
        if (
            not task.cancelled()
            and task.exception() is not None
            and not isinstance(task.exception(), OSError)
        ):  # those: _cannot_persist
            logger.error(
                "shard %s: writing a snapshot failed: %r", self.config.fleet, task.exception()
            )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
