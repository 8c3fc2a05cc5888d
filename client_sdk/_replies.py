"""Reply handling: a shard's answer made into a message, or into the exception it means.

:func:`decode` reads a reply's body by its content type (msgpack or framed; JSON for the
errors of a proxy or another service) and turns an error status into the class of the
:class:`~client_sdk.PSError` tree for it (``_exceptions.STATUS_ERRORS``), with a message that
says what happened and what to do (:func:`error`). :func:`collect` does that for a batch (one
request per shard): the first failure is raised, saying on which shards a write was applied
nevertheless. :func:`per_variable` merges the per-variable results of a batch's replies.

Before any of that, a sender refuses a reply it must not read on: a body bigger than the
request's reply can need (:func:`too_large`, before a byte of it is allocated) or one encoded
(compressed) although the SDK asked for identity (:func:`refuse_encoded`).

Which shard answered (its protocol version, index and incarnation) is the fleet's to check
(``_fleet.py``); :meth:`Core.accept <client_sdk._core.Core.accept>` does both, reply by reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import wire
from ._exceptions import (
    OverloadedError,
    ProtocolError,
    PSError,
    ShardUnavailableError,
    error_for_status,
)
from ._flow import Body, Reply, Result, ShardRequest

__all__ = [
    "Message",
    "collect",
    "decode",
    "error",
    "per_variable",
    "refuse_encoded",
    "too_large",
]


@dataclass
class Message:
    """A decoded reply: the message and the body its framed tensors point into."""

    msg: Any
    body: Body
    #: the answering shard's era (client_sdk._fleet.era): what its values are cached under
    incarnation: str | None


def decode(
    request: ShardRequest, reply: Reply, url: str, n: int, incarnation: str | None
) -> Message:
    """The message of ``reply`` (a map); raise the mapped :class:`PSError` for an error
    status, and :class:`ProtocolError` for a body that is not a paramshard message."""
    ctype = (reply.headers.get("content-type") or "").split(";")[0].strip().lower()
    msg: Any = None
    try:
        if ctype in (wire.MSGPACK, wire.FRAME):
            msg = wire.unpack(reply.content, ctype)
        elif ctype == wire.JSON or ctype.endswith("+json"):
            msg = json.loads(bytes(reply.content))
        elif reply.status < 400:
            raise ProtocolError(
                f"shard {url} answered {request.verb} with content type {ctype or 'none'!r}: "
                "is this URL a paramshard shard?",
                shard=url,
                status=reply.status,
            )
    except (wire.WireError, ValueError) as exc:
        if reply.status < 400:
            raise ProtocolError(
                f"shard {url} sent a {request.verb} reply the SDK cannot decode: {exc}",
                shard=url,
                status=reply.status,
            ) from exc
        msg = None
    if reply.status >= 400:
        raise error(request, reply.status, msg, reply.headers, url, n)
    if not isinstance(msg, Mapping):
        raise ProtocolError(
            f"shard {url} sent a {request.verb} reply that is not a map",
            shard=url,
            status=reply.status,
        )
    return Message(msg, reply.content, incarnation)


def error(
    request: ShardRequest,
    status: int,
    msg: Any,
    headers: Mapping[str, str],
    url: str,
    n: int,
) -> PSError:
    """The exception an error reply (``status`` >= 400, its decoded ``msg`` or ``None``)
    means: the protocol's code, message and details, and what to do about it."""
    err = msg.get("error") if isinstance(msg, Mapping) else None
    if isinstance(err, Mapping):
        code = err.get("code") if isinstance(err.get("code"), str) else None
        message = str(err.get("message") or "")
        details = dict(err["details"]) if isinstance(err.get("details"), Mapping) else {}
    else:
        code, message, details = None, "", {}
    cls = error_for_status(status, code)
    if not message:
        message = (
            f"HTTP {status} without a paramshard error body: is {url} a paramshard "
            "shard, and the URL right?"
        )
        if wire.HEADER_PROTOCOL not in headers and status not in (429, 502, 503, 504):
            # Not a shard at all (another service on that port, a wrong path prefix...).
            return ProtocolError(f"{request.verb}: {message}", shard=url, status=status)
    if status == 421:
        owners = details.get("owners")
        hint = (
            f"list every replica of the index in {wire.ENV_SHARDS} (or the shards argument) "
            "as 'a|b', so that the client follows the primary; a read may say that a backup "
            "may answer it (pull(..., allow_backup=True))"
            if code == "not_primary"
            else f"the {wire.ENV_SHARDS} order (or the shards argument) must match each "
            "shard's --shard-index, and list every shard"
        )
        where = f"shard {url} (listed at position {request.shard} of {n})"
        message = f"{where} refused {request.verb}: {message}"
        if isinstance(owners, Mapping) and owners:
            message += f" (owners by shard index: {dict(owners)})"
        message += f"; {hint}"
    elif status in (429, 503):
        cls = OverloadedError if status == 429 else ShardUnavailableError
        message = (
            f"shard {url} kept answering {status} ({message}) until the retry "
            f"deadline, so the {request.verb} was not applied: slow down, add "
            "shards, or raise retry_deadline"
        )
    else:
        message = f"{request.verb} refused by shard {url} (HTTP {status}): {message}"
    return cls(message, shard=url, status=status, code=code, details=details)


