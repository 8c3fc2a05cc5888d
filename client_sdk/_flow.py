"""What a verb and the shells that drive it exchange: requests out, results in.

Each verb of the SDK is a *flow* (``_verbs/``): a generator that yields a list of
:class:`ShardRequest` (one per shard, to be sent concurrently) and is sent back, in the same
order, a list holding for each request either a :class:`Reply` or the
:class:`~client_sdk.PSError` that prevented one. The generator's return value is the verb's
result. The sync shell drives a flow with threads, the async shell with ``asyncio.gather``
(``client.py``), each through the transport (``_transport.py``: one request sent, retried as
the policy allows); they know nothing of the protocol, and the flows nothing of I/O.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from . import wire
from ._abort import Abort
from ._exceptions import PSError

if TYPE_CHECKING:
    from ._http.http11 import Into

__all__ = ["Body", "Flow", "Reply", "Result", "ShardRequest", "request_headers"]

T = TypeVar("T")
#: A whole reply body: bytes, or a view of the buffer it was read into.
Body = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ShardRequest:
    """One HTTP request to shard ``shard``, as the shells send it.

    ``mutating`` requests change state; unless ``retry_safe`` (the shard applies a repeat at
    most once: writes with a seq, init) they are retried only when they certainly did not
    reach the shard. ``deadline`` (``time.monotonic()`` seconds) bounds the call: no retry
    starts or runs past it. ``timeout`` replaces the client's ``timeout`` for each attempt
    (long polls, checkpoints: they plan their own time, and their attempts may end past
    ``deadline``). ``max_reply`` bounds the reply's body (bytes; :meth:`Core.post
    <client_sdk._core.Core.post>` sets it, a pull from what it knows of the values). A batch
    whose requests carry an ``abort`` is a race: its flow is sent back the first settled
    result, ``None`` for the others.
    """

    shard: int
    method: str
    path: str
    headers: Mapping[str, str]
    body: wire.Encoded | None
    mutating: bool
    deadline: float
    verb: str
    names: tuple[str, ...] = ()
    timeout: float | None = None
    retry_safe: bool = False
    max_reply: int | None = None
    #: Set on each request of a race (a ``newer_than`` pull of several shards,
    #: ``_verbs/poll.py``): the shells return once one of them is settled and abandon the
    #: others through it.
    abort: Abort | None = None
    #: Where the reply's body goes as it arrives, for a sender that can put it there (the
    #: native ones: ``_http/http11.py``); others read it whole as usual. A pull into the
    #: caller's buffers (``_into.py``).
    into: Into | None = None
    #: Sent to this replica of the shard's group rather than to the one its requests go to
    #: now (asking each replica who is primary; a read a backup may answer: ``_replicas.py``).
    url: str | None = None
    #: A read a backup of the index may answer (``pull(..., allow_backup=True)``): sent with
    #: ``x-paramshard-allow-backup: 1``, to ``url`` (a backup) when set; when that backup
    #: does not answer it, it is sent to the primary instead (``_transport.py``).
    allow_backup: bool = False


def request_headers(req: ShardRequest) -> Mapping[str, str]:
    """The headers ``req`` is sent with: its own, and its body's type and length."""
    if req.body is None:
        return req.headers
    return {
        **req.headers,
        "content-type": req.body.content_type,
        "content-length": str(req.body.nbytes),
    }


@dataclass
class Reply:
    """A shard's answer: status, headers with lower-case names, and the whole body."""

    status: int
    headers: Mapping[str, str]
    content: Body


Result = Reply | PSError
#: A verb: yields batches of requests, receives their results, returns the verb's result.
Flow = Generator[list[ShardRequest], list[Result], T]
