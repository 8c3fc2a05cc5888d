"""``GET /v1/replicas``: the replica group of this shard's index as this replica sees it, for
the dashboard and for operators during a failover.

Every replica of the group (``--replica-group``) is asked for its ``GET /v1/cluster`` now (this
one answers from its own state), and each is shown with what it says of itself: up or not, its
role, epoch, lsn (the newest write it holds), what it says of etcd; and with what the group's
primary says of it: whether the primary's in-sync set lists it (a write is acknowledged only
once every listed backup has it) and its lag. Which replica is the primary, and the lag, follow
server/replication/group.py's rule (as ``paramshard status`` and the fleet view do).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import httpx2

from ..replication.group import in_sync, lag, primary_of

__all__ = ["replicas_view"]


def verify_context(state: Any) -> ssl.SSLContext:
    """How this shard's pages verify the https shards they probe: the system's CAs (OpenSSL's
    store, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``: a private CA), as the replicas verify each
    other; read once per process (loading the CA files costs milliseconds)."""
    tls = getattr(state, "verify_context", None)
    if tls is None:
        tls = state.verify_context = ssl.create_default_context()
    return tls


def _self(state: Any) -> dict[str, Any]:
    cluster = (
        state.replication.stats() if state.replication is not None else state.role.view.to_json()
    )
    leadership = getattr(state, "leadership", None)
    return {
        "self": True,
        "up": True,
        "replication": cluster,
        "leadership": leadership.status() if leadership is not None else None,
    }


async def _ask(client: httpx2.AsyncClient, url: str) -> dict[str, Any]:
    try:
        r = await client.get(url.rstrip("/") + "/v1/cluster")
    except httpx2.HTTPError as exc:
        return {"up": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    if r.status_code != 200:
        return {"up": True, "error": f"/v1/cluster answered {r.status_code}"}
    try:
        info = r.json()
        replication = info["replication"]
        if not isinstance(replication, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return {"up": True, "error": "not a paramshard /v1/cluster reply"}
    return {"up": True, "replication": replication, "leadership": info.get("leadership")}


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


async def replicas_view(state: Any, auth: str | None, timeout: float) -> dict[str, Any]:
    """The body of ``GET /v1/replicas`` (module docstring); each other replica asked with the
    caller's ``Authorization`` and ``timeout`` seconds to answer."""
    config = state.config
    group = list(config.replica_group) or [config.advertise_url]
    mine = config.advertise_url
    headers = {"authorization": auth} if auth else {}
    async with httpx2.AsyncClient(
        timeout=timeout, headers=headers, trust_env=False, verify=verify_context(state)
    ) as client:
        answers = await asyncio.gather(
            *(
                asyncio.sleep(0, _self(state))
                if url == mine or len(group) == 1
                else _ask(client, url)
                for url in group
            )
        )
    rows: list[dict[str, Any]] = []
    for url, answer in zip(group, answers):
        rep = answer.get("replication") or {}
        lead = answer.get("leadership")
        rows.append(
            {
                "url": url,
                "self": bool(answer.get("self")),
                "up": answer["up"],
                "role": rep.get("role"),
                "epoch": _int(rep.get("epoch")),
                "lsn": _int(rep.get("lsn")),
                "primary": rep.get("primary"),
                "lag": None,
                "in_sync": None,
                "etcd": None
                if not isinstance(lead, dict)
                else {
                    "holds_lease": lead.get("holds_lease"),
                    "eligible": lead.get("eligible"),
                    "resyncing": lead.get("resyncing"),
                    "restarted": lead.get("restarted"),
                    "error": lead.get("error"),
                },
                "error": answer.get("error"),
            }
        )
    p = primary_of([a.get("replication") for a in answers])
    primary = rows[p] if p is not None else None
    says: dict[str, Any] = answers[p]["replication"] if p is not None else {}
    for row, answer in zip(rows, answers):
        if primary is None:
            continue
        rep = answer.get("replication") or {}
        row["lag"] = lag(says, rep, row["url"]) if row is not primary else 0
        if row is not primary:
            row["in_sync"] = in_sync(says, rep, row["url"])
    return {
        "shard_index": config.shard_index,
        "num_shards": config.num_shards,
        "replicated": bool(config.replica_group),
        "etcd": bool(config.etcd),
        "primary": primary["url"] if primary is not None else None,
        "epoch": primary["epoch"] if primary is not None else None,
        "replicas": rows,
    }