def collect(
    batch: list[ShardRequest],
    results: list[Result],
    accept: Callable[[ShardRequest, Result], Message],
    urls: Sequence[str],
) -> list[Message]:
    """``accept`` every result; if any failed, raise the first failure (by shard order),
    saying on which shards a mutating call was nevertheless applied."""
    out: list[Message | None] = []
    failure: PSError | None = None
    for request, result in zip(batch, results):
        try:
            out.append(accept(request, result))
        except PSError as exc:
            out.append(None)
            if failure is None:
                failure = exc
    if failure is not None:
        done = [urls[r.shard] for r, m in zip(batch, out) if m is not None]
        if batch[0].mutating and done:
            note = f" (the {batch[0].verb} was nevertheless applied on {', '.join(done)})"
            failure.message += note
            failure.args = (failure.message,)
            failure.details.setdefault("applied_on", done)
        raise failure
    return [m for m in out if m is not None]


def per_variable(
    batch: list[ShardRequest], replies: list[Message], key: str, urls: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Name -> its entry of the map ``key`` in its shard's reply, for every name requested
    (a write's per-variable results); :class:`ProtocolError` for a name without one."""
    out: dict[str, dict[str, Any]] = {}
    for request, reply in zip(batch, replies):
        url = urls[request.shard]
        entries = reply.msg.get(key)
        if not isinstance(entries, Mapping):
            raise ProtocolError(
                f"shard {url} sent a {request.verb} reply without '{key}'", shard=url
            )
        for name in request.names:
            entry = entries.get(name)
            if not isinstance(entry, Mapping):
                raise ProtocolError(
                    f"shard {url} sent no result for {name!r} in its {request.verb} reply",
                    shard=url,
                )
            out[name] = dict(entry)
    return out


def refuse_encoded(headers: Mapping[str, str], status: int, url: str) -> None:
    """Refuse a reply whose body is encoded (compressed): the SDK asks for identity, and a
    compressed body could expand past what the call can need before anything checked it."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise ProtocolError(
            f"shard {url} sent a body with Content-Encoding {encoding!r} "
            "although the SDK asked for identity: is it behind a proxy "
            "that compresses?",
            shard=url,
            status=status,
        )


def too_large(size: int, limit: int, declared: bool, url: str) -> ProtocolError:
    """The error for a reply body of ``size`` bytes (``declared`` in its Content-Length, or
    received so far) where at most ``limit`` were expected."""
    what = "declared a reply body of" if declared else "sent a reply body of more than"
    return ProtocolError(
        f"shard {url} {what} {size} bytes where at most {limit} were expected: refused before "
        "reading it, and the connection closed. Something that is not a shard answered, or a "
        "variable is bigger than this client knows (then raise max_reply_bytes=...)",
        shard=url,
        details={"size": size, "limit": limit},
    )
