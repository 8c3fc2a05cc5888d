"""A request's headers as a dict, made once per request and shared by everything that reads it.

The shard's middleware (fleet check, admission) and its data-plane handlers each need a header
or two of every request. Scanning the ASGI header list in Python for each, or building
Starlette's ``Headers`` for it, was a measurable part of a small request's cost; one ``dict``
built in C and kept in the scope is not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["header", "request_headers"]

#: Where the dict is kept in the ASGI scope.
_KEY = "paramshard.headers"


def request_headers(scope: Any) -> dict[bytes, bytes]:
    """``{name: value}`` of ``scope``'s headers (names lower-case, as ASGI gives them); of a
    repeated header, its first value, as Starlette's ``Headers.get`` gives it. Made at the
    first call for a request: the shard changes no request's headers after that."""
    found = scope.get(_KEY)
    if found is None:
        headers = scope.get("headers") or ()
        if not isinstance(headers, (list, tuple)):  # ASGI allows any iterable of pairs
            headers = list(headers)
        found = scope[_KEY] = dict(reversed(headers))
    return found


def header(scope: Any, name: bytes, default: Any = None) -> Any:
    """A request header's (first) value as ``str`` (latin-1), or ``default``."""
    value = request_headers(scope).get(name)
    return default if value is None else value.decode("latin-1")
