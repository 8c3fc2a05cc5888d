"""The head of a small request that came whole in one read, read without the HTTP parser, for
the requests :class:`server.httptools_protocol.ShardHttpProtocol` answers itself.

Fed to httptools, such a request costs one Python callback per header and several more for
the request line, the head's end, the body and the message's end, and uvicorn builds an ASGI
scope for it that an answer made in the protocol never reads. :func:`whole_request` splits
the head with a few ``bytes`` operations instead, and only a head that every HTTP parser
reads the same way, written as the SDK writes one: ``POST <path> HTTP/1.1``, then header
lines each a lower-case token, ``": "`` and a value of visible ASCII characters (spaces
or tabs between them, none around them), no header named twice, a ``Content-Length`` of
digits equal to the bytes after the head, and no header that asks the server for anything
(``Transfer-Encoding``, ``Expect``, ``Connection``, ``Upgrade``). Anything else (a capital
in a name, an empty value, an obsolete line folding, a control or non-ASCII byte, a space
before a colon, a second request after the first, a body still to come) returns ``None``,
and the caller feeds the read to the parser as usual, which accepts or refuses it as it
always does. So a request read here is one the parser would have read the same, header for
header. A caller that collects a big body itself may ask for the head of a read that brings
only the start of its body (``started``).

A client sends the same heads again and again (the SDK builds a route's head once; only a body
of another length changes it), so :class:`KeptHeads` keeps, per connection, the last head read
here for each path: a request that starts with exactly those bytes is the same head, read the
same way, and needs only its body's length checked. Otherwise pure functions; the caller
decides whether the connection may be answered now.
"""

from __future__ import annotations

import operator
from collections.abc import Container

__all__ = ["KEPT_HEAD", "KeptHeads", "whole_request"]

#: The bytes a head read here may hold: visible ASCII, space, tab, and CR LF ending its lines.
_HEAD_BYTES = bytes(range(0x20, 0x7F)) + b"\t\r\n"
#: The bytes of a header name (an HTTP token), lower-case.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
_VERSION = b" HTTP/1.1\r\n"
#: A header line's name and value, split at its first ": ".
_NAME_VALUE = operator.methodcaller("split", b": ", 1)
#: Headers that ask the server for more than an answer; a request with one goes to the parser.
_ASKS = (b"transfer-encoding", b"expect", b"connection", b"upgrade")
#: :class:`KeptHeads` keeps heads of at most this many bytes (the SDK's are a few hundred).
KEPT_HEAD = 1024


def whole_request(
    data: bytes, paths: Container[bytes], max_head: int, started: bool = False
) -> tuple[bytes, dict[bytes, bytes], bytes] | None:
    """``(path, headers, body)`` of ``data`` when it is exactly one ``POST`` to one of
    ``paths`` (raw path, no query) with a head of at most ``max_head`` bytes that reads as
    the module says, and its whole body: ``headers`` by lower-case name. ``None`` otherwise
    (the parser's to read). With ``started``, ``data`` may hold only the start of the body
    (``body``: that start; never more than the body)."""
    space = data.find(b" ", 5, 5 + 256)
    if space < 0 or not data.startswith(b"POST /") or data[5:space] not in paths:
        return None
    start = space + len(_VERSION)
    if data[space:start] != _VERSION:
        return None
    end = data.find(b"\r\n\r\n", space) + 2
    if end < start or end + 2 > max_head:
        return None
    block = data[start : end - 2]  # the header lines, without the last one's CR LF
    if block.translate(None, _HEAD_BYTES):
        return None
    lines = block.split(b"\r\n")
    if block.count(b"\r") != len(lines) - 1 or block.count(b"\n") != len(lines) - 1:
        return None  # a bare CR or LF
    if b": \t" in block or b":  " in block or block.endswith((b" ", b"\t")):
        return None  # more space around a value than ": " (allowed: the parser's to read)
    if b" \r\n" in block or b"\t\r\n" in block:
        return None
    try:
        headers = dict(map(_NAME_VALUE, lines))
    except ValueError:  # a line with no ": "
        return None
    if b"" in headers or b"".join(headers).translate(None, _TOKEN):
        return None
    length = headers.get(b"content-length")
    if (
        len(headers) != len(lines)
        or length is None
        or not length.isdigit()
        or (int(length) < len(data) - end - 2 if started else int(length) != len(data) - end - 2)
        or any(name in headers for name in _ASKS)
    ):
        return None
    return data[5:space], headers, data[end + 2 :]


class KeptHeads:
    """:func:`whole_request` for one connection, keeping the last head it read for each path
    (each at most :data:`KEPT_HEAD` bytes): a request that starts with exactly the head kept
    for its path (request line, header lines, blank line) is read without splitting it again,
    as :func:`whole_request` would read it, its body checked against the head's
    ``Content-Length``. One head per path, so a client that takes turns between verbs (a push,
    then a pull) finds each of them kept; at most one per path in ``paths``. ``paths`` and
    ``max_head`` must be the same at every call. Not thread-safe (a connection's, on its
    loop)."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        #: By path: the head's bytes, its headers and its Content-Length.
        self._kept: dict[bytes, tuple[bytes, dict[bytes, bytes], int]] = {}

    def read(
        self, data: bytes, paths: Container[bytes], max_head: int, started: bool = False
    ) -> tuple[bytes, dict[bytes, bytes], bytes] | None:
        """What :func:`whole_request` returns for these arguments (a new ``headers`` dict
        each time: the caller may keep or change it)."""
        space = data.find(b" ", 5, 5 + 256)
        if space > 0:
            path = data[5:space]
            kept = self._kept.get(path)
            if kept is not None and data.startswith(kept[0]):
                head, headers, length = kept
                size = len(head)
                fits = len(data) - size <= length if started else len(data) - size == length
                return (path, dict(headers), data[size:]) if fits else None
        whole = whole_request(data, paths, max_head, started)
        if whole is not None:
            path, headers, body = whole
            size = len(data) - len(body)
            if size <= KEPT_HEAD:
                self._kept[path] = (data[:size], dict(headers), int(headers[b"content-length"]))
        return whole
