"""A small client of etcd v3's HTTP/JSON gateway: :class:`EtcdClient`.

What leadership (:mod:`server.replication.leadership`) needs of etcd and nothing more: leases
(grant, keep alive, revoke), reading a key, creating a key only if absent, replacing or
deleting one only if it was not changed since it was read (compare ``mod_revision``), and
waiting for a key to change (watch). It speaks the gateway every etcd 3.4+ serves on its client
URLs (``POST /v3/...``, keys and values base64, 64-bit numbers as strings) over httpx2, so it
needs no client library of its own.

Every reply is checked: a status other than 200, a body that is not the JSON expected, or an
error etcd reports is an :class:`EtcdError` naming the endpoint and what to check; nothing here
raises anything else for a bad reply. With several endpoints (the members of an etcd cluster),
a request that cannot reach one is sent to the next.

Not thread-safe: one event loop uses it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx2

__all__ = ["EtcdClient", "EtcdError", "KeyValue", "LeaseLost"]

#: Seconds one request to etcd may take (a slow etcd looks down to leadership: it must not
#: wait longer than a fraction of a lease for an answer).
DEFAULT_TIMEOUT = 1.0
#: The most bytes of an etcd reply read (a key of ours holds a few hundred bytes).
MAX_REPLY = 1 << 20


class EtcdError(Exception):
    """etcd could not be reached, refused a request, or answered something unexpected."""


class LeaseLost(EtcdError):
    """The lease is gone (expired or revoked): whatever it held is released."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd holds it."""

    key: str
    value: bytes
    #: The revision that created the key (its current incarnation): only grows.
    create_revision: int
    #: The revision of its last change.
    mod_revision: int
    #: The lease it is attached to (0: none).
    lease: int


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def _int(obj: Any, key: str, where: str) -> int:
    """An int64 field of a reply (the gateway writes them as strings, and leaves out zeros)."""
    value = obj.get(key, "0") if isinstance(obj, dict) else None
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EtcdError(f"{where}: field {key!r} is {value!r}, not an integer") from None


def _kv(obj: Any, where: str) -> KeyValue:
    if not isinstance(obj, dict):
        raise EtcdError(f"{where}: a key-value is {type(obj).__name__}, not an object")
    try:
        key = base64.b64decode(obj.get("key", ""), validate=True).decode()
        value = base64.b64decode(obj.get("value", ""), validate=True)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise EtcdError(f"{where}: a key or value is not base64 ({exc})") from None
    return KeyValue(
        key,
        value,
        _int(obj, "create_revision", where),
        _int(obj, "mod_revision", where),
        _int(obj, "lease", where),
    )


