"""The one door to a private part of httpx2: a deadline for a whole exchange over its network
backend (:class:`Deadlines`).

httpx2's timeouts bound each wait for bytes, not an exchange: a server that trickles a reply's
head a byte at a time keeps a request alive for as long as it likes. The sync httpx2 sender
(``httpx_senders.py``) holds each exchange to its deadline by wrapping the network backend of an
``httpx2.HTTPTransport``: every connect, read and write of its streams gets at most what is left
of the deadline of the exchange under way on the calling thread.

The backend is a private attribute of httpx2's transport (``_pool._network_backend``);
:meth:`Deadlines.install` reaches it here and nowhere else. When it is not there (another
transport, another httpx2), nothing is wrapped and the sender keeps the deadline between the
pieces of a reply only. pyproject.toml bounds httpx2 to the versions this was checked against.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from .._abort import Abort

if TYPE_CHECKING:
    import httpcore2

__all__ = ["Deadlines"]


class Deadlines:
    """The deadline of the exchange under way on this thread, kept by httpx2's own network
    streams: a wrapper of an ``httpx2.HTTPTransport``'s network backend (httpcore2's) whose
    streams give each connect, read and write at most what is left of it. httpx2's timeouts
    bound each wait for bytes; with this, the sync sender's exchange ends at its deadline even
    when a server trickles its reply's head. Outside an exchange of the sender, a wrapped
    stream passes every call through unchanged.

    The backend is a private attribute of httpx2's transport (``_pool._network_backend``):
    :meth:`install` reaches it there and nowhere else, and when it is not there (another
    transport, another httpx2) the sync sender keeps the deadline between the pieces of a
    reply only.
    """

    _local = threading.local()

    @classmethod
    def install(cls, transport: object) -> bool:
        """Wrap ``transport``'s network backend, if it has one this knows; whether it did."""
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is None or not callable(getattr(backend, "connect_tcp", None)):
            return False
        if not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]
        return True

    @classmethod
    def set(cls, deadline: float | None, abort: Abort | None = None) -> None:
        cls._local.deadline = deadline
        cls._local.abort = abort

    @classmethod
    def abort(cls) -> Abort | None:
        """The :class:`~client_sdk._abort.Abort` of the exchange under way on this thread."""
        abort: Abort | None = getattr(cls._local, "abort", None)
        return abort

    @classmethod
    def left(cls, limit: float | None, phase: str) -> float | None:
        """``limit`` (seconds), cut to what is left of this thread's deadline; raises
        httpcore2's timeout of ``phase`` (which httpx2 maps to its own) once it passed."""
        deadline: float | None = getattr(cls._local, "deadline", None)
        if deadline is None:
            return limit
        left = deadline - time.monotonic()
        if left <= 0:
            import httpcore2

            error = {
                "connect": httpcore2.ConnectTimeout,
                "read": httpcore2.ReadTimeout,
                "write": httpcore2.WriteTimeout,
            }[phase]
            raise error(f"the exchange's deadline passed ({phase})")
        return left if limit is None else min(limit, left)


class _DeadlineStream:
    """A network stream whose waits stop at the thread's deadline (see :class:`Deadlines`)."""

    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        abort = Deadlines.abort()
        if abort is None:
            return self._inner.read(max_bytes, Deadlines.left(timeout, "read"))
        abort.hold(id(self), self._cut)
        try:
            return self._inner.read(max_bytes, Deadlines.left(timeout, "read"))
        finally:
            abort.drop(id(self))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        abort = Deadlines.abort()
        if abort is None:
            self._inner.write(buffer, Deadlines.left(timeout, "write"))
            return
        abort.hold(id(self), self._cut)
        try:
            self._inner.write(buffer, Deadlines.left(timeout, "write"))
        finally:
            abort.drop(id(self))

    def _cut(self) -> None:
        sock = self._inner.get_extra_info("socket")
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> _DeadlineStream:
        return _DeadlineStream(
            self._inner.start_tls(ssl_context, server_hostname, Deadlines.left(timeout, "connect"))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend:
    """A network backend whose streams are :class:`_DeadlineStream`."""

    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> _DeadlineStream:
        return _DeadlineStream(
            self._inner.connect_tcp(
                host, port, Deadlines.left(timeout, "connect"), local_address, socket_options
            )
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> _DeadlineStream:
        return _DeadlineStream(
            self._inner.connect_unix_socket(
                path, Deadlines.left(timeout, "connect"), socket_options
            )
        )

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)
