"""Changing and removing variables over HTTP: the data plane's ``POST /v1/set_optimizer`` and
``POST /v1/delete`` (msgpack bodies, docs/PROTOCOL.md §3).

Both name their variables by ``names`` or by ``prefix``, carry ``worker_id`` and ``seq`` (each
is applied once, as every write), and refuse any field they do not know: a change asked for
under a misspelt field must not pass as done. Each waits for a push of its variables that is
being applied off the loop to finish before it changes them (the store's ``set_optimizer`` and
``delete`` do that), and answers in the request's encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from .errors import ShardError
from .routes_data import BODY_DOC, bad_field, message, name_list, reply, store_of, writer

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["data plane (msgpack)"])

#: The fields of ``set_optimizer`` and ``delete``; they refuse any other (docs/PROTOCOL.md §3):
#: a change asked for under a misspelt field must not pass as done.
_SET_OPTIMIZER_FIELDS = frozenset({"names", "prefix", "optimizer", "frozen", "worker_id", "seq"})
_DELETE_FIELDS = frozenset({"names", "prefix", "worker_id", "seq"})


def _only(msg: Mapping[str, Any], fields: frozenset[str], verb: str) -> None:
    for key in msg:
        if key not in fields:
            shown = key if isinstance(key, str) else repr(key)
            raise ShardError(
                "bad_request",
                f"{verb}: unknown field {shown!r}; it takes {', '.join(sorted(fields))} "
                "(docs/PROTOCOL.md)",
                {"field": shown},
            )


def _target(msg: Mapping[str, Any], verb: str) -> tuple[list[str] | None, str | None]:
    """``(names, None)`` or ``(None, prefix)``: which variables a request means, its types
    checked (the store checks the names and the prefix themselves). A nil field is absent."""
    names, prefix = msg.get("names"), msg.get("prefix")
    if prefix is None:
        if names is None:
            raise ShardError(
                "bad_request",
                f"{verb}: missing field 'names' (a list of variable names) or 'prefix' (the start "
                "of the names to match) (docs/PROTOCOL.md)",
                {"field": "names"},
            )
        return name_list(msg, "names", verb), None
    if names is not None:
        raise ShardError(
            "bad_request",
            f"{verb}: 'names' and 'prefix' both: send one of them (docs/PROTOCOL.md)",
            {"field": "prefix"},
        )
    if type(prefix) is not str:
        raise bad_field(verb, "prefix", "a string, the start of the names to match", prefix)
    return None, prefix


@router.post("/set_optimizer", openapi_extra=BODY_DOC)
async def set_optimizer(request: Request) -> Response:
    """Change variables' optimizer or freeze them, once per (worker_id, seq): `{"names" |
    "prefix", "optimizer"?, "frozen"?, "worker_id", "seq"}` -> `{"variables": {name:
    {"status", "version", "optimizer", "optimizer_version", "frozen", "slots"}}}`."""
    msg, _ = await message(request)
    _only(msg, _SET_OPTIMIZER_FIELDS, "set_optimizer")
    worker_id, seq = writer(msg, "set_optimizer", required=True)
    names, prefix = _target(msg, "set_optimizer")
    frozen = msg.get("frozen")
    if frozen is not None and type(frozen) is not bool:
        raise bad_field("set_optimizer", "frozen", "true or false (or absent)", frozen)
    result = await store_of(request).set_optimizer(
        worker_id,
        seq,
        names=names,
        prefix=prefix,
        optimizer=msg.get("optimizer"),
        frozen=frozen,
        max_matched=request.app.state.config.max_request_names,
    )
    return reply(request, {"variables": result})


@router.post("/delete", openapi_extra=BODY_DOC)
async def delete(request: Request) -> Response:
    """Remove variables, once per (worker_id, seq): `{"names" | "prefix", "worker_id", "seq"}`
    -> `{"status", "deleted": [name, ...]}`."""
    msg, _ = await message(request)
    _only(msg, _DELETE_FIELDS, "delete")
    worker_id, seq = writer(msg, "delete", required=True)
    names, prefix = _target(msg, "delete")
    result = await store_of(request).delete(
        worker_id,
        seq,
        names=names,
        prefix=prefix,
        max_matched=request.app.state.config.max_request_names,
    )
    return reply(request, result)
