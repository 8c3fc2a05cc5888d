"""The pages a shard serves to browsers, with nothing fetched from elsewhere: the live dashboard
at ``/`` (one HTML file with its script inline, polling the JSON inspection endpoints), the
OpenAPI page at ``/docs`` with swagger-ui's files served under ``/docs/assets/`` from the
installed ``fastapi-offline`` package (which ships them as its package data),
``GET /v1/fleet``, the fleet as this shard sees it (every shard of ``--fleet-urls``, probed from
here: up or down), and ``GET /v1/replicas``, the replica group of this shard's index
(:mod:`server.pages.replicas`).

The pages hold no data (they are open when the shard checks tokens, :mod:`server.auth`); the
dashboard's script sends the token the user gives it with each request for data.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx2
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from ..errors import ShardError
from ..replication.group import primary_of
from .replicas import replicas_view, verify_context

__all__ = ["ASSETS", "PROBE_TIMEOUT", "router", "swagger_files"]

router = APIRouter(tags=["pages"])

#: swagger-ui's files the OpenAPI page loads, served under ``/docs/assets/``.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
#: How long ``GET /v1/fleet`` waits for each shard it probes, in seconds.
PROBE_TIMEOUT = 2.0
#: ``GET /v1/fleet`` answers from its last probes while they are younger than this (seconds):
#: dashboards polling many shards do not multiply the probes.
FLEET_CACHE_SECONDS = 1.0
#: Shards probed at once by ``GET /v1/fleet``.
PROBE_CONCURRENCY = 32

_DASHBOARD = resources.files(__package__).joinpath("dashboard.html")


def swagger_files() -> Path:
    """The directory of swagger-ui's dist files in the installed ``fastapi-offline``."""
    return Path(str(resources.files("fastapi_offline").joinpath("static")))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live dashboard: this shard's variables and workers and the fleet, refreshed every
    second from ``/v1/cluster``, ``/v1/variables``, ``/v1/workers`` and ``/v1/fleet``."""
    return HTMLResponse(_DASHBOARD.read_text(encoding="utf-8"))


@router.get("/docs", response_class=HTMLResponse, include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    """The OpenAPI page, its script and style served by this shard."""
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url,
        title=f"{request.app.title} - API",
        swagger_js_url="/docs/assets/swagger-ui-bundle.js",
        swagger_css_url="/docs/assets/swagger-ui.css",
        swagger_favicon_url="/docs/assets/favicon.png",
    )


@router.get("/docs/assets/{name}", include_in_schema=False)
async def docs_asset(name: str) -> Response:
    """One of :data:`ASSETS`, from the installed fastapi-offline."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise ShardError(
            "not_found",
            f"no asset {name[:80]!r}: the OpenAPI page's are {', '.join(sorted(ASSETS))}",
            {"path": f"/docs/assets/{name[:80]}"},
        )
    return FileResponse(
        swagger_files() / name,
        media_type=media_type,
        headers={"cache-control": "public, max-age=86400"},
    )


@router.get("/v1/replicas", tags=["inspection (JSON)"])
async def replicas(request: Request) -> JSONResponse:
    """The replica group of this shard's index (`--replica-group`), each replica asked now
    (`GET /v1/cluster`, the caller's `Authorization` passed on): `url`, `self`, `up`, `role`,
    `epoch`, `lsn`, `primary` (the one it follows), `lag` (the group primary's lsn minus its
    own), `in_sync` (listed in the primary's in-sync set), `etcd` (`holds_lease`, `eligible`,
    `resyncing`, `restarted`, `error`; null without `--etcd`), `error`; and the group's
    `primary` and `epoch`. A shard without replicas lists itself alone."""
    auth = request.headers.get("authorization")
    return JSONResponse(await replicas_view(request.app.state, auth, PROBE_TIMEOUT))


