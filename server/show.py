"""``paramshard get NAME [--values]``: one variable (or counter) of a fleet, for people.

The owner is found by the placement every client uses (:func:`client_sdk.placement.shard_for`
over the fleet's URLs, ``--shards`` or ``PARAMSHARD_SHARDS``), and asked for
``GET /v1/variables/NAME`` (with ``?values=true`` for ``--values``), sending
``PARAMSHARD_TOKEN`` when it is set. It prints the variable's fields, one a line (a counter's
value among them), or the JSON as the shard sent it (``--json``). An owner listed as a replica
group (``a0|b0``) is read through its primary: every replica is asked for its
``GET /v1/cluster``, the one saying it is primary at the highest epoch is asked for the
variable, and each replica's role, epoch, lsn, lag and in-sync state (the last two as the
primary says them, :func:`server.status.replica_cells`) follow the fields. Like the probes, it
talks to the shards as any client does and imports no web stack.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote

from client_sdk.placement import shard_for
from client_sdk.wire import ENV_TOKEN

from .status import group_primary, replica_cells, replication_of

__all__ = ["FIELDS", "fetch", "render"]

#: The fields printed, in this order (those the shard sent), before the values.
FIELDS = (
    "name",
    "kind",
    "value",
    "shape",
    "dtype",
    "version",
    "updates",
    "optimizer",
    "frozen",
    "mode",
    "last_update",
    "last_writer",
    "l2_norm",
    "min",
    "max",
    "mean",
    "counts",
    "staleness",
)


def fetch(
    groups: list[list[str]], name: str, values: bool, timeout: float
) -> tuple[int, Any, str, list[str] | None]:
    """``(status, decoded JSON or None, owner URL, the replicas' lines or None)`` of the
    owner's answer for ``name`` (``groups[i]``: shard index ``i``'s replicas; of a group, the
    primary answers). Raises ``httpx2.HTTPError`` when the owner does not answer."""
    import httpx2

    group = groups[shard_for(name, len(groups))]
    token = os.environ.get(ENV_TOKEN)
    headers = {"authorization": f"Bearer {token.split(',')[-1].strip()}"} if token else {}
    with httpx2.Client(timeout=timeout, headers=headers, trust_env=False) as client:
        owner, replicas = group[0], None
        if len(group) > 1:
            results = [_cluster(client, url) for url in group]
            p = group_primary(results)
            replicas = replica_lines(group, results, p)
            if p is None:
                message = (
                    f"no replica of shard index {groups.index(group)} says it is the primary "
                    "now (a failover may be under way: try again in a few seconds)"
                )
                return 503, {"error": {"message": message}}, "|".join(group), replicas
            owner = group[p]
        r = client.get(
            f"{owner}/v1/variables/{quote(name, safe='/:')}",
            params={"values": "true"} if values else None,
        )
    try:
        body = r.json()
    except ValueError:
        body = None
    return r.status_code, body, owner, replicas


def _cluster(client: Any, url: str) -> dict[str, Any]:
    """``{"info": its /v1/cluster}``, or ``{"error": ...}`` (as :mod:`server.probes` says)."""
    import httpx2

    try:
        return {"info": client.get(url + "/v1/cluster").raise_for_status().json()}
    except (httpx2.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def replica_lines(group: list[str], results: list[dict[str, Any]], p: int | None) -> list[str]:
    """One line per replica of ``group``: its role, epoch, lsn, lag and in-sync state."""
    primary = replication_of(results[p]) if p is not None else None
    lines = []
    for url, res in zip(group, results):
        if "info" not in res:
            lines.append(f"{url}: down ({res.get('error', '?')})")
            continue
        role, epoch, lsn, lag, in_sync = replica_cells(url, replication_of(res), primary)
        lines.append(f"{url}: {role} at epoch {epoch}, lsn {lsn}, lag {lag}, in-sync {in_sync}")
    return lines


def render(variable: dict[str, Any], values: bool, replicas: list[str] | None = None) -> str:
    """The lines ``paramshard get`` prints for a variable's JSON (and the owner's replicas)."""
    lines = []
    for key in FIELDS:
        if key in variable:
            value = variable[key]
            text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
            lines.append(f"{key}: {text}")
    if values and "values" in variable:
        lines.append(f"values: {json.dumps(variable['values'])}")
    if replicas:
        lines.append("replicas:")
        lines += [f"  {line}" for line in replicas]
    return "\n".join(lines)
