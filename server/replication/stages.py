"""Cut-through for big writes: a request body streamed to the backups while it arrives.

A primary forwards a write only once it took it whole (an entry of its log,
:mod:`server.replication.forward`), so without this a big push crosses loopback twice in
series: the worker's body to the primary, then the same bytes to each backup. Here, while a
big body (:data:`STAGE_FROM` bytes or more) arrives at a primary that has backups, its bytes
are also written, as they come, to each backup that is streaming, as a **stage**:
``POST /v1/stage`` with ``X-Paramshard-Stage: <id>`` on a connection of its own per backup
(:class:`Stager`, the primary's side). The backup keeps the bytes as they are
(:class:`StageStore`). A stage is never applied on its own: the write's log entry, forwarded
as usual in lsn order, names it (``"stages"``, and each array that lies in the body as
``{"#staged": [id, tensor map]}``, its offset in the stage) instead of carrying the bytes, and
the backup's replay takes the stage when it applies that entry (:mod:`server.replication.replay`).
So a primary that dies mid-stream, or a body refused, leaves nothing applied anywhere.

Ids are ``<random token of the primary process>/<n>``: unique per primary process. A backup
waits for a stage an entry names at most ``wait`` seconds; one it does not hold (it restarted,
the stream broke) is answered 409 ``conflict`` with ``details.missing_stages``, changing
nothing, and the primary sends that entry again with its bytes inline (it never names that
stage to that backup again). A stage whose body does not arrive whole (the worker left, the
primary went) is let go at once; one no entry took (the primary refused the write) is let go
after ``max_age`` seconds, or sooner when the stages held pass ``max_bytes``
(docs/PROTOCOL.md §6, Limits).

Thread-safety: none; the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from starlette.requests import Request

from client_sdk import wire
from client_sdk._http.http11 import Origin
from client_sdk.wire.tensors import dtype_str

from ..errors import ShardError
from .log import TENSOR, current_stage

__all__ = ["STAGED", "STAGE_FROM", "Stage", "StageStore", "Stager", "current_stage"]

logger = logging.getLogger("paramshard.replication")

#: Bodies of at least this many bytes are streamed to the backups while they arrive.
STAGE_FROM = 1 << 20
#: The key of the one-entry map naming an array's bytes in a stage: ``[id, tensor map]``.
STAGED = "#staged"
#: The header naming a stage.
HEADER = wire.HEADER_STAGE


class Stage:
    """A body a primary streamed (or is streaming) to some backups: its id, where its bytes
    lie in memory, and the backups sent the whole of it."""

    __slots__ = ("id", "start", "end", "links")

    def __init__(self, stage_id: str, buf: memoryview) -> None:
        self.id = stage_id
        self.start = np.frombuffer(buf, np.uint8).ctypes.data
        self.end = self.start + buf.nbytes
        self.links: set[str] = set()

    def refer(self, obj: Any) -> Any:
        """``obj`` (an entry's wire form) with each array lying in this body named by its
        place in the stage instead of carried."""
        if type(obj) is dict:
            if len(obj) == 1 and TENSOR in obj:
                a = obj[TENSOR]
                at = a.ctypes.data
                if a.flags.c_contiguous and self.start <= at and at + a.nbytes <= self.end:
                    return {
                        STAGED: [
                            self.id,
                            {
                                "dtype": dtype_str(a.dtype),
                                "shape": list(a.shape),
                                "offset": at - self.start,
                                "nbytes": a.nbytes,
                            },
                        ]
                    }
                return obj
            return {k: self.refer(v) for k, v in obj.items()}
        if type(obj) is list:
            return [self.refer(v) for v in obj]
        return obj


class _Conn:
    """A primary's connection for stages to one backup: one stage at a time."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.writer: asyncio.StreamWriter | None = None
        self.busy = True  # until connected; then while a stage's answer is awaited
        self.task: asyncio.Task[None] | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None
        self.busy = True


class Stager:
    """The primary's side (module docstring): which backups a big body is streamed to."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.prefix = secrets.token_hex(6)
        self.count = 0
        self.auth = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k == "authorization")
        self._conns: dict[str, _Conn] = {}
        #: Stages begun / whose stream to a backup broke.
        self.sent = 0
        self.broken = 0
        #: Stages a backup said it did not hold (their entries were sent again, inline).
        self.resent = 0

    def begin(self, urls: Iterable[str], buf: memoryview) -> Staging | None:
        """Start streaming the body that ``buf`` receives to the backups of ``urls`` that have
        an idle stage connection (a connection is made for the others, for the next body);
        ``None`` when none has."""
        streams: list[tuple[str, _Conn]] = []
        for url in urls:
            conn = self._conns.get(url)
            if conn is None:
                conn = self._conns[url] = _Conn(Origin(url))
                if not conn.origin.tls and not conn.origin.prefix:
                    conn.task = asyncio.get_running_loop().create_task(self._serve(url, conn))
                continue
            if not conn.busy and conn.writer is not None and not conn.writer.is_closing():
                streams.append((url, conn))
        if not streams:
            return None
        self.count += 1
        self.sent += 1
        stage = Stage(f"{self.prefix}/{self.count}", buf)
        for url, conn in streams:
            head = (
                f"POST /v1/stage HTTP/1.1\r\nhost: {conn.origin.host_header}\r\n"
                f"content-type: application/octet-stream\r\ncontent-length: {buf.nbytes}\r\n"
                f"{HEADER}: {stage.id}\r\n{self.auth}\r\n"
            )
            conn.busy = True
            conn.writer.write(head.encode())  # type: ignore[union-attr]
            stage.links.add(url)
        return Staging(self, stage, buf, streams)

    def abort(self, stage: Stage) -> None:
        """The body did not arrive whole: its streams end, so the backups let go of it."""
        for url in stage.links:
            conn = self._conns.get(url)
            if conn is not None:
                conn.close()  # _serve connects again
        stage.links.clear()

    def missed(self, url: str, ids: list[str], entries: Iterable[Any]) -> int:
        """The backup of ``url`` does not hold the stages ``ids``: ``entries`` name them to it
        no more (they carry their bytes). Returns how many of them named one to it."""
        self.resent += len(ids)
        named = 0
        for entry in entries:
            stage = entry.stage
            if stage is not None and stage.id in ids and url in stage.links:
                stage.links.discard(url)
                named += 1
        return named

    async def _serve(self, url: str, conn: _Conn) -> None:
        """Keep ``conn`` connected and read the answers of its stages."""
        backoff = 0.05
        while True:
            try:
                reader, conn.writer = await asyncio.open_connection(
                    conn.origin.host, conn.origin.port
                )
                conn.busy = False
                backoff = 0.05
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    await reader.readexactly(length)
                    if not head.startswith(b"HTTP/1.1 200"):
                        # Refused, maybe before the whole body was read: never reused.
                        raise ConnectionError(head.split(b"\r\n")[0][:100].decode(errors="replace"))
                    conn.busy = False
            except asyncio.CancelledError:
                conn.close()
                raise
            except Exception as exc:
                logger.debug("stages to %s: %s", url, exc)
                conn.close()
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

    def stop(self) -> None:
        for conn in self._conns.values():
            if conn.task is not None:
                conn.task.cancel()
            conn.close()
        self._conns.clear()

    def stats(self) -> dict[str, int]:
        return {"sent": self.sent, "broken": self.broken, "resent": self.resent}


class Staging:
    """One body being streamed (:meth:`Stager.begin`)."""

    def __init__(
        self, stager: Stager, stage: Stage, buf: memoryview, streams: list[tuple[str, _Conn]]
    ) -> None:
        self.stager = stager
        self.stage = stage
        self.buf = buf
        self.streams = streams
        self.sent = 0
        self.finished = False

    def send(self, received: int) -> None:
        """Write the bytes of the body that arrived since the last call."""
        if received <= self.sent:
            return
        piece = self.buf[self.sent : received]
        self.sent = received
        links = self.stage.links
        for url, conn in self.streams:
            if url in links:
                if conn.writer is None or conn.writer.is_closing():
                    links.discard(url)
                    self.stager.broken += 1
                else:
                    conn.writer.write(piece)

    def watch(self, then: Callable[[int], None] | None) -> Callable[[int], None]:
        """A watch for ``BodyInto.receive_into`` that sends what arrived, then calls ``then``."""
        if then is None:
            return self.send

        def both(received: int) -> None:
            self.send(received)
            then(received)

        return both

    def done(self) -> None:
        """The whole body arrived: the rest is sent, and the write this request makes names
        the stage (:data:`server.replication.log.current_stage`)."""
        self.send(self.buf.nbytes)
        self.finished = True
        current_stage.set(self.stage)

    def abort(self) -> None:
        if not self.finished:
            self.stager.abort(self.stage)


class _Held:
    __slots__ = ("buf", "at", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.buf: memoryview | None = None  # None while its body arrives
        self.at = time.monotonic()
        self.nbytes = nbytes


class StageStore:
    """A backup's stages (module docstring): held until an entry takes them, bounded."""

    def __init__(self, max_bytes: int, max_age: float, wait: float) -> None:
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.wait = wait
        self._held: dict[str, _Held] = {}
        self._changed = asyncio.Event()
        self.received = 0
        self.taken = 0
        self.evicted = 0
        self.missing = 0

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    async def receive(self, request: Request, read: Callable[..., Any]) -> dict[str, Any]:
        """``POST /v1/stage``: hold the body under its id until an entry takes it."""
        stage_id = request.headers.get(HEADER, "")
        declared = request.headers.get("content-length", "")
        if not stage_id or len(stage_id) > 100 or not declared.isdigit():
            raise ShardError(
                "bad_request",
                f"stage: needs an {HEADER} header (at most 100 characters) and a Content-Length",
            )
        size = int(declared)
        self._evict(size)
        if size > self.max_bytes:
            raise ShardError(
                "too_large",
                f"stage: {size} bytes is above the {self.max_bytes} this replica holds "
                "(--replication-log-bytes): its entry carries the bytes instead",
                {"limit": self.max_bytes},
            )
        held = self._held[stage_id] = _Held(size)
        self._wake()
        try:
            buf = await read(request, size)
        except BaseException:  # the stream broke (the primary went): let go at once
            if self._held.get(stage_id) is held:
                del self._held[stage_id]
            self._wake()
            raise
        if self._held.get(stage_id) is held:
            held.buf = memoryview(buf)
            held.at = time.monotonic()
            self.received += 1
        self._wake()
        return {"staged": size}

    async def take(self, ids: list[str], head: int, epoch: int) -> dict[str, memoryview]:
        """The stages of ``ids``, waiting up to ``wait`` seconds for them to arrive; 409
        ``conflict`` with ``details.missing_stages`` for any that does not (none is taken)."""
        deadline = time.monotonic() + self.wait
        while True:
            missing = [i for i in ids if (h := self._held.get(i)) is None or h.buf is None]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                break
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        if missing:
            self.missing += len(missing)
            raise ShardError(
                "conflict",
                f"replicate: this replica does not hold stage {missing[0]!r} that the entries "
                "name (it restarted, or the stream broke): send those entries with their bytes",
                {"missing_stages": missing, "applied_lsn": head, "lsn_epoch": epoch},
            )
        out = {}
        for i in ids:
            held = self._held.pop(i)
            out[i] = held.buf
            self.taken += 1
        self._wake()
        return out

    def _evict(self, incoming: int) -> None:
        now = time.monotonic()
        held = self._held
        for i in [i for i, h in held.items() if h.buf is not None and now - h.at > self.max_age]:
            del held[i]
            self.evicted += 1
        total = self.nbytes + incoming
        for i in [i for i, h in held.items() if h.buf is not None]:  # oldest first
            if total <= self.max_bytes:
                break
            total -= held.pop(i).nbytes
            self.evicted += 1

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def stats(self) -> dict[str, int]:
        self._evict(0)
        return {
            "held": len(self._held),
            "bytes": self.nbytes,
            "received": self.received,
            "taken": self.taken,
            "evicted": self.evicted,
            "missing": self.missing,
        }