@router.get("/v1/fleet", tags=["inspection (JSON)"])
async def fleet(request: Request) -> JSONResponse:
    """Every shard of the fleet as this shard sees it: `--fleet-urls` (PARAMSHARD_FLEET_URLS) in
    index order, each probed now (`GET /v1/cluster`, the caller's `Authorization` passed on):
    `up`, and when up its `incarnation`, `variables`, `bytes`, `state_version`, `ready`;
    when down, `error`. An index listed as a replica group (`a|b`) is shown by its primary
    (else the first replica that answers), with `replicas`: each one's `url`, `up`, `role`,
    `epoch`, `lsn`, `error`. Without `--fleet-urls` only this shard is listed, with its URL
    null."""
    state = request.app.state
    config = state.config
    auth = request.headers.get("authorization")
    cached = getattr(state, "fleet_view", None)
    now = time.monotonic()
    if cached is not None and cached[0] == auth and now - cached[1] < FLEET_CACHE_SECONDS:
        return JSONResponse(cached[2])
    urls: list[str | None] = list(config.fleet_urls) or [None] * config.num_shards
    limit = asyncio.Semaphore(PROBE_CONCURRENCY)
    headers = {"authorization": auth} if auth else {}
    tls = verify_context(state)  # the system's CAs (SSL_CERT_FILE: a private CA)
    async with httpx2.AsyncClient(timeout=PROBE_TIMEOUT, headers=headers, verify=tls) as client:
        shards = await asyncio.gather(
            *(_probe(client, limit, i, url, state) for i, url in enumerate(urls))
        )
    body = {
        "shard_index": config.shard_index,
        "num_shards": config.num_shards,
        "configured": bool(config.fleet_urls),
        "shards": shards,
    }
    state.fleet_view = (auth, now, body)
    return JSONResponse(body)


async def _probe(
    client: httpx2.AsyncClient, limit: asyncio.Semaphore, index: int, url: str | None, state: Any
) -> dict[str, Any]:
    if url is not None and "|" in url:
        return await _probe_group(client, limit, index, url.split("|"), state)
    if index == state.config.shard_index:
        return _probe_self(index, url, state)
    entry: dict[str, Any] = {"index": index, "url": url}
    if url is None:
        return {**entry, "up": None, "error": "unknown: start the shards with --fleet-urls"}
    return await _probe_url(client, limit, index, url, state.config.num_shards)


def _probe_self(index: int, url: str | None, state: Any) -> dict[str, Any]:
    store, gate, role = state.store, state.gate, state.role.view
    replication = getattr(state, "replication", None)
    return {
        "index": index,
        "url": url,
        "self": True,
        "up": True,
        "ready": gate.ready and gate.persist_error is None,
        "incarnation": state.incarnation,
        "variables": len(store),
        "bytes": store.nbytes,
        "state_version": store.state_version,
        "role": role.kind,
        "epoch": role.epoch,
        "lsn": replication.log.head if replication is not None else None,
    }


async def _probe_url(
    client: httpx2.AsyncClient, limit: asyncio.Semaphore, index: int, url: str, num_shards: int
) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "url": url}
    async with limit:
        try:
            r = await client.get(url.rstrip("/") + "/v1/cluster")
        except httpx2.HTTPError as exc:
            return {**entry, "up": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    if r.status_code != 200:
        error = f"/v1/cluster answered {r.status_code}"
        return {**entry, "up": True, "ready": False, "error": error}
    try:
        cluster = r.json()
        rep = cluster.get("replication") or {}
        peer = {
            "ready": cluster["admission"]["phase"] == "ready",
            "incarnation": str(cluster["incarnation"]),
            "variables": int(cluster["variables"]),
            "bytes": int(cluster["bytes"]),
            "state_version": int(cluster["state_version"]),
            "role": rep.get("role"),
            "epoch": rep.get("epoch"),
            "lsn": rep.get("lsn"),
        }
        if (cluster["shard_index"], cluster["num_shards"]) != (index, num_shards):
            return {
                **entry,
                "up": True,
                "ready": False,
                "error": f"that URL is shard {cluster['shard_index']}/{cluster['num_shards']}",
            }
    except (ValueError, KeyError, TypeError, AttributeError):
        return {**entry, "up": True, "ready": False, "error": "not a paramshard /v1/cluster reply"}
    return {**entry, "up": True, **peer}


async def _probe_group(
    client: httpx2.AsyncClient,
    limit: asyncio.Semaphore,
    index: int,
    urls: list[str],
    state: Any,
) -> dict[str, Any]:
    """An index served by a replica group: each replica probed (this one from its own state),
    the index shown by its primary (server/replication/group.py's rule), else by the
    first that answers, else as down."""
    config = state.config
    probes = await asyncio.gather(
        *(
            asyncio.sleep(0, _probe_self(index, u, state))
            if index == config.shard_index and u == config.advertise_url
            else _probe_url(client, limit, index, u, config.num_shards)
            for u in urls
        )
    )
    replicas = [
        {k: p.get(k) for k in ("url", "up", "role", "epoch", "lsn", "error")} for p in probes
    ]
    k = primary_of(probes)
    shown = (
        probes[k]
        if k is not None
        else next((p for p in probes if p["up"] and not p.get("error")), probes[0])
    )
    return {**shown, "replicas": replicas}
