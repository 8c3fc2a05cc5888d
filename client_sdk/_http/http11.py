"""HTTP/1.1 for the SDK's own connections, without I/O: requests as values, and response parsing.

The SDK reaches ``http://`` shards over its own keep-alive connections (``connection.py``),
driven by a blocking pool (``pool.py``, for :class:`~client_sdk.PSClient`), an asyncio one
(``asyncpool.py``, for :class:`~client_sdk.AsyncPSClient`), a fan-out that drives all of a
call's exchanges from one thread (``fanout.py``) and the blocking direct exchange that parses the
common reply in place (``direct.py``). All of them speak the subset of HTTP/1.1 the
data plane needs, with as little Python per request as they can, and share everything but the
waiting, which lives here and in ``connection.py``:

* :class:`Exchange` is one request as a value (origin, method, target, headers, the body's
  buffers, its deadline and the bound on its reply); :meth:`Exchange.views` is what goes on the
  wire: the head (:func:`request_head`) and the body's own buffers (the msgpack header and
  memoryviews of the arrays' memory), sent in one ``sendmsg``, never joined;
* :func:`read_response` is a generator that parses one response out of a connection's receive
  buffer. It yields the memoryview to receive into next and is sent the byte count; the
  connection does the receiving. A ``Content-Length`` body that is not already in the receive
  buffer is received straight into one ``np.empty`` buffer of that size (framed tensors become
  views into it, with no further copy; ``np.empty`` rather than ``bytearray``, which would
  zero-fill it first), starting at a multiple of 64 bytes (:func:`body_buffer`). Chunked
  bodies and bodies delimited by the end of the connection are read too, for servers that are
  not shards. A body larger than the caller says its reply could need (``max_size``) is refused
  before anything is allocated for it (:class:`ReplyTooLarge`): a declared ``Content-Length``
  at once, a chunked or close-delimited body as soon as what came passes the bound.
  An exchange may carry a *receiver* (:class:`Into`) for its reply's body: a ``200`` with a
  ``Content-Length`` body not already in the receive buffer is then received where the
  receiver says, piece by piece (a pull into the caller's own buffers, ``client_sdk._into``).

Failures are httpx2's exception classes (the connections add the connect/read/write ones), so
``_transport.py`` translates them and the retry policy tells "never sent" from "may have
arrived" exactly as it does for httpx2 itself: :class:`httpx2.ConnectError` and
:class:`httpx2.ConnectTimeout` before a byte of the request left; :class:`httpx2.WriteError`,
:class:`httpx2.WriteTimeout`, :class:`httpx2.ReadError`, :class:`httpx2.ReadTimeout` and
:class:`httpx2.RemoteProtocolError` after.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Protocol

import httpx2
import numpy as np

from .._abort import Abort

__all__ = [
    "BODY_ALIGNMENT",
    "HEAD_BUFFER",
    "IDLE_EXPIRY",
    "MAX_IOV",
    "SEND_SLICE",
    "Exchange",
    "Into",
    "Origin",
    "ReplyTooLarge",
    "Response",
    "advance",
    "body_buffer",
    "next_send",
    "read_response",
    "request_head",
]

Buffer = bytes | bytearray | memoryview
#: What :func:`read_response` yields (where to receive) and is sent (how many bytes came).
Reading = Generator[memoryview, int, "tuple[Response, bool]"]


class Into(Protocol):
    """Where a reply body goes as it arrives, for a receiver that wants it somewhere of its
    own (``client_sdk._into.Sink``)."""

    def receive(self, got: memoryview, size: int) -> Generator[memoryview, int, Buffer]:
        """Take a body of ``size`` bytes whose first ``len(got)`` bytes are ``got`` (valid
        until this returns): yield each memoryview to receive into next, be sent how many
        bytes came (never 0), and return what stands for the body in the response."""
        ...


#: Size of each connection's receive buffer, and the most a response head may take.
HEAD_BUFFER = 64 * 1024
#: At most this many bytes per ``sendmsg`` call. A big body offered at once goes slower: the
#: kernel then holds the socket for as much as the send buffer takes, and the loopback
#: receiver waits.
SEND_SLICE = 1 << 20
#: At most this many buffers per ``sendmsg`` call (Linux's IOV_MAX is 1024).
MAX_IOV = 512
#: An idle connection is not reused after this many seconds: servers close idle connections
#: (uvicorn after 5 s), and one closing while a request is on its way loses that request.
IDLE_EXPIRY = 4.0

_NO_BODY = (204, 304)
_CRLF2 = b"\r\n\r\n"


class ReplyTooLarge(httpx2.RemoteProtocolError):
    """A response body larger than the request's reply could need: ``size`` bytes declared
    (``Content-Length``), or received so far (chunked, or delimited by the close), where at
    most ``limit`` were expected. Not worth retrying: ``_transport.py`` raises it as a
    ``ProtocolError`` at once."""

    def __init__(self, size: int, limit: int, declared: bool) -> None:
        self.size = size
        self.limit = limit
        self.declared = declared
        what = "declared a body of" if declared else "sent a body of more than"
        super().__init__(f"the server {what} {size} bytes where at most {limit} were expected")


class Origin:
    """Where a shard listens, pre-split from its URL: ``host``, ``port``, the ``Host`` header
    value, the URL's path prefix (``""`` or e.g. ``"/shard0"``), whether it speaks TLS
    (``https://``) and the URL itself."""

    __slots__ = ("host", "port", "host_header", "prefix", "tls", "url")

    def __init__(self, url: str) -> None:
        parts = httpx2.URL(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"only http:// and https:// URLs, not {url!r}")
        self.url = url
        self.tls = parts.scheme == "https"
        self.host = parts.host
        self.port = parts.port or (443 if self.tls else 80)
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = netloc if parts.port is None else f"{netloc}:{self.port}"
        self.prefix = parts.raw_path.decode("ascii").rstrip("/")

    @property
    def key(self) -> tuple[str, int]:
        return self.host, self.port


#: A body buffer's start is a multiple of this many bytes (:func:`body_buffer`).
BODY_ALIGNMENT = 64


def body_buffer(size: int) -> memoryview:
    """``size`` uninitialised bytes starting at a multiple of :data:`BODY_ALIGNMENT`.

    A framed body's tensors start at multiples of 64 from the body's start (docs/PROTOCOL.md,
    Tensor tables), so theirs do too: JAX makes an array of host memory without copying it
    only where it is 64-byte aligned (client_sdk/jax.py), and vector loads like it too.
    """
    raw = np.empty(size + BODY_ALIGNMENT - 1, np.uint8)
    skip = -raw.ctypes.data % BODY_ALIGNMENT
    return memoryview(raw[skip : skip + size])  # type: ignore[arg-type]  # numpy types ndarray as a buffer for Python >= 3.12 only


class Response:
    """A whole response: status, headers (names lower-cased, repeats joined by ``", "``) and
    the body (``bytes``, or a ``memoryview`` of the ``np.empty`` buffer it was read into)."""

    __slots__ = ("status", "headers", "content")

    def __init__(self, status: int, headers: dict[str, str], content: Buffer) -> None:
        self.status = status
        self.headers = headers
        self.content = content


class Exchange:
    """One request to send, as a value: ``method target`` (the path after the origin's prefix)
    to ``origin`` with ``headers`` (give ``content-length`` for a body) and the ``body``
    buffers in order (bytes, or flat byte memoryviews as ``wire`` makes them), all of it and
    the whole response by ``deadline`` (``time.monotonic()`` seconds; ``None``: the pool's
    timeout from when it starts), the response's body at most ``max_reply`` bytes (``None``:
    the pool's bound). ``abort``, fired from another thread, cuts the exchange short (the
    blocking pool shuts its socket down: it fails at once). ``into`` receives the reply's body
    (see :func:`read_response`)."""

    __slots__ = (
        "origin",
        "method",
        "target",
        "headers",
        "body",
        "deadline",
        "max_reply",
        "abort",
        "into",
    )

    def __init__(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Mapping[str, str] | None,
        body: Sequence[Buffer] = (),
        *,
        deadline: float | None = None,
        max_reply: int | None = None,
        abort: Abort | None = None,
        into: Into | None = None,
    ) -> None:
        self.origin = origin
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.deadline = deadline
        self.max_reply = max_reply
        self.abort = abort
        self.into = into

    def views(self) -> list[Buffer]:
        """What goes on the wire, in order: the head, then the body's buffers (a new list:
        sending consumes it)."""
        return [request_head(self.origin, self.method, self.target, self.headers), *self.body]


def request_head(
    origin: Origin, method: str, target: str, headers: Mapping[str, str] | None
) -> bytes:
    """``method target`` (the path after the origin's prefix) with a ``Host`` header and
    ``headers`` (give ``content-length`` for a body)."""
    lines = [f"{method} {origin.prefix}{target} HTTP/1.1\r\nhost: {origin.host_header}\r\n"]
    if headers:
        lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def next_send(views: list[Buffer], first: int) -> list[Buffer]:
    """The buffers for the next ``sendmsg``, from ``views[first]`` on: whole ones while they
    add up to at most :data:`SEND_SLICE` bytes (and :data:`MAX_IOV` buffers), else the first
    :data:`SEND_SLICE` bytes of the next one. Pass the count it sent to :func:`advance`."""
    out: list[Buffer] = []
    room = SEND_SLICE
    for view in views[first : first + MAX_IOV]:
        n = len(view)
        if n > room:
            if room >= SEND_SLICE // 4:
                out.append(memoryview(view)[:room])
            break
        out.append(view)
        room -= n
    return out


def advance(views: list[Buffer], first: int, sent: int) -> int:
    """After a ``sendmsg(views[first:...])`` that sent ``sent`` bytes: drop what went out
    (a partly sent buffer is replaced by a view of its rest, empty ones are skipped) and
    return the new ``first``."""
    while sent:
        n = len(views[first])
        if sent >= n:
            sent -= n
            first += 1
        else:
            views[first] = memoryview(views[first])[sent:]
            sent = 0
    while first < len(views) and not len(views[first]):
        first += 1
    return first


def read_response(buf: bytearray, max_size: int, into: Into | None = None) -> Reading:
    """Parse one response (not to a ``HEAD``: its body is taken by its headers) received
    through ``buf``, the connection's receive buffer; return it and whether the connection may
    carry another request. A body of more than ``max_size`` bytes raises
    :class:`ReplyTooLarge` before it is read (a chunked one, once that much came). ``into``
    receives a ``200``'s ``Content-Length`` body that is not all in ``buf`` already; any
    other body is read as without it."""
    view = memoryview(buf)
    end = 0
    while True:  # skip interim (1xx) responses
        start, end, status, version, headers = yield from _head(buf, view, end)
        if not 100 <= status < 200:
            break
        view[: end - start] = view[start:end]
        end -= start
    reusable = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if status in _NO_BODY:
        return Response(status, headers, b""), reusable and start == end
    if "transfer-encoding" in headers:
        if headers["transfer-encoding"].strip().lower() != "chunked":
            raise httpx2.RemoteProtocolError(
                f"unsupported Transfer-Encoding {headers['transfer-encoding']!r}"
            )
        body, left_over = yield from _chunked(buf, view, start, end, max_size)
        return Response(status, headers, body), reusable and not left_over
    length = headers.get("content-length")
    if length is None:
        return Response(
            status, headers, (yield from _until_close(view, start, end, max_size))
        ), False
    if not length.isdigit():
        raise httpx2.RemoteProtocolError(f"bad Content-Length {length!r}")
    size = int(length)
    if size > max_size:
        raise ReplyTooLarge(size, max_size, declared=True)
    have = end - start
    if have >= size:
        return Response(
            status, headers, bytes(view[start : start + size])
        ), reusable and have == size
    if into is not None and status == 200:
        return Response(status, headers, (yield from _into(into, view[start:end], size))), reusable
    content = body_buffer(size)
    content[:have] = view[start:end]
    pos = have
    while pos < size:
        n = yield content[pos:]
        if n == 0:
            raise httpx2.RemoteProtocolError(
                f"the server closed the connection after {pos} of {size} body bytes"
            )
        pos += n
    return Response(status, headers, content), reusable


def _into(into: Into, got: memoryview, size: int) -> Generator[memoryview, int, Buffer]:
    """Drive ``into``'s receiving of a body of ``size`` bytes (``got``: its first bytes)."""
    steps = into.receive(got, size)
    pos = len(got)
    try:
        target = next(steps)
        while True:
            n = yield target
            if n == 0:
                raise httpx2.RemoteProtocolError(
                    f"the server closed the connection after {pos} of {size} body bytes"
                )
            pos += n
            target = steps.send(n)
    except StopIteration as done:
        content: Buffer = done.value
        return content


def _head(
    buf: bytearray, view: memoryview, end: int
) -> Generator[memoryview, int, tuple[int, int, int, str, dict[str, str]]]:
    """Receive until the buffer holds a whole head; return (body start, buffered end, status,
    version, headers)."""
    searched = 0
    while True:
        at = buf.find(_CRLF2, searched, end)
        if at >= 0:
            break
        searched = max(0, end - 3)
        if end == len(buf):
            raise httpx2.RemoteProtocolError(f"response head larger than {HEAD_BUFFER} bytes")
        n = yield view[end:]
        if n == 0:
            raise httpx2.RemoteProtocolError(
                "the server closed the connection without sending a (complete) response"
            )
        end += n
    status, version, headers = _parse_head(bytes(view[:at]))
    return at + 4, end, status, version, headers


#: Header lines already parsed, each to its (lower-cased name, stripped value): a shard sends
#: nearly the same lines in every response, so most lines of a head are found here. Bounded:
#: emptied when it holds :data:`_LINES_KEPT` lines.
_lines: dict[str, tuple[str, str]] = {}
_LINES_KEPT = 512


def _header_line(line: str) -> tuple[str, str]:
    """A header line's (lower-cased name, value without surrounding spaces and tabs)."""
    name, sep, value = line.partition(":")
    if not sep or not name or name[0] in " \t" or name[-1] in " \t":
        raise httpx2.RemoteProtocolError(f"malformed response header line {line[:80]!r}")
    parsed = name.lower(), value.strip(" \t")
    if len(_lines) >= _LINES_KEPT:
        _lines.clear()
    _lines[line] = parsed
    return parsed


def _parse_head(raw: bytes) -> tuple[int, str, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise httpx2.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    known = _lines.get
    for line in lines[1:]:
        name, value = known(line) or _header_line(line)
        if name in headers:
            if name == "content-length" and headers[name] != value:
                raise httpx2.RemoteProtocolError("conflicting Content-Length headers")
            if name != "content-length":
                headers[name] += ", " + value
        else:
            headers[name] = value
    return int(code), version, headers


def _fill(view: memoryview, start: int, end: int) -> Generator[memoryview, int, tuple[int, int]]:
    """Move the unread bytes [start, end) to the front and receive more after them."""
    if start:
        view[: end - start] = view[start:end]
        end -= start
        start = 0
    if end == len(view):
        raise httpx2.RemoteProtocolError("chunk size line too long")
    n = yield view[end:]
    if n == 0:
        raise httpx2.RemoteProtocolError(
            "the server closed the connection in the middle of a chunked body"
        )
    return start, end + n


def _line(
    buf: bytearray, view: memoryview, start: int, end: int
) -> Generator[memoryview, int, tuple[bytes, int, int]]:
    """The next CRLF-terminated line (without CRLF) and the positions after it."""
    at = buf.find(b"\r\n", start, end)
    while at < 0:
        start, end = yield from _fill(view, start, end)
        at = buf.find(b"\r\n", start, end)
    return bytes(view[start:at]), at + 2, end


def _chunked(
    buf: bytearray, view: memoryview, start: int, end: int, max_size: int
) -> Generator[memoryview, int, tuple[bytes, bool]]:
    out = bytearray()
    while True:
        line, start, end = yield from _line(buf, view, start, end)
        text = line.split(b";", 1)[0].strip()
        try:
            size = int(text, 16)
        except ValueError:
            raise httpx2.RemoteProtocolError(f"bad chunk size line {text[:40]!r}") from None
        if size == 0:  # trailers (ignored) end with an empty line
            while True:
                line, start, end = yield from _line(buf, view, start, end)
                if not line:
                    return bytes(out), start != end
        if len(out) + size > max_size:
            raise ReplyTooLarge(len(out) + size, max_size, declared=False)
        while size:
            if start == end:
                start, end = yield from _fill(view, start, end)
            take = min(end - start, size)
            out += view[start : start + take]
            start += take
            size -= take
        while end - start < 2:
            start, end = yield from _fill(view, start, end)
        if view[start : start + 2] != b"\r\n":  # type: ignore[comparison-overlap]  # a bytes view
            raise httpx2.RemoteProtocolError("chunk not followed by CRLF")
        start += 2


def _until_close(
    view: memoryview, start: int, end: int, max_size: int
) -> Generator[memoryview, int, bytes]:
    out = bytearray(view[start:end])
    while True:
        if len(out) > max_size:
            raise ReplyTooLarge(len(out), max_size, declared=False)
        n = yield view
        if n == 0:
            return bytes(out)
        out += view[:n]
