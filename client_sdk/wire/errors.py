"""Errors on the wire: the protocol's machine codes and their HTTP statuses
(:data:`ERROR_STATUS`), the body of every error response (:func:`error_payload`), and
:class:`WireError`, what decoding raises for anything that does not follow the protocol.

A code is added here and in docs/PROTOCOL.md (§2 Errors), and mapped in the SDK's exception
tree (``client_sdk/_exceptions.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ERROR_STATUS", "WireError", "error_payload"]

#: The machine code of an error payload and the HTTP status it travels with.
ERROR_STATUS = {
    "bad_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "unknown_group": 404,
    "conflict": 409,
    "frozen": 409,
    "partitioned": 409,
    "seq_expired": 409,
    "no_data_dir": 409,
    "stale_epoch": 409,
    "group_stale": 409,
    "too_large": 413,
    "unsupported_media_type": 415,
    "not_owner": 421,
    "fleet_mismatch": 421,
    "not_primary": 421,
    "bad_tensor": 422,
    "overloaded": 429,
    "internal": 500,
    "unavailable": 503,
}


class WireError(ValueError):
    """A message or tensor that does not follow the protocol.

    ``code`` is one of :data:`ERROR_STATUS`' keys (``bad_request`` or ``bad_tensor``), so a
    server can answer with it directly.
    """

    def __init__(self, message: str, code: str = "bad_request", details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.details = details if details is not None else {}


def error_payload(
    code: str, message: str, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The body of every error response: ``{"error": {"code", "message", "details"}}``."""
    return {"error": {"code": code, "message": message, "details": dict(details or {})}}
