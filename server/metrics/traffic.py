"""What a shard's HTTP traffic was: requests, their latency and bytes, by verb and status.

Counted where each request ends (:class:`server.app.ShardMiddleware` for every request through
the app, FastAPI's routes and :mod:`server.direct_routes` alike; the answerers of
:mod:`server.immediate` for the requests the shard's HTTP protocol answers itself), in
plain ints: one dict lookup for the path's verb, one for ``(verb, status)``, a bisection for the
latency bucket and a few additions. Nothing here knows Prometheus; :mod:`server.metrics.export`
reads these counts at scrape time.

The labels are bounded whatever the requests: a path is one of the shard's own (a data-plane
verb, an inspection endpoint, a page) or ``"other"``; a status is one the shard sent, or
``0`` when the client went away before any response.

Not thread-safe: the event-loop thread only.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["LATENCY_BOUNDS", "UNREAD", "RouteCounts", "Traffic", "verb_of"]

#: The upper bounds of the latency buckets (seconds), the last one open.
LATENCY_BOUNDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: Statuses of requests refused before their body is read (auth, too large, backpressure):
#: their declared ``Content-Length`` is not counted as received.
UNREAD = frozenset((401, 403, 413, 429, 503))

_DATA_PLANE = (
    "init",
    "pull",
    "push",
    "assign",
    "increment",
    "wait",
    "poll",
    "set_optimizer",
    "delete",
    "pause",
    "snapshot",
    "resume",
    "create_table",
    "pull_rows",
    "push_rows",
    "groups",
    "group_pull",
    "group_push",
)
_PAGES = {
    "/": "dashboard",
    "/metrics": "metrics",
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/docs": "docs",
    "/openapi.json": "openapi",
    "/v1/cluster": "cluster",
    "/v1/workers": "workers",
    "/v1/variables": "variables",
    "/v1/checkpoints": "checkpoints",
}
_VERBS: dict[str, str] = {**{f"/v1/{v}": v for v in _DATA_PLANE}, **_PAGES}
#: Paths under these prefixes are one verb each (their rest is a name, not a route).
_PREFIXES = (
    ("/v1/variables/", "variable"),
    ("/v1/checkpoints/", "checkpoint"),
    ("/v1/tables", "tables"),
    ("/docs/", "docs"),
)


def verb_of(path: str) -> str:
    """The label of a request path: the data-plane verb, the endpoint's name, or ``"other"``."""
    verb = _VERBS.get(path)
    if verb is not None:
        return verb
    for prefix, name in _PREFIXES:
        if path.startswith(prefix):
            return name
    return "other"


class RouteCounts:
    """One ``(verb, status)``: requests, their latency (buckets of :data:`LATENCY_BOUNDS` and
    one more above, and the sum) and bytes received (request bodies) and sent (response
    bodies)."""

    __slots__ = ("buckets", "received", "seconds", "sent")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BOUNDS) + 1)
        self.seconds = 0.0
        self.received = 0
        self.sent = 0

    @property
    def count(self) -> int:
        return sum(self.buckets)


class Traffic:
    """Every request the shard answered (or lost), by ``(verb, status)``."""

    def __init__(self) -> None:
        #: ``(verb, status) -> RouteCounts``.
        self.routes: dict[tuple[str, int], RouteCounts] = {}
        #: ``path -> verb``, for the paths seen (bounded: unknown paths are not kept).
        self._verbs: dict[str, str] = dict(_VERBS)

    def record(self, path: str, status: int, seconds: float, received: int, sent: int) -> None:
        """Count one request to ``path`` answered ``status`` (0: no response) after
        ``seconds``, with a body of ``received`` bytes (its ``Content-Length``; not counted
        when refused unread, :data:`UNREAD`) and ``sent`` bytes of response body."""
        verb = self._verbs.get(path)
        if verb is None:
            verb = verb_of(path)
        self.count(verb, status, seconds, received, sent)

    def count(self, verb: str, status: int, seconds: float, received: int, sent: int) -> None:
        """:meth:`record` for a known verb label."""
        counts = self.routes.get((verb, status))
        if counts is None:
            counts = self.routes[(verb, status)] = RouteCounts()
        counts.buckets[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        counts.seconds += seconds
        if status not in UNREAD:
            counts.received += received
        counts.sent += sent

    def statuses(self, verb: str | None = None) -> dict[int, int]:
        """Requests by status (of one verb, or all)."""
        out: dict[int, int] = {}
        for (v, status), counts in self.routes.items():
            if verb is None or v == verb:
                out[status] = out.get(status, 0) + counts.count
        return out
