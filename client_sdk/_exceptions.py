"""Every error the SDK raises, as one tree under :class:`PSError`.

    PSError
    ├── ConfigError              bad arguments or PARAMSHARD_* settings on the worker side
    ├── ShardUnavailableError    could not reach a shard (connect/read errors, timeouts, 503)
    │   ├── OverloadedError      the shard kept answering 429/503 past the deadline
    │   └── NotPrimaryError      the replica asked is not its index's primary (421
    │                            not_primary); ``primary`` is the primary's URL if known
    ├── FleetMismatchError       the shard list disagrees with the fleet (index, size, 421)
    ├── ProtocolError            a reply the SDK cannot understand, one bigger than the call can
    │                            need (``max_reply_bytes``), or another protocol version
    ├── RequestRejectedError     the shard refused the request (4xx); nothing was changed
    │   ├── BadRequestError        400, 413, 415: a malformed request
    │   ├── AuthError              401, 403
    │   ├── UnknownVariableError   404
    │   ├── ConflictError          409: init with another shape/dtype/kind or optimizer
    │   │   ├── FrozenError          409: a push to a frozen variable (set_optimizer)
    │   │   ├── PartitionedError     409: a partitioned variable addressed as a plain one
    │   │   └── StaleGroupError      409: a step group's variable was deleted or made again
    │   └── BadTensorError         422: wrong shape/dtype, non-finite values
    ├── ServerError              a 5xx other than 503 (a bug in the shard: please report it)
    ├── NotReadyError            wait_ready timed out; ``missing`` names what never appeared
    └── PushError                one or more async pushes failed; ``errors`` holds each cause

httpx and msgpack errors are translated where they enter the SDK (``raise ... from exc``), so
worker code catches ``PSError`` (or a subclass) and nothing else.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthError",
    "BadRequestError",
    "BadTensorError",
    "ConfigError",
    "ConflictError",
    "FleetMismatchError",
    "FrozenError",
    "NotPrimaryError",
    "NotReadyError",
    "OverloadedError",
    "PSError",
    "PartitionedError",
    "ProtocolError",
    "PushError",
    "RequestRejectedError",
    "ServerError",
    "ShardUnavailableError",
    "StaleGroupError",
    "UnknownVariableError",
]


class PSError(Exception):
    """Root of every paramshard SDK error.

    ``shard`` is the URL of the shard involved (if one), ``status`` the HTTP status (if any),
    ``code`` the protocol's machine code and ``details`` its structured details.
    """

    def __init__(
        self,
        message: str,
        *,
        shard: str | None = None,
        status: int | None = None,
        code: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.shard = shard
        self.status = status
        self.code = code
        self.details = details or {}


class ConfigError(PSError):
    pass


class ShardUnavailableError(PSError):
    pass


class OverloadedError(ShardUnavailableError):
    pass


class FleetMismatchError(PSError):
    pass


class ProtocolError(PSError):
    pass


class RequestRejectedError(PSError):
    pass


class BadRequestError(RequestRejectedError):
    pass


class AuthError(RequestRejectedError):
    pass


class UnknownVariableError(RequestRejectedError):
    pass


class ConflictError(RequestRejectedError):
    pass


class FrozenError(ConflictError):
    """A push named a frozen variable (``details["frozen"]`` lists which); nothing of it was
    applied. Leave them out of the push, or unfreeze them: ``ps.set_optimizer(names,
    frozen=False)``."""


class StaleGroupError(ConflictError):
    """A step group (``ps.group(names)``) no longer holds: one of its variables was deleted, or
    deleted and made again, since the group was made (409 ``group_stale``, ``details
    ["variables"]`` lists which when the shard knows). Nothing of the call was applied on that
    shard. Make the group again once the variables exist: ``g = ps.group(names)``."""


class PartitionedError(ConflictError):
    """A request named a partitioned variable as if it were a plain one (``details["layouts"]``
    maps each such name to its layout); nothing of it was applied. The SDK learns the layout
    from it and addresses the parts; a raw client sends to ``name/part-i`` instead."""


class BadTensorError(RequestRejectedError):
    pass


class ServerError(PSError):
    pass


class NotReadyError(PSError):
    def __init__(self, message: str, *, missing: list[str], **kw: Any) -> None:
        super().__init__(message, **kw)
        self.missing = missing


class PushError(PSError):
    """One or more asynchronous pushes failed; ``errors`` lists each underlying ``PSError``."""

    def __init__(self, message: str, *, errors: list[PSError], **kw: Any) -> None:
        super().__init__(message, **kw)
        self.errors = errors


class NotPrimaryError(ShardUnavailableError):
    """The replica asked is not its shard index's primary (421 ``not_primary``): ``primary``
    is the primary's URL when the replica knows it, else ``None``; nothing was applied."""

    @property
    def primary(self) -> str | None:
        url = self.details.get("primary") if isinstance(self.details, dict) else None
        return url if isinstance(url, str) else None


#: HTTP status of a rejection -> the class raised for it.
STATUS_ERRORS: dict[int, type[PSError]] = {
    400: BadRequestError,
    401: AuthError,
    403: AuthError,
    404: UnknownVariableError,
    409: ConflictError,
    413: BadRequestError,
    415: BadRequestError,
    421: FleetMismatchError,
    422: BadTensorError,
    429: OverloadedError,
    503: ShardUnavailableError,
}


#: The protocol's code of a rejection -> the class raised for it, where its status's class is
#: not specific enough.
CODE_ERRORS: dict[str, type[PSError]] = {
    "frozen": FrozenError,
    "partitioned": PartitionedError,
    "group_stale": StaleGroupError,
    "not_primary": NotPrimaryError,
}


def error_for_status(status: int, code: str | None = None) -> type[PSError]:
    if code in CODE_ERRORS:
        return CODE_ERRORS[code]
    if status in STATUS_ERRORS:
        return STATUS_ERRORS[status]
    if 400 <= status < 500:
        return RequestRejectedError
    return ServerError
