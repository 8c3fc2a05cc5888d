"""A shard's log lines: plain text for people, or one JSON object a line for log pipelines.

``--log-format text`` (the default) writes ``time LEVEL logger: message``; ``--log-format
json`` writes each record as one JSON object with ``time`` (ISO 8601, UTC), ``level``,
``logger``, ``message``, ``shard`` (``<index>/<num_shards>``) and, where the line is about one
of these, the fields :data:`FIELDS` (``event``: what happened, e.g. ``start``, ``restore``,
``snapshot``, ``checkpoint``, ``refused``, ``auth_refused``, ``worker_first_seen``; ``worker``,
``seq``, ``variable``, ``outcome``, ...). Code that logs a notable event passes them as
``extra={"event": ..., ...}``; in text they are already in the message. uvicorn's own lines
(its start-up, its errors) go through the same handler in JSON, so every line parses.

:class:`RateLimited` keeps an event that a client can cause at will (a refused request) to
at most one line per interval, counting the lines it left out in the next.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["FIELDS", "JsonFormatter", "RateLimited", "configure"]

#: Fields a record may carry (``extra=``) that the JSON form writes out.
FIELDS = (
    "event",
    "worker",
    "seq",
    "variable",
    "outcome",
    "status",
    "code",
    "method",
    "path",
    "checkpoint",
    "snapshot",
    "seconds",
    "variables",
    "bytes",
    "suppressed",
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module); ``shard`` is on every line."""

    def __init__(self, shard: str) -> None:
        super().__init__()
        self.shard = shard

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "shard": self.shard,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: int, fmt: str, shard: str) -> None:
    """Send every log record at ``level`` or above to stderr as ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(shard) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # The shard's own HTTP client (a primary forwarding to its backups, a variable's REST
    # followed to its owner) would log every request at info: its failures are logged where
    # they matter, by the shard's own loggers.
    logging.getLogger("httpx2").setLevel(max(level, logging.WARNING))


class RateLimited:
    """Logs through ``logger`` at most once per ``every`` seconds; :meth:`log` returns whether
    it wrote the line. The next line written says how many were left out (``suppressed``)."""

    def __init__(self, logger: logging.Logger, every: float = 1.0) -> None:
        self.logger = logger
        self.every = every
        self._at = -float("inf")
        self._left_out = 0

    def log(self, level: int, message: str, *args: Any, **fields: Any) -> bool:
        now = time.monotonic()
        if now - self._at < self.every:
            self._left_out += 1
            return False
        if self._left_out:
            message += " (%d more left out of the log since the last line)"
            args = (*args, self._left_out)
            fields["suppressed"] = self._left_out
        self._at, self._left_out = now, 0
        self.logger.log(level, message, *args, extra=fields)
        return True
