"""The shard's door to uvicorn's, FastAPI's and starlette's private API: what the shard takes
from them, the check at start that the installed versions still offer it, and the choice of how
a shard serves (:func:`serving`).

Two ways to serve, chosen once at start:

* **fast** (``--http auto``, the default, when :func:`check` finds nothing missing): uvicorn
  runs :class:`server.httptools_protocol.ShardHttpProtocol` (a subclass of uvicorn's httptools
  protocol; without httptools, :class:`server.readguard.GuardedH11Protocol`) and serves
  :func:`server.app.serving_app`: the data plane's ``POST`` requests go straight to their
  endpoints (:mod:`server.direct_routes`, which reads FastAPI's ``Dependant`` through
  :func:`request_only_posts`) and small pulls are answered by the protocol itself.
* **stock** (``--http stock`` / ``PARAMSHARD_HTTP=stock``, or when :func:`check` finds
  something missing): uvicorn runs :class:`server.readguard.GuardedH11Protocol` and serves the
  FastAPI app as it is, through its routes. Slower, the same answers. If uvicorn's h11 protocol
  lacks what :class:`~server.readguard.GuardedH11Protocol` uses, uvicorn's own h11 protocol
  runs: the head bound holds (h11 enforces it), the read deadlines do not.

No other module imports uvicorn's protocol modules or reads FastAPI's route internals; the
subclasses in :mod:`server.httptools_protocol` and :mod:`server.readguard` take their bases from
here and use only the members listed in :data:`HTTPTOOLS_NEEDS`, :data:`CYCLE_NEEDS`,
:data:`H11_NEEDS` and :data:`FLOW_NEEDS`, which :func:`check` looks for (presence, not version
strings), plus one behaviour: uvicorn's httptools request cycle hands the pending body to
``receive()`` as ``bytes(cycle.body)`` (uvicorn 0.42 and later; 0.41 handed the object on as it was,
which :class:`server.httptools_protocol.BodyPieces` cannot be). pyproject.toml bounds uvicorn,
FastAPI and starlette to the releases the suite ran on; the check is for an environment that
installed others anyway.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.h11_impl import RequestResponseCycle as H11Cycle

from .config import HTTP_MODES

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HIGH_WATER_LIMIT, HttpToolsProtocol
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttpToolsCycle
except ImportError:  # httptools is not installed: uvicorn serves with h11 only
    httptools = None
    HttpToolsProtocol = HttpToolsCycle = None  # type: ignore[assignment, misc]
    HIGH_WATER_LIMIT = 65536

__all__ = [
    "CYCLE_NEEDS",
    "FLOW_NEEDS",
    "H11_NEEDS",
    "HIGH_WATER_LIMIT",
    "HTTPTOOLS_NEEDS",
    "MODES",
    "FlowControl",
    "H11Protocol",
    "HttpToolsProtocol",
    "Serving",
    "check",
    "middleware",
    "new_parser",
    "request_only_posts",
    "route_contexts",
    "serving",
    "versions",
]

logger = logging.getLogger("paramshard.http")

#: The values of ``--http`` / ``PARAMSHARD_HTTP``.
MODES = HTTP_MODES

#: Members of uvicorn's ``HttpToolsProtocol`` that
#: :class:`server.httptools_protocol.ShardHttpProtocol` overrides, calls or reads (instance
#: attributes included).
HTTPTOOLS_NEEDS = (
    "_should_upgrade",
    "_unset_keepalive_if_required",
    "timeout_keep_alive",
    "timeout_keep_alive_task",
    "timeout_keep_alive_handler",
    "pipeline",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "shutdown",
    "data_received",
    "send_400_response",
    "connection_made",
    "connection_lost",
    "eof_received",
    "pause_writing",
    "resume_writing",
    "parser",
    "cycle",
    "flow",
    "scope",
    "headers",
    "url",
    "transport",
    "server_state",
    "app",
    "access_log",
    "expect_100_continue",
    "loop",
    "client",
)
#: Members of uvicorn's httptools ``RequestResponseCycle`` that it reads or replaces.
CYCLE_NEEDS = (
    "receive",
    "body",
    "transport",
    "response_complete",
    "disconnected",
    "message_event",
    "waiting_for_100_continue",
    "keep_alive",
)
#: Members of uvicorn's ``H11Protocol`` that :class:`server.readguard.GuardedH11Protocol` uses.
H11_NEEDS = (
    "data_received",
    "send_400_response",
    "connection_made",
    "connection_lost",
    "conn",
    "cycle",
    "flow",
    "transport",
    "server_state",
    "loop",
    "client",
)
#: Members of uvicorn's ``FlowControl`` that :class:`server.readguard.ReadGuard` uses.
FLOW_NEEDS = ("pause_reading", "resume_reading", "read_paused", "write_paused")
#: Fields of FastAPI's ``Dependant`` that :func:`request_only_posts` reads.
DEPENDANT_NEEDS = (
    "request_param_name",
    "dependencies",
    "path_params",
    "query_params",
    "header_params",
    "cookie_params",
    "body_params",
    "response_param_name",
    "background_tasks_param_name",
)


def versions() -> dict[str, str]:
    """The installed versions of the web stack (``"-"`` for one that is not installed)."""
    out = {}
    for name in ("uvicorn", "fastapi", "starlette", "httptools", "h11"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def _names_used(cls: type) -> set[str]:
    """Names ``cls`` has, or that its methods (up its MRO) assign or read as attributes."""
    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:
        for value in vars(klass).values():
            code = getattr(inspect.unwrap(value) if callable(value) else value, "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return names


def _missing(cls: type | None, needs: Iterable[str], what: str) -> list[str]:
    if cls is None:
        return []
    used = _names_used(cls)
    return [f"{what}.{name}" for name in needs if name not in used]


class _ProbeBody:
    """A pending body that is not a ``bytearray``, as
    :class:`server.httptools_protocol.BodyPieces`."""

    def __len__(self) -> int:
        return 5

    def __bytes__(self) -> bytes:
        return b"probe"


class _ProbeEvent:
    async def wait(self) -> bool:
        return True

    def clear(self) -> None:
        pass


class _ProbeFlow:
    def resume_reading(self) -> None:
        pass


def _receive_hands_bytes(cycle_cls: type) -> bool:
    """Whether the request cycle's ``receive()`` turns the pending body into ``bytes``: runs
    it on a bare instance, without an event loop (nothing in it waits)."""
    cycle = object.__new__(cycle_cls)
    cycle.__dict__.update(
        waiting_for_100_continue=False,
        disconnected=False,
        response_complete=False,
        flow=_ProbeFlow(),
        message_event=_ProbeEvent(),
        body=_ProbeBody(),
        more_body=False,
        transport=None,
    )
    coro = cycle.receive()
    try:
        coro.send(None)
    except StopIteration as done:
        message = done.value
    except Exception:
        return False
    else:
        coro.close()
        return False
    return (
        isinstance(message, dict)
        and type(message.get("body")) is bytes
        and message["body"] == b"probe"
    )


class _Mark:
    """A middleware for the probe app (never called)."""

    def __init__(self, app: Any, flag: int) -> None:
        self.app = app


async def _plain(request: Request) -> Response:
    return Response()


async def _with_query(request: Request, q: int = 0) -> Response:
    return Response()


def _fastapi_missing() -> list[str]:
    """What :mod:`server.direct_routes` needs of FastAPI and starlette, found missing on a probe
    app: route dependants with :data:`DEPENDANT_NEEDS`, middleware as ``(cls, args,
    kwargs)``, and :func:`request_only_posts` telling a request-only endpoint from others."""
    missing = []
    app = FastAPI()
    app.post("/v1/plain")(_plain)
    app.post("/v1/query")(_with_query)
    app.add_middleware(_Mark, flag=1)
    try:
        for route in route_contexts(app):
            dep = getattr(route, "dependant", None)
            if dep is not None:
                missing += [
                    f"fastapi Dependant.{name}"
                    for name in DEPENDANT_NEEDS
                    if not hasattr(dep, name)
                ]
                break
        if not missing and set(request_only_posts(app)) != {"/v1/plain"}:
            missing.append("fastapi routes: a request-only endpoint not told from others")
    except Exception as exc:
        missing.append(f"fastapi routes ({type(exc).__name__}: {exc})")
    try:
        if [(cls, kwargs) for cls, _, kwargs in middleware(app)] != [(_Mark, {"flag": 1})]:
            missing.append("starlette app.user_middleware as (cls, args, kwargs)")
    except Exception as exc:
        missing.append(f"starlette app.user_middleware ({type(exc).__name__}: {exc})")
    if not isinstance(getattr(app, "exception_handlers", None), dict):
        missing.append("starlette app.exception_handlers")
    return missing


def check() -> tuple[list[str], list[str]]:
    """What the installed versions lack: ``(for the fast path, for the guarded h11
    protocol)``; two empty lists when everything is there."""
    fast = _missing(HttpToolsProtocol, HTTPTOOLS_NEEDS, "uvicorn HttpToolsProtocol")
    fast += _missing(HttpToolsCycle, CYCLE_NEEDS, "uvicorn RequestResponseCycle")
    if (
        HttpToolsCycle is not None
        and "receive" in _names_used(HttpToolsCycle)
        and not _receive_hands_bytes(HttpToolsCycle)
    ):
        fast.append("uvicorn RequestResponseCycle.receive handing the body as bytes(body)")
    fast += _fastapi_missing()
    h11 = _missing(H11Protocol, H11_NEEDS, "uvicorn H11Protocol")
    h11 += _missing(H11Cycle, ("waiting_for_100_continue",), "uvicorn h11 RequestResponseCycle")
    h11 += _missing(FlowControl, FLOW_NEEDS, "uvicorn FlowControl")
    return fast + h11, h11


# -- FastAPI and starlette, as server.direct_routes reads them -------------------------------------

try:  # FastAPI >= 0.13x includes routers lazily; this yields each route with its effective
    # dependencies (the router's, the include's and the app's)
    from fastapi.routing import iter_route_contexts as _iter_routes
except ImportError:  # earlier FastAPI copies included routes, dependencies merged, into the app

    def _iter_routes(routes: Any) -> Any:
        return iter(routes)


def route_contexts(app: Any) -> Iterator[Any]:
    """The app's routes, each with its effective dependencies."""
    return _iter_routes(app.router.routes)


