"""A TCP proxy for HTTP/1.1 that loses replies on purpose, after the shard has answered.

    with DroppingProxy(("127.0.0.1", shard_port), drop=lambda method, path, n: ...) as proxy:
        PSClient([proxy.url]) ...

Each client connection gets its own upstream connection; requests are relayed one at a time
(keep-alive). For each request it forwards the request, reads the shard's whole reply, and then,
if ``drop(method, path, n)`` says so (``n`` counts requests to that path, from 1), closes the
client's connection instead of relaying the reply: the request *was* applied, the client never
learns it. That is the case a retried write must not be applied twice for.

``alter``, when set (at construction or later, as an attribute), is applied to every reply the
proxy relays, ``alter(method, path, reply) -> reply`` (the whole HTTP message, head and body):
a shard, or something between it and the worker, that answers what it should not.

``deliver``, when set (likewise), sends each reply in the proxy's place,
``deliver(client_socket, method, path, reply) -> keep``: a server that spaces its bytes, or
answers with a body it never sends; the client's connection is closed unless it returns true.

Only what the shard and SDK send is understood: requests and replies with ``Content-Length``.
Threads; ``close()`` (or leaving the ``with`` block) stops it.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Callable

__all__ = ["DroppingProxy"]


def _read_message(sock: socket.socket, buf: bytearray) -> bytes | None:
    """One HTTP message (head + Content-Length body) from ``sock``; ``None`` at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buf) < end + length:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        buf += chunk
    message = bytes(buf[: end + length])
    del buf[: end + length]
    return message


class DroppingProxy:
    """See the module. ``drops`` counts replies lost on purpose; ``seen`` requests per path."""

    def __init__(
        self,
        upstream: tuple[str, int],
        drop: Callable[[str, str, int], bool] = lambda method, path, n: False,
        alter: Callable[[str, str, bytes], bytes] | None = None,
        deliver: Callable[[socket.socket, str, str, bytes], bool] | None = None,
    ) -> None:
        self.upstream = upstream
        self.drop = drop
        self.alter = alter
        self.deliver = deliver
        self.drops = 0
        self.seen: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._socks: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        with self._lock:
            self._socks |= {client, upstream}
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while True:
                request = _read_message(client, cbuf)
                if request is None:
                    return
                method, path = request.split(b" ", 2)[:2]
                upstream.sendall(request)
                reply = _read_message(upstream, ubuf)
                if reply is None:
                    return
                with self._lock:
                    self.seen[path.decode()] += 1
                    lose = self.drop(method.decode(), path.decode(), self.seen[path.decode()])
                    self.drops += lose
                if lose:
                    return  # the shard answered; the client sees the connection close
                alter = self.alter
                if alter is not None:
                    reply = alter(method.decode(), path.decode(), reply)
                deliver = self.deliver
                if deliver is None:
                    client.sendall(reply)
                elif not deliver(client, method.decode(), path.decode(), reply):
                    return
        except OSError:
            return
        finally:
            for s in (client, upstream):
                s.close()
            with self._lock:
                self._socks -= {client, upstream}

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() below
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    def __enter__(self) -> DroppingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
