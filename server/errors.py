"""The one exception a shard raises for a request it refuses, and how it maps to the protocol.

A :class:`ShardError` is a protocol error code (``docs/PROTOCOL.md`` §2, the keys of
``client_sdk.wire.ERROR_STATUS``), a message that says what to do, and structured details. The
store raises it without knowing about HTTP; ``server/app.py`` renders it, in one place, as
msgpack for the data plane and JSON for the inspection endpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from client_sdk.wire import ERROR_STATUS

__all__ = ["ShardError"]


class ShardError(Exception):
    """A refused request: ``code`` (e.g. ``"bad_tensor"``), ``message`` and ``details``.

    ``status`` is the HTTP status the protocol assigns to ``code``.
    """

    def __init__(
        self,
        code: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if code not in ERROR_STATUS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def __repr__(self) -> str:
        return f"ShardError({self.code!r}, {self.message!r})"