def request_only_posts(app: Any, prefix: str = "/v1/") -> dict[str, Callable[..., Any]]:
    """``path -> endpoint`` of the app's ``POST`` routes under ``prefix`` (no path parameters)
    whose endpoint is a coroutine taking the ``Request`` and nothing else: no parameters, body
    models, or dependencies (the router's and the app's included), no response or background
    tasks parameter. Calling one of these directly is what FastAPI would do."""
    out = {}
    for route in route_contexts(app):
        dep = getattr(route, "dependant", None)
        path = getattr(route, "path", None) or ""
        if dep is None or getattr(route, "methods", None) != {"POST"}:
            continue
        if not path.startswith(prefix) or "{" in path:
            continue
        if (
            dep.request_param_name is None
            or dep.dependencies
            or dep.path_params
            or dep.query_params
            or dep.header_params
            or dep.cookie_params
            or dep.body_params
            or dep.response_param_name
            or dep.background_tasks_param_name
            or not inspect.iscoroutinefunction(route.endpoint)
            or len(inspect.signature(route.endpoint).parameters) != 1
        ):
            continue
        out[path] = route.endpoint
    return out


def middleware(app: Any) -> list[tuple[type, tuple[Any, ...], dict[str, Any]]]:
    """The app's own middleware, outermost first, as ``(cls, args, kwargs)``."""
    return [(cls, tuple(args), dict(kwargs)) for cls, args, kwargs in app.user_middleware]


