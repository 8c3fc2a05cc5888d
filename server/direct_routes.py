"""The data plane's short way through the app: ``POST /v1/<verb>`` straight to its endpoint.

FastAPI stays the app: every route is registered with it (and shows in ``/docs``), and anything
this module does not take goes the usual way. But for a small request FastAPI's per-request
machinery (routing by regex over every route, dependency solving, the exception and exit-stack
layers, and the app-wide middleware in front of them) costs several times what the verb
itself does.
:class:`DirectRoutes` is what uvicorn serves (:func:`server.app.serving_app`): it hands
``POST`` requests for a qualifying path through the app's own middleware (on a shard,
:class:`~server.app.ShardMiddleware`, which adds the shard headers, checks
``x-paramshard-fleet`` and turns escaping exceptions into a 500, and the admission control) to
the endpoint directly, and everything else to the FastAPI app.

A route qualifies (:func:`direct_routes`) only when calling its endpoint directly is exactly
what FastAPI would do: a coroutine that takes the ``Request`` and nothing else (no parameters,
body models or dependencies, including router- or app-wide ones) and returns a ``Response``.
Exceptions are rendered by the app's own exception handlers, looked up by the exception's
class hierarchy as Starlette's ``ExceptionMiddleware`` does; one without a handler propagates.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .upstream import middleware, request_only_posts

__all__ = ["DirectRoutes", "direct_routes"]

Endpoint = Callable[[Request], Awaitable[Response]]


def direct_routes(app: FastAPI, prefix: str = "/v1/") -> dict[str, Endpoint]:
    """``path -> endpoint`` of the app's ``POST`` routes under ``prefix`` that qualify
    (:func:`server.upstream.request_only_posts`, which reads FastAPI's route internals)."""
    return request_only_posts(app, prefix)


class DirectRoutes:
    """The ASGI app a shard serves: ``POST`` to a qualifying path goes through the app's own
    middleware (``app.user_middleware``: on a shard, :class:`~server.app.ShardMiddleware` and
    :class:`~server.admission.AdmissionMiddleware`) straight to its endpoint; every other
    request goes to ``app``, the FastAPI app, as usual.

    The middleware are instantiated a second time for the direct path, from the arguments the
    app was given: they must keep their state in those arguments (as the shard's do: the gate,
    the app's state), not in the instance. Exceptions are rendered by the app's handlers
    (``app.exception_handlers``, read at each failure, so handlers added later count).
    """

    def __init__(self, app: FastAPI, routes: Mapping[str, Endpoint] | None = None) -> None:
        self.app = app
        self.routes = dict(direct_routes(app) if routes is None else routes)
        self.handlers = app.exception_handlers
        direct: ASGIApp = self._call_endpoint
        for cls, args, kwargs in reversed(middleware(app)):  # as Starlette stacks them
            direct = cls(direct, *args, **kwargs)
        self.direct = direct
        #: Requests the shard's HTTP protocol may answer itself
        #: (:data:`server.httptools_protocol.IMMEDIATE`); set by :func:`server.app.serving_app`.
        self.immediate: dict[bytes, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope.get("path") in self.routes
        ):
            scope["app"] = self.app  # as Starlette sets it: endpoints reach app.state through it
            await self.direct(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _call_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.routes[scope["path"]](request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[..., Any] | None:
        for cls in type(exc).__mro__:
            if cls in self.handlers and cls is not Exception:
                return self.handlers[cls]
        return None
