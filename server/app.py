"""``create_app(config)``: one shard as an ASGI application (FastAPI).

The app holds one :class:`~server.store.ParameterStore` and serves the msgpack data plane
(``server/routes_data.py``, ``server/routes_control.py``, ``server/routes_tables.py``), the
fleet-checkpoint verbs (``server/routes_checkpoint.py``) and the JSON inspection endpoints
(``server/routes_inspect.py``). Its lifespan (:mod:`server.lifespan`) runs
:class:`~server.durability.Durability` (restore, periodic and final snapshots) and the task
that closes the sync rounds that time out (:func:`server.store.rounds.close_when_due`), and
:class:`~server.admission.AdmissionMiddleware` decides what gets in (restore, drain, pauses,
bounded work), after :class:`~server.auth.AuthMiddleware` has checked the request's token (when
the shard has tokens: ``app.state.auth``, a :class:`~server.auth.Guard`).

Errors are rendered in one place, :func:`error_response`: ``{"error": {"code", "message",
"details"}}`` as msgpack for data-plane requests (``POST /v1/...``, and any method on a
data-plane verb's path) unless they ask for JSON (a JSON body, or ``Accept`` naming JSON
only), and as JSON for everything else. Handlers map
:class:`~server.errors.ShardError`, ``wire.WireError``, FastAPI's validation errors and unknown
routes/methods to it; :class:`ShardMiddleware` adds the shard headers to every
response, refuses requests meant for another shard (``x-paramshard-fleet``), and turns any
exception that escapes a handler (a bug, never bad input) into a logged 500 ``internal``.
:func:`serving_app` is what a shard serves: the app, except that data-plane ``POST`` requests go
through the app's middleware (:class:`ShardMiddleware`, admission) straight to their endpoints
(:mod:`server.direct_routes`), past FastAPI's per-request routing (the routes stay registered, and
in ``/docs``), and a small pull in the table layout, pull_rows, push, increment or push_rows
is answered by the shard's HTTP protocol itself when nothing stands in its way
(:mod:`server.immediate`).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

import msgpack
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from client_sdk import wire

from . import __version__
from .admission import WRITES, AdmissionMiddleware, Gate
from .auth import AuthMiddleware, Guard
from .config import ShardConfig
from .direct_routes import DirectRoutes
from .durability import Durability
from .embedding import EmbeddingTables
from .errors import ShardError
from .headers import header, request_headers
from .lifespan import lifespan
from .logs import RateLimited
from .metrics import Traffic
from .narrowed import NarrowedCache
from .replication import Role
from .replication.reads import ALLOW_BACKUP, PRIMARYS, READS, position_headers, read_refusal
from .replication.replica import Replication
from .store import DedupTable, ParameterStore
from .store.heap import trim_heap

__all__ = [
    "ShardMiddleware",
    "create_app",
    "error_response",
    "serving_app",
]

logger = logging.getLogger("paramshard.server")
#: Refused requests, in the log at most once a second (a client can cause them at will);
#: auth refusals are logged by server/auth.py, 500s with their traceback.
_refusals = RateLimited(logging.getLogger("paramshard.refused"), 1.0)
_LOGGED_ELSEWHERE = frozenset({"unauthorized", "forbidden", "internal"})

#: Request header a client may send to say which shard it means: ``"<index>/<num_shards>"``.
_FLEET_KEY = wire.HEADER_FLEET.encode()
_STATE_VERSION = wire.HEADER_STATE_VERSION.encode()
_DELETIONS = wire.HEADER_DELETIONS.encode()
#: ``<index>/<num_shards>``: ASCII digits, at most 9 each (a fleet has at most 65,536 shards),
#: so that no header value turns into an unbounded ``int``.
_FLEET_RE = re.compile(r"\s*([0-9]{1,9})\s*/\s*([0-9]{1,9})\s*")


#: The data plane's verbs (docs/PROTOCOL.md §3), each ``POST /v1/<verb>``.
DATA_PLANE_VERBS = (
    "init",
    "pull",
    "push",
    "assign",
    "increment",
    "wait",
    "poll",
    "set_optimizer",
    "delete",
    "create_table",
    "pull_rows",
    "push_rows",
    "groups",
    "group_pull",
    "group_push",
    "pause",
    "snapshot",
    "resume",
)
_DATA_PLANE_PATHS = frozenset(f"/v1/{verb}" for verb in DATA_PLANE_VERBS)


_ACCEPT = b"accept"
_JSON = wire.JSON.encode()
_CONTENT_TYPE = b"content-type"


def wants_json(scope: Scope) -> bool:
    """Whether a request asks for JSON: a JSON body (``Content-Type: application/json``, as
    curl sends with ``--json``), or an ``Accept`` naming JSON and no msgpack nor frame."""
    headers = request_headers(scope)
    ctype = headers.get(_CONTENT_TYPE, b"")[:64].split(b";", 1)[0].strip().lower()
    if ctype == _JSON:
        return True
    accept = headers.get(_ACCEPT, b"")[:512].lower()
    return b"json" in accept and b"msgpack" not in accept and b"paramshard" not in accept


def is_data_plane(scope: Scope) -> bool:
    """Data-plane requests get msgpack errors, the rest JSON: any ``POST /v1/...``, and any
    request to a data-plane verb's path whatever its method (a ``GET /v1/push`` is 405 in the
    family a client of that path decodes)."""
    path = scope.get("path", "")
    return path in _DATA_PLANE_PATHS or (scope.get("method") == "POST" and path.startswith("/v1/"))


def error_response(
    scope: Scope,
    status: int,
    code: str,
    message: str,
    details: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The one renderer of error bodies, in the request's format: msgpack on the data plane
    unless the request asks for JSON (:func:`wants_json`), JSON elsewhere; the same code,
    message and details either way."""
    if status != 500 and code not in _LOGGED_ELSEWHERE:
        variable = details.get("variable") if details else None
        _refusals.log(
            logging.INFO,
            "refused %s %s: %d %s: %s",
            scope.get("method"),
            scope.get("path", "")[:200],
            status,
            code,
            message[:300],
            event="refused",
            outcome=code,
            status=status,
            code=code,
            method=scope.get("method"),
            path=scope.get("path", "")[:200],
            variable=variable if isinstance(variable, str) else None,
        )
    payload = wire.error_payload(code, message, details)
    if is_data_plane(scope) and not wants_json(scope):
        body = msgpack.packb(payload, use_bin_type=True, default=_jsonable)
        media_type = wire.MSGPACK
    else:
        body = json.dumps(payload, default=_jsonable).encode()
        media_type = wire.JSON
    return Response(body, status_code=status, media_type=media_type, headers=dict(headers or {}))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return f"<{len(obj)} bytes>"
    return repr(obj)