# -- httptools ----------------------------------------------------------------------------------


def new_parser(protocol: Any) -> Any:
    """A fresh httptools request parser for ``protocol``, set up as uvicorn sets up its own."""
    parser = httptools.HttpRequestParser(protocol)
    try:
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    except AttributeError:  # httptools < 0.6.3
        pass
    return parser


# -- the choice ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Serving:
    """How a shard serves: the ASGI app and uvicorn ``http`` protocol class to give
    ``uvicorn.Config``, and which way (``"fast"`` or ``"stock"``)."""

    app: Any
    protocol: type[asyncio.Protocol] | str
    mode: str


def serving(app: Any, limits: Any = None, mode: str = "auto") -> Serving:
    """How to serve ``app`` (made by :func:`server.app.create_app`) with the read bounds
    ``limits`` (:class:`server.readguard.EdgeLimits`; give uvicorn
    ``h11_max_incomplete_event_size=limits.max_head_bytes`` too, for h11).

    Where a ``POST /v1/pull`` goes, fast: answered inside the protocol's parser callbacks when
    small and in the table layout (:func:`server.immediate.immediate_routes`, which calls
    :func:`server.immediate.pull_now`; a small ``/v1/pull_rows`` likewise,
    :func:`server.immediate.pull_rows_now`); else handed by
    :class:`server.direct_routes.DirectRoutes` through the app's middleware to the endpoint
    (:func:`server.routes_data.pull`); stock: through FastAPI's router to that same endpoint.
    Every way ends in ``routes_data``'s (or ``routes_tables``') code.

    ``mode`` ``"stock"`` serves the stock way whatever is installed; ``"auto"`` serves fast
    when :func:`check` finds nothing missing, else logs one warning naming the versions and
    serves the stock way.
    """
    from .readguard import DEFAULT_LIMITS, GuardedH11Protocol

    limits = DEFAULT_LIMITS if limits is None else limits
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    fast_missing, h11_missing = check()
    if mode == "auto" and not fast_missing:
        from .app import serving_app
        from .httptools_protocol import protocol_class

        return Serving(serving_app(app), protocol_class(limits), "fast")
    stock: type[asyncio.Protocol] | str = GuardedH11Protocol
    if h11_missing:
        stock = "h11"
    elif limits != DEFAULT_LIMITS:
        stock = type(GuardedH11Protocol.__name__, (GuardedH11Protocol,), {"limits": limits})
    installed = ", ".join(f"{k} {v}" for k, v in versions().items())
    if mode == "auto" or h11_missing:
        lacking = fast_missing if mode == "auto" else h11_missing
        logger.warning(
            "the installed web stack (%s) lacks what the shard's fast HTTP path uses (%s); "
            "serving through uvicorn's h11 protocol and the FastAPI routes instead: the same "
            "answers, slower%s. Install the versions pyproject.toml allows (pip install "
            "'paramshard[server]') to serve fast.",
            installed,
            "; ".join(lacking),
            ", and without the head and body read deadlines" if h11_missing else "",
        )
    else:
        logger.info(
            "serving the stock way (--http stock): uvicorn's h11 protocol and the "
            "FastAPI routes (%s)",
            installed,
        )
    return Serving(app, stock, "stock")
