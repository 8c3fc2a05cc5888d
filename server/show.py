"""``paramshard get NAME [--values]``: one variable (or counter) of a fleet, for people.

The owner is found by the placement every client uses (:func:`client_sdk.placement.shard_for`
over the fleet's URLs, ``--shards`` or ``PARAMSHARD_SHARDS``), and asked for
``GET /v1/variables/NAME`` (with ``?values=true`` for ``--values``), sending
``PARAMSHARD_TOKEN`` when it is set. It prints the variable's fields, one a line (a counter's
value among them), or the JSON as the shard sent it (``--json``). Like the probes, it talks to
the shards as any client does and imports no web stack.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote

from client_sdk.placement import shard_for
from client_sdk.wire import ENV_TOKEN

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


def fetch(urls: list[str], name: str, values: bool, timeout: float) -> tuple[int, Any, str]:
    """``(status, decoded JSON or None, owner URL)`` of the owner's answer for ``name``.
    Raises ``OSError``-like ``httpx2.HTTPError`` when the owner does not answer."""
    import httpx2

    owner = urls[shard_for(name, len(urls))]
    token = os.environ.get(ENV_TOKEN)
    headers = {"authorization": f"Bearer {token.split(',')[-1].strip()}"} if token else {}
    with httpx2.Client(timeout=timeout, headers=headers, trust_env=False) as client:
        r = client.get(
            f"{owner}/v1/variables/{quote(name, safe='/:')}",
            params={"values": "true"} if values else None,
        )
    try:
        body = r.json()
    except ValueError:
        body = None
    return r.status_code, body, owner


def render(variable: dict[str, Any], values: bool) -> str:
    """The lines ``paramshard get`` prints for a variable's JSON."""
    lines = []
    for key in FIELDS:
        if key in variable:
            value = variable[key]
            text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
            lines.append(f"{key}: {text}")
    if values and "values" in variable:
        lines.append(f"values: {json.dumps(variable['values'])}")
    return "\n".join(lines)
