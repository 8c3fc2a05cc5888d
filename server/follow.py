"""Inspection that follows the variable: ``GET /v1/variables/{name}`` asked of a shard that does
not own ``name`` is answered with the owner's answer.

A person with one shard's address (``curl localhost:7100/...``, a port-forward to one pod, the
host port of one compose service) can look at any variable: the shard asks the owner over the
fleet's own network (``--fleet-urls``, the URLs as the shards reach each other, which a
client outside may not reach, hence no redirect) and relays its answer, status, body and
content type, streamed (a ``.npy`` of any size costs a buffer, not the variable). The
request goes with the caller's ``Authorization`` and query, ``x-paramshard-fleet`` naming the
owner (a wrong URL list is refused by the shard it reaches, not answered for the wrong
shard), and :data:`FORWARDED`, which a shard never follows again (no loops). The answer carries
``x-paramshard-owner: <index>/<N>``. An owner listed as a replica group (``a|b``) is asked at
each replica in turn until one answers (every replica answers inspection, a backup from its own
state); an ``https`` owner's certificate is verified against the system's CAs (OpenSSL's
store, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``: a private CA). Without ``--fleet-urls``, or
for a forwarded request, the shard answers its own 421 ``not_owner`` (the refusal
:func:`follow` is given); an owner that does not answer is 503.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx2
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from client_sdk import wire

from .errors import ShardError
from .headers import request_headers

__all__ = ["FORWARDED", "follow"]

#: The header a shard sets on a request it forwards to the owner.
FORWARDED = wire.HEADER_FORWARDED
#: Seconds the owner has to start answering (its body then streams at the caller's pace).
TIMEOUT = 30.0
_RELAYED = ("content-type", "content-length", "content-disposition", "retry-after")


def _client(request: Request) -> httpx2.AsyncClient:
    state = request.app.state
    client = getattr(state, "follow_client", None)
    if client is None:
        # https owners are verified with the system's CAs (OpenSSL's store, SSL_CERT_FILE /
        # SSL_CERT_DIR), as the other replicas and the forwarder verify them; httpx2's own
        # default, without the environment, ignores SSL_CERT_FILE: a private CA would fail.
        client = state.follow_client = httpx2.AsyncClient(
            timeout=TIMEOUT,
            trust_env=False,
            follow_redirects=False,
            verify=ssl.create_default_context(),
        )
    return client


async def follow(request: Request, refusal: ShardError) -> Response:
    """The owner's answer to ``request`` (whose name this shard refused as not its own with
    ``refusal``), or ``refusal`` raised when the shard cannot ask the owner."""
    config = request.app.state.config
    headers = request_headers(request.scope)
    owners = refusal.details.get("owners") or {}
    if not config.fleet_urls or FORWARDED.encode() in headers or len(owners) != 1:
        raise refusal
    (owner,) = owners.values()
    listed = config.fleet_urls[owner]
    sent: dict[str, Any] = {
        FORWARDED: config.fleet,
        wire.HEADER_FLEET: f"{owner}/{config.num_shards}",
        "accept-encoding": "identity",
    }
    for name in (b"authorization", b"accept"):
        if name in headers:
            sent[name.decode()] = headers[name].decode("latin-1")
    client = _client(request)
    failed: BaseException | None = None
    for replica in listed.split("|"):  # each replica of a group in turn (any one answers)
        try:
            reply = await client.send(
                client.build_request(
                    "GET", replica + request.url.path, params=request.query_params, headers=sent
                ),
                stream=True,
            )
            break
        except httpx2.HTTPError as exc:
            failed = exc
    else:
        raise ShardError(
            "unavailable",
            f"this is shard {config.fleet}; the variable belongs to shard {owner}/"
            f"{config.num_shards}, which did not answer at {listed} "
            f"({type(failed).__name__}): ask it directly, or check --fleet-urls",
            {"owner": owner, "reason": "owner_unreachable"},
            headers={"Retry-After": "1"},
        ) from None
    relayed = {k: v for k, v in reply.headers.items() if k.lower() in _RELAYED}
    relayed[wire.HEADER_OWNER] = f"{owner}/{config.num_shards}"
    return StreamingResponse(
        reply.aiter_raw(),
        status_code=reply.status_code,
        headers=relayed,
        background=BackgroundTask(reply.aclose),
    )