class EtcdClient:
    """The etcd cluster at ``endpoints`` (client URLs, e.g. ``http://127.0.0.1:2379``)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        client: httpx2.AsyncClient | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._current = 0
        # https endpoints verified with the system's CAs (SSL_CERT_FILE: a private CA)
        self._client = client or httpx2.AsyncClient(
            timeout=timeout, trust_env=False, verify=ssl.create_default_context()
        )

    async def close(self) -> None:
        await self._client.aclose()

    # -- one request ------------------------------------------------------------------------

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers; the reply's JSON.

        Raises :class:`EtcdError` when none answers, or for an error or a malformed reply."""
        failures = []
        n = len(self.endpoints)
        for step in range(n):
            i = (self._current + step) % n
            url = self.endpoints[i] + path
            try:
                reply = await self._client.post(url, json=body, timeout=self.timeout)
            except httpx2.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            self._current = i
            return self._check(url, reply)
        raise EtcdError(
            "cannot reach etcd (" + "; ".join(failures) + "): is it running, and is --etcd right?"
        )

    @staticmethod
    def _check(url: str, reply: httpx2.Response) -> dict[str, Any]:
        if len(reply.content) > MAX_REPLY:
            raise EtcdError(f"{url}: a reply of {len(reply.content)} bytes is not etcd's")
        try:
            doc = json.loads(reply.content)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise EtcdError(
                f"{url} answered {reply.status_code} without a JSON object "
                f"({reply.content[:120]!r}): is this etcd's client URL (etcd 3.4 or newer)?"
            )
        if reply.status_code != 200 or "error" in doc:
            message = doc.get("message") or doc.get("error") or reply.reason_phrase
            if "lease not found" in str(message):
                raise LeaseLost(f"{url}: {message}")
            raise EtcdError(f"{url} refused the request ({reply.status_code}): {message}")
        return doc

    # -- leases -----------------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds: ``(id, granted ttl)`` (etcd may raise a TTL below
        its minimum)."""
        doc = await self.call("/v3/lease/grant", {"TTL": ttl})
        lease, granted = _int(doc, "ID", "lease grant"), _int(doc, "TTL", "lease grant")
        if lease == 0 or granted <= 0:
            raise EtcdError(f"lease grant answered {doc!r}: no lease")
        return lease, granted

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease`` once; its TTL from now. :class:`LeaseLost` if it expired."""
        doc = await self.call("/v3/lease/keepalive", {"ID": lease})
        result = doc.get("result")
        if not isinstance(result, dict):
            raise EtcdError(f"lease keepalive answered {doc!r}: no result")
        ttl = _int(result, "TTL", "lease keepalive")
        if ttl <= 0:
            raise LeaseLost(f"lease {lease:x} expired")
        return ttl

    async def revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys are deleted); one already gone is not an error."""
        try:
            await self.call("/v3/lease/revoke", {"ID": lease})
        except LeaseLost:
            pass

    # -- keys -------------------------------------------------------------------------------

    async def get(self, key: str) -> tuple[KeyValue | None, int]:
        """``key`` (``None`` when absent) and the store's revision when it was read."""
        doc = await self.call("/v3/kv/range", {"key": _b64(key)})
        return self._one(doc, "range " + key), _int(doc.get("header"), "revision", "range " + key)

    async def create(self, key: str, value: bytes, lease: int = 0) -> tuple[int, KeyValue | None]:
        """Put ``key`` only if absent. ``(revision, None)`` when this call created it (the
        revision is then the key's create_revision), else ``(0, the key as it is)``; the key
        may be gone again by the time this returns (the key is then ``None``)."""
        return await self._txn(
            {"target": "CREATE", "key": _b64(key), "create_revision": "0", "result": "EQUAL"},
            {"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}},
            key,
        )

    async def replace(
        self, key: str, value: bytes, mod_revision: int, lease: int = 0
    ) -> tuple[int, KeyValue | None]:
        """Put ``key`` only if its mod_revision is still ``mod_revision`` (0: it is absent).
        ``(revision, None)`` when done (the key's new mod_revision), else ``(0, the key as it
        is now, or None)``."""
        compare = {
            "target": "MOD",
            "key": _b64(key),
            "mod_revision": str(mod_revision),
            "result": "EQUAL",
        }
        put = {"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}
        return await self._txn(compare, put, key)

    async def delete(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``."""
        compare = {
            "target": "MOD",
            "key": _b64(key),
            "mod_revision": str(mod_revision),
            "result": "EQUAL",
        }
        done, _ = await self._txn(compare, {"request_delete_range": {"key": _b64(key)}}, key)
        return done > 0

    async def _txn(
        self, compare: dict[str, Any], success: dict[str, Any], key: str
    ) -> tuple[int, KeyValue | None]:
        doc = await self.call(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [success],
                "failure": [{"request_range": {"key": _b64(key)}}],
            },
        )
        if doc.get("succeeded") is True:
            revision = _int(doc.get("header"), "revision", "txn " + key)
            if revision <= 0:
                raise EtcdError(f"txn on {key} answered {doc!r}: no revision")
            return revision, None
        responses = doc.get("responses")
        if not isinstance(responses, list) or len(responses) != 1:
            raise EtcdError(f"txn on {key} answered {doc!r}: expected one response")
        found = responses[0].get("response_range") if isinstance(responses[0], dict) else None
        return 0, self._one(found or {}, "txn " + key)

    @staticmethod
    def _one(doc: Any, where: str) -> KeyValue | None:
        kvs = doc.get("kvs", []) if isinstance(doc, dict) else None
        if not isinstance(kvs, list) or len(kvs) > 1:
            raise EtcdError(f"{where}: expected at most one key, got {kvs!r:.200}")
        return _kv(kvs[0], where) if kvs else None

    # -- waiting ----------------------------------------------------------------------------

    async def watch(self, key: str, after: int, timeout: float, *, prefix: bool = False) -> bool:
        """Wait until ``key`` (``prefix``: any key starting with it) changes after revision
        ``after`` (a put or a delete at a higher revision); ``True`` when it did, ``False``
        after ``timeout`` seconds without a change. A watch etcd cancels (its history was
        compacted) counts as a change: the caller reads the key again."""
        request = {"key": _b64(key), "start_revision": str(after + 1)}
        if prefix:
            raw = key.encode()
            request["range_end"] = _b64(raw[:-1] + bytes([raw[-1] + 1]))
        body = {"create_request": request}
        try:
            return await asyncio.wait_for(self._watch(body, key), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return False

    async def _watch(self, body: dict[str, Any], key: str) -> bool:
        url = self.endpoints[self._current] + "/v3/watch"
        try:
            async with self._client.stream("POST", url, json=body, timeout=None) as reply:
                if reply.status_code != 200:
                    raise EtcdError(f"{url} refused a watch of {key} ({reply.status_code})")
                async for line in reply.aiter_lines():
                    if len(line) > MAX_REPLY:
                        raise EtcdError(f"{url}: a watch event of {len(line)} bytes")
                    try:
                        doc = json.loads(line) if line.strip() else {}
                    except ValueError:
                        bad = line[:120]
                        raise EtcdError(f"{url}: a watch event is not JSON: {bad!r}") from None
                    result = doc.get("result") if isinstance(doc, dict) else None
                    if isinstance(doc, dict) and "error" in doc:
                        raise EtcdError(f"{url}: watch of {key} failed: {doc['error']}")
                    if isinstance(result, dict) and (
                        result.get("events") or result.get("canceled")
                    ):
                        return True
        except httpx2.HTTPError as exc:
            raise EtcdError(f"cannot watch {key} at {url}: {type(exc).__name__}: {exc}") from exc
        raise EtcdError(f"{url} ended the watch of {key} without an event")
