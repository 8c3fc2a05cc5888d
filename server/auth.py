"""Bearer-token auth: which requests need which token, and the check every request meets.

A shard started with tokens (``--token`` / ``PARAMSHARD_TOKEN``, ``--token-file``; optionally
``--read-token``) answers a request only when its ``Authorization: Bearer <token>`` header names
a token that allows it (:func:`access`):

* **open**, no token: ``/healthz``, ``/readyz`` (probes), ``/docs`` with its assets,
  ``/openapi.json`` and the dashboard page ``/`` (static, no data in it: it sends a token for
  what it shows);
* **read** (a read token or a full one): every other ``GET``/``HEAD`` (inspection, metrics)
  and the reads of the data plane, ``POST /v1/pull``, ``/v1/wait``, ``/v1/poll``;
* **write** (a full token only): everything else (writes, pauses, snapshots, deletes).

:class:`AuthMiddleware` checks the header before the request goes further, so a refused
request's body is never read and nothing changes: 401 ``unauthorized`` (no header, a malformed
one, or a token the shard does not accept; with ``WWW-Authenticate: Bearer``) or 403
``forbidden`` (a read token on a write). Each refusal is counted by reason in
:attr:`Guard.refused` and logged, at most one line per :data:`LOG_EVERY` seconds, never with
the token. Tokens are compared as SHA-256 digests with :func:`hmac.compare_digest`, against
every accepted token, so the time taken says nothing about a token's contents or length.

A request that sends an accepted token the way the SDK does (``Bearer <token>``, one space) is
let through on one dict lookup of its header's value (:attr:`Guard.exact`, made from the
accepted tokens whenever they change): the data plane pays a hash of a short string, not a
SHA-256 and a comparison per token. The lookup says nothing about a token it does not hold:
a dict compares a key's bytes only after its hash matched, and ``bytes`` hashes are keyed
with a secret random per process (SipHash), so a guess's timing does not depend on how much of
it matches an accepted token. Any other value (a wrong token, other spacing or case) takes
the digest comparison above.

Several tokens may be accepted at once (a list), which is how a token is rotated: the shards
take the old and the new, the workers move to the new, the old is removed. A token file is
read again when it changes (:meth:`Guard.watch`), so a mounted secret rotates without a
restart.

It imports nothing of the store: the check reads only the request's method, path and headers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ShardError
from .headers import request_headers
from .logs import RateLimited
from .tokens import MAX_TOKEN, read_token_file

__all__ = [
    "MAX_AUTHORIZATION",
    "OPEN",
    "OPEN_PATHS",
    "OPEN_PREFIXES",
    "READ",
    "WRITE",
    "AuthMiddleware",
    "Guard",
    "access",
]

logger = logging.getLogger("paramshard.auth")

OPEN, READ, WRITE = "open", "read", "write"
#: Paths every request may reach without a token (they hold no data).
OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/"}
)
#: Prefixes of paths every request may reach without a token: the ``/docs`` page's own
#: assets (scripts and styles, no data).
OPEN_PREFIXES = ("/docs/assets/",)
#: Data-plane ``POST`` paths a read token may use.
READ_POSTS = frozenset(
    {"/v1/pull", "/v1/wait", "/v1/poll", "/v1/pull_rows", "/v1/groups", "/v1/group_pull"}
)
#: Longest ``Authorization`` header value looked at; a longer one is refused unread (401).
MAX_AUTHORIZATION = 4096
#: Refusals are logged at most once per this many seconds (the rest counted in the next line).
LOG_EVERY = 1.0
#: How often a token file is checked for changes.
WATCH_EVERY = 2.0

_AUTHORIZATION = b"authorization"


def access(method: str, path: str) -> str:
    """Which token a request needs: :data:`OPEN`, :data:`READ` or :data:`WRITE`."""
    if method in ("GET", "HEAD") and (path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)):
        return OPEN
    if method in ("GET", "HEAD") or (method == "POST" and path in READ_POSTS):
        return READ
    return WRITE


def _digests(tokens: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(t.encode("ascii")).digest() for t in tokens)


def _matches(digest: bytes, accepted: tuple[bytes, ...]) -> bool:
    found = False
    for candidate in accepted:  # every one compared: the time says nothing about which
        found |= hmac.compare_digest(digest, candidate)
    return found


class Guard:
    """The tokens a shard accepts and what was refused (event-loop thread only).

    ``mode`` is ``"off"`` (no tokens: every request answered), ``"token"`` or
    ``"token+read"``. ``refused`` counts refusals by reason (``missing``, ``malformed``,
    ``wrong``, ``forbidden``): plain ints, for metrics to read.
    """

    def __init__(
        self,
        tokens: Iterable[str] = (),
        read_tokens: Iterable[str] = (),
        token_file: str | None = None,
        shard: str = "",
    ) -> None:
        self.shard = shard
        self.token_file = token_file
        self._given = tuple(tokens)
        self._file_tokens: tuple[str, ...] = ()
        self._file_stamp: tuple[float, int] | None = None
        if token_file is not None:
            self._file_tokens = read_token_file(token_file)
            self._file_stamp = self._stamp()
        self._read_given = tuple(read_tokens)
        self._write = _digests((*self._given, *self._file_tokens))
        self._read = _digests(self._read_given)
        #: ``b"Bearer <token>" -> READ or WRITE`` for every accepted token (see the module).
        self.exact: dict[bytes, str] = {}
        self._make_exact()
        self.refused = {"missing": 0, "malformed": 0, "wrong": 0, "forbidden": 0}
        self._log = RateLimited(logger, LOG_EVERY)

    def _make_exact(self) -> None:
        exact = {b"Bearer " + t.encode("ascii"): READ for t in self._read_given}
        exact.update(
            {b"Bearer " + t.encode("ascii"): WRITE for t in (*self._given, *self._file_tokens)}
        )
        self.exact = exact

    @property
    def on(self) -> bool:
        return bool(self._write)

    @property
    def mode(self) -> str:
        if not self._write:
            return "off"
        return "token+read" if self._read else "token"

    # -- the check ------------------------------------------------------------------------

    def allows(self, headers: Mapping[bytes, bytes], need: str) -> bool:
        """Whether a request with ``headers`` may do what needs ``need``; counts nothing."""
        return need == OPEN or not self._write or self._judge(headers, need) is None

    def _judge(self, headers: Mapping[bytes, bytes], need: str) -> str | None:
        """``None`` when allowed, else the reason it is not."""
        raw = headers.get(_AUTHORIZATION)
        if raw is None:
            return "missing"
        level = self.exact.get(raw)
        if level is WRITE or (level is READ and need == READ):
            return None
        if len(raw) > MAX_AUTHORIZATION:
            return "malformed"
        scheme, _, token = raw.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token or not token.isascii():
            return "malformed"
        digest = hashlib.sha256(token).digest()
        if _matches(digest, self._write):
            return None
        if _matches(digest, self._read):
            return None if need == READ else "forbidden"
        return "wrong"

    def refusal(self, scope: Scope, need: str) -> ShardError | None:
        """The error to answer ``scope`` with, or ``None`` to let it through; a refusal is
        counted and logged."""
        reason = self._judge(request_headers(scope), need)
        if reason is None:
            return None
        self.refused[reason] += 1
        method, path = scope.get("method", ""), scope.get("path", "")
        client = scope.get("client")
        self._log.log(
            logging.WARNING,
            "auth: refused %s %s from %s: %s token",
            method,
            path[:200],
            f"{client[0]}:{client[1]}" if isinstance(client, (list, tuple)) and client else "?",
            reason,
            event="auth_refused",
            outcome=reason,
            method=method,
            path=path[:200],
        )
        what = f"{method} {path}"
        if reason == "forbidden":
            return ShardError(
                "forbidden",
                f"shard {self.shard}: the token sent is a read-only token (--read-token): it "
                f"may pull and inspect but not {what}; send the fleet's full token "
                "(--token/--token-file on the shard) for writes",
                {"reason": reason, "needs": "write"},
            )
        hint = {
            "missing": "this request needs a token: send 'Authorization: Bearer <token>' "
            "(the SDK sends token=... or PARAMSHARD_TOKEN)",
            "malformed": f"the Authorization header is not 'Bearer <token>' with a printable "
            f"ASCII token of at most {MAX_TOKEN} characters",
            "wrong": "the token sent is not one this shard accepts: check the worker's "
            "PARAMSHARD_TOKEN (or token=...) against the shard's --token/--token-file (while "
            "a token is rotated a shard accepts the old and the new)",
        }[reason]
        return ShardError(
            "unauthorized",
            f"shard {self.shard} refused {what}: {hint}",
            {"reason": reason, "needs": need},
            headers={
                "WWW-Authenticate": 'Bearer realm="paramshard"'
                + (', error="invalid_token"' if reason != "missing" else "")
            },
        )

    # -- the token file -------------------------------------------------------------------

    def _stamp(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.token_file)  # type: ignore[arg-type]
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    def reload(self) -> bool:
        """Read the token file again if it changed; ``True`` if the tokens changed. A file
        that became unreadable or invalid keeps the tokens as they were (logged)."""
        if self.token_file is None:
            return False
        stamp = self._stamp()
        if stamp == self._file_stamp:
            return False
        self._file_stamp = stamp
        try:
            tokens = read_token_file(self.token_file)
        except ValueError as exc:
            logger.error("auth: keeping the tokens in use: %s", exc)
            return False
        if tokens == self._file_tokens:
            return False
        self._file_tokens = tokens
        self._write = _digests((*self._given, *tokens))
        self._make_exact()
        logger.warning(
            "auth: the token file %s changed: %d token(s) accepted now",
            self.token_file,
            len(self._write),
            extra={"event": "auth_tokens_reloaded"},
        )
        return True

    async def watch(self, every: float = WATCH_EVERY) -> None:
        """Run :meth:`reload` every ``every`` seconds (a task of the app's lifespan)."""
        while True:
            await asyncio.sleep(every)
            self.reload()


Render = Callable[..., Any]


class AuthMiddleware:
    """Applies a :class:`Guard` to every HTTP request before it goes further (pure ASGI;
    inside :class:`~server.app.ShardMiddleware`, outside admission, so a refusal reads no
    body and takes no room). ``render`` is :func:`server.app.error_response`."""

    def __init__(self, app: ASGIApp, guard: Guard, render: Render) -> None:
        self.app = app
        self.guard = guard
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = self.guard
        if scope["type"] != "http" or not guard._write:
            await self.app(scope, receive, send)
            return
        need = access(scope.get("method", ""), scope.get("path", ""))
        refusal = None if need == OPEN else guard.refusal(scope, need)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        await self.render(
            scope, refusal.status, refusal.code, refusal.message, refusal.details, refusal.headers
        )(scope, receive, send)
