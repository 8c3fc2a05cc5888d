"""The small HTTP clients the command line looks at shards with, from outside: a shard's
``/v1/cluster`` and ``/healthz`` for ``paramshard status`` (:func:`probe_fleet`), and one probe
of ``/healthz`` or ``/readyz`` for ``paramshard health`` (:func:`check`).

They read the JSON meant for people, never the data plane. They go straight to the shard: the
proxy settings of the environment (``HTTP_PROXY``, ``ALL_PROXY`` and the like, meant for
reaching the outside) are not used, so a probe of a fleet on this host or its network never
asks a proxy instead; ``paramshard status --proxy URL`` names a proxy when one is wanted.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from client_sdk.wire import ENV_TOKEN

from .launcher import unverified

__all__ = ["check", "probe_fleet", "probe_shard"]


def probe_shard(url: str, timeout: float, proxy: str | None = None) -> dict[str, Any]:
    """``{"info": <its /v1/cluster>, "healthy": bool}``, or ``{"error": "..."}`` when the
    shard does not answer. Sends ``PARAMSHARD_TOKEN`` when it is set (a shard with auth on
    answers ``/v1/cluster`` only to a token). Through ``proxy`` if given, else straight to the
    shard. Blocks up to about twice ``timeout``."""
    import httpx2

    token = os.environ.get(ENV_TOKEN)
    headers = {"authorization": f"Bearer {token}"} if token else None
    try:
        with httpx2.Client(
            timeout=timeout, headers=headers, trust_env=False, proxy=proxy
        ) as client:
            info = client.get(url + "/v1/cluster").raise_for_status().json()
            healthy = client.get(url + "/healthz").status_code == 200
        return {"info": info, "healthy": healthy}
    except (httpx2.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def probe_fleet(urls: list[str], timeout: float, proxy: str | None = None) -> list[dict[str, Any]]:
    """:func:`probe_shard` of every URL, at once; the results in the order of ``urls``."""
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(lambda u: probe_shard(u, timeout, proxy), urls))


def check(url: str, timeout: float) -> str | None:
    """``None`` if a GET of ``url`` answers 200 within ``timeout`` seconds, else why not. Never
    through a proxy: the shard probed is on this host."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=unverified())
    )
    try:
        with opener.open(url, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as exc:
        return f"answered {exc.code}"
    except OSError as exc:
        return f"did not answer: {exc}"
    return None