def _declared_length(scope: Scope) -> int:
    """The request's ``Content-Length`` (0 when absent or not a plain number)."""
    value = request_headers(scope).get(b"content-length")
    if value is None or len(value) > 18 or not value.isdigit():
        return 0
    return int(value)


def _parse_fleet(text: str) -> tuple[int, int] | None:
    m = _FLEET_RE.fullmatch(text)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


class ShardMiddleware:
    """Pure ASGI middleware around the whole app (inside Starlette's own error middleware).

    * adds ``x-paramshard-shard``, ``x-paramshard-incarnation``, ``x-paramshard-protocol`` to
      every response, and ``x-paramshard-state-version`` once the shard's state is restored,
      with ``x-paramshard-deletions`` once a delete removed something: the count as the request
      came in, so never newer than the values a reply holds (a client keys cached values by
      it: an older count costs it a pull again, a newer one could make it reuse a value of a
      deleted variable);
    * answers 421 ``fleet_mismatch`` (400 if malformed) when ``x-paramshard-fleet`` names
      another shard or fleet size;
    * logs any exception that escapes the app and answers 500 ``internal`` if no response has
      started yet;
    * on a replica of a group, holds a write's successful answer until the backups have the
      write (:meth:`Replication.synced <server.replication.replica.Replication.synced>`), and
      answers 421 ``not_primary`` instead if this replica stops being primary meanwhile.
    """

    def __init__(
        self, app: ASGIApp, config: ShardConfig, incarnation: str, state: Any = None
    ) -> None:
        self.app = app
        self.config = config
        self.state = state
        self.headers = [
            (wire.HEADER_SHARD.encode(), config.fleet.encode()),
            (wire.HEADER_INCARNATION.encode(), incarnation.encode()),
            (wire.HEADER_PROTOCOL.encode(), str(wire.PROTOCOL_VERSION).encode()),
        ]
        self._fleet = config.fleet.encode()
        #: Where each request is counted (:mod:`server.metrics.traffic`), if anywhere.
        self.traffic: Traffic | None = getattr(state, "traffic", None)
        #: The shard's replication, if it is a replica of a group: a write's answer waits
        #: until its backups have the write (:meth:`Replication.synced`).
        self.replication: Replication | None = getattr(state, "replication", None)
        #: The shard's admission gate and store, read by every reply (none in a bare app).
        self._gate: Gate | None = getattr(state, "gate", None)
        self._store: ParameterStore | None = getattr(state, "store", None)
        #: The last headers :meth:`reply_headers` made for a shard without replicas, with the
        #: state version and deletions count they carry.
        self._last: tuple[int, int, list[tuple[bytes, bytes]]] = (-1, -1, [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = swallowed = False
        status = sent = 0
        since = time.perf_counter()
        deletions = self._deletions()
        replication = self.replication
        path = scope.get("path", "")
        data = scope.get("method") == "POST" and path.startswith("/v1/")
        waits = replication is not None and data and path[4:] in WRITES
        position = None if replication is None else position_headers(replication)

        async def emit(message: Message) -> None:
            nonlocal started, status, sent
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", ()),
                    *self.reply_headers(deletions, position),
                ]
            else:
                sent += len(message.get("body", b""))
            await send(message)

        async def send_with_headers(message: Message) -> None:
            nonlocal swallowed
            if swallowed:
                return
            if waits and message["type"] == "http.response.start" and message["status"] < 300:
                try:  # a write is answered once the backups have it (server/replication)
                    await replication.synced()  # type: ignore[union-attr]
                except ShardError as exc:
                    swallowed = True  # the answer becomes this refusal; the app's is dropped
                    refusal = error_response(
                        scope, exc.status, exc.code, exc.message, exc.details, exc.headers
                    )
                    await refusal(scope, receive, emit)
                    return
            await emit(message)

        try:
            refusal = self._check_fleet(scope)
            if refusal is None and replication is not None and data and path[4:] in PRIMARYS:
                allow = header(scope, ALLOW_BACKUP) if path[4:] in READS else None
                exc = read_refusal(replication, self.state, allow)
                if exc is not None:
                    refusal = error_response(
                        scope, exc.status, exc.code, exc.message, exc.details, exc.headers
                    )
            if refusal is not None:
                await refusal(scope, receive, send_with_headers)
                return
            await self.app(scope, receive, send_with_headers)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # the server closes the connection; the client sees a broken response
            response = error_response(
                scope,
                500,
                "internal",
                "the shard hit an internal error (a bug: please report it with the shard's log); "
                "nothing was changed unless the response says otherwise",
            )
            await response(scope, receive, send_with_headers)
        finally:
            if self.traffic is not None:
                self.traffic.record(
                    scope["path"],
                    status,
                    time.perf_counter() - since,
                    _declared_length(scope),
                    sent,
                )

    def reply_headers(
        self, deletions: int | None = None, position: list[tuple[bytes, bytes]] | None = None
    ) -> list[tuple[bytes, bytes]]:
        """The headers this adds to a response sent now, to a request that came in when the
        store's deletions count was ``deletions`` and, on a replica of a group, when the
        replica was at ``position`` (:func:`~server.replication.reads.position_headers`;
        ``None``: now, for a reply made
        without waiting, whose values are read in the same step). The list may be the one
        given last time (same version and count, no replicas): callers do not change it."""
        gate, store = self._gate, self._store
        if gate is None or store is None or gate.phase not in ("ready", "draining"):
            return self.headers
        version = store.state_version
        if deletions is None:
            deletions = store.deletions
        replication = self.replication
        if replication is None:
            last = self._last
            if last[0] == version and last[1] == deletions:
                return last[2]
        headers = [*self.headers, (_STATE_VERSION, str(version).encode())]
        if deletions:
            headers.append((_DELETIONS, str(deletions).encode()))
        if replication is not None:
            headers += position_headers(replication) if position is None else position
        else:
            self._last = (version, deletions, headers)
        return headers

    def _deletions(self) -> int:
        """The store's deletions count now (0 before there is a store)."""
        store = getattr(self.state, "store", None)
        return 0 if store is None else store.deletions

    def meant_for_me(self, fleet: bytes | None) -> bool:
        """Whether a request whose ``x-paramshard-fleet`` is ``fleet`` (raw, ``None`` when
        absent) passes the fleet check as it stands, without parsing it (``False`` may still
        pass: :meth:`_check_fleet` decides)."""
        return fleet is None or fleet == self._fleet

    def _check_fleet(self, scope: Scope) -> Response | None:
        raw = header(scope, _FLEET_KEY)
        if raw is None:
            return None
        parsed = _parse_fleet(raw)
        if parsed is None:
            return error_response(
                scope,
                400,
                "bad_request",
                f"{wire.HEADER_FLEET} must be '<index>/<num_shards>' (decimal, at "
                f"most 9 digits each), e.g. '0/2'; got {raw[:40]!r} "
                f"({len(raw)} characters)",
            )
        index, num = parsed
        if (index, num) != (self.config.shard_index, self.config.num_shards):
            return error_response(
                scope,
                421,
                "fleet_mismatch",
                f"this is shard {self.config.fleet}, but the request was meant for shard "
                f"{index}/{num}: the client's shard list has another order or length than the "
                "fleet; fix PARAMSHARD_SHARDS (or the URL list) to match",
                {
                    "expected": f"{index}/{num}",
                    "actual": self.config.fleet,
                    "shard_index": self.config.shard_index,
                    "num_shards": self.config.num_shards,
                },
            )
        return None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ShardError)
    async def shard_error(request: Request, exc: ShardError) -> Response:
        return error_response(
            request.scope, exc.status, exc.code, exc.message, exc.details, exc.headers
        )

    @app.exception_handler(wire.WireError)
    async def wire_error(request: Request, exc: wire.WireError) -> Response:
        code = exc.code if exc.code in wire.ERROR_STATUS else "bad_request"
        return error_response(
            request.scope,
            wire.ERROR_STATUS[code],
            code,
            exc.message,
            exc.details if isinstance(exc.details, Mapping) else {},
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            problems.append({"field": where, "problem": str(err.get("msg", ""))})
        summary = "; ".join(f"{p['field']}: {p['problem']}" for p in problems[:5])
        return error_response(
            request.scope,
            400,
            "bad_request",
            f"invalid request parameters ({summary}): see /docs",
            {"errors": problems},
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            verbs = ", ".join(DATA_PLANE_VERBS)
            hint = (
                f"the data-plane verbs are POST /v1/{{{verbs}}}"
                if is_data_plane(request.scope)
                else "see /docs for the endpoints"
            )
            return error_response(
                request.scope,
                404,
                "not_found",
                f"no endpoint {method} {path}: {hint}",
                {"path": path},
            )
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            return error_response(
                request.scope,
                405,
                "method_not_allowed",
                f"{method} is not allowed on {path}; use {allowed or 'another method'}",
                {"allow": allowed},
                exc.headers,
            )
        code = {400: "bad_request", 413: "too_large", 415: "unsupported_media_type"}.get(
            exc.status_code, "bad_request"
        )
        return error_response(
            request.scope, exc.status_code, code, str(exc.detail), {}, exc.headers
        )


def create_app(config: ShardConfig) -> FastAPI:
    """Build the ASGI app of one shard. Cheap and synchronous; the store starts empty and is
    restored (with ``--data-dir``) when the app's lifespan starts.

    ``app.state`` carries ``config``, ``store``, ``gate`` (admission), ``durability``
    (snapshots), ``role`` (this replica's :class:`~server.replication.Role`), ``incarnation``
    (random hex, new per call, so new per process start),
    ``started_at`` (Unix seconds) and ``shutdown_error`` (set if the final snapshot failed).
    """
    from .metrics.export import router as metrics_router
    from .pages import router as pages_router
    from .routes_checkpoint import router as checkpoint_router
    from .routes_control import router as control_router
    from .routes_data import router as data_router
    from .routes_groups import router as groups_router
    from .routes_inspect import router as inspect_router
    from .routes_replication import router as replication_router
    from .routes_tables import router as tables_router

    incarnation = secrets.token_hex(8)
    app = FastAPI(
        title=f"paramshard shard {config.fleet}",
        version=__version__,
        description=(
            "One shard of a paramshard fleet. The data plane (`POST /v1/<verb>`) speaks msgpack "
            "or the framed encoding of docs/PROTOCOL.md; the `GET` endpoints are JSON for people."
        ),
        lifespan=lifespan,
        # /docs is served from the shard's own copy of swagger-ui (server/pages); no page
        # loads anything from elsewhere.
        docs_url=None,
        redoc_url=None,
    )
    store = ParameterStore(
        config.shard_index,
        config.num_shards,
        DedupTable(config.dedup_max_workers, config.dedup_idle_seconds),
    )
    gate = Gate(config.max_queued_bytes, config.max_queued_requests)
    gate.trim = trim_heap
    gate.on_drain.append(store.waiters.close)  # waiting polls answer when shutting down
    app.state.config = config
    app.state.store = store
    app.state.tables = EmbeddingTables(
        store, config.max_table_ids, config.max_table_rows, config.max_pending_ids
    )
    app.state.narrowed = NarrowedCache(config.half_cache_bytes)
    app.state.gate = gate
    app.state.durability = Durability(config, store, gate, incarnation)
    app.state.durability.tables = app.state.tables
    app.state.incarnation = incarnation
    app.state.started_at = time.time()
    app.state.shutdown_error = None
    app.state.auth = Guard(config.token, config.read_token, config.token_file, config.fleet)
    app.state.traffic = Traffic()
    app.state.role = role = (
        Role(config.advertise_url, replicated=True)  # the campaign decides (leadership.py)
        if config.etcd
        else Role.from_config(config.replica_group, config.advertise_url)
    )
    app.state.replication = (
        Replication(config, role, store, app.state.tables, gate, incarnation)
        if role.replicated
        else None
    )
    app.state.durability.replication = app.state.replication
    _install_error_handlers(app)
    app.include_router(data_router)
    app.include_router(control_router)
    app.include_router(groups_router)
    app.include_router(checkpoint_router)
    app.include_router(inspect_router)
    app.include_router(tables_router)
    app.include_router(replication_router)
    app.include_router(metrics_router)
    app.include_router(pages_router)
    app.add_middleware(
        AdmissionMiddleware, gate=gate, render=error_response, max_body=config.max_request_bytes
    )
    app.add_middleware(AuthMiddleware, guard=app.state.auth, render=error_response)
    app.add_middleware(ShardMiddleware, config=config, incarnation=incarnation, state=app.state)
    return app


def serving_app(app: FastAPI) -> ASGIApp:
    """The ASGI app to serve for ``app`` (made by :func:`create_app`): the same responses, with
    the data plane's ``POST`` requests handed straight to their endpoints
    (:mod:`server.direct_routes`), and the small pulls and writes that can be answered at once
    answered by the shard's HTTP protocol itself (:func:`server.immediate.immediate_routes`)."""
    from .immediate import immediate_routes

    served = DirectRoutes(app)
    served.immediate = immediate_routes(app)
    return served
