"""``GET /metrics``: a shard's counts in Prometheus' text format, read at scrape time.

The shard counts where the work happens, in plain ints (:mod:`server.metrics.traffic` for
requests, the dedup table's :class:`~server.store.dedup.Totals` for writes, the admission gate,
the durability's last snapshot and restore); :class:`ShardCollector`, a custom collector of
prometheus-client, turns them into metric families when Prometheus asks. No request pays
for a label lookup or a lock. The series and what each means are listed in docs/PROTOCOL.md
§4 (Metrics) and README.md ("Operating a fleet").

Per-worker series are bounded: the :attr:`~server.config.ShardConfig.metrics_workers` most
active workers (by writes applied and retried) have their own ``worker`` label, the others are
summed under ``worker="_other"``. A worker moving in or out of the top changes which series
it counts in: ``_other`` may go down then (a counter reset, to Prometheus' ``rate``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.responses import Response

from .. import __version__
from ..store.dedup import STALENESS_BOUNDS
from .traffic import LATENCY_BOUNDS

__all__ = ["OTHER_WORKERS", "ShardCollector", "registry_for", "router"]

#: The ``worker`` label of the workers summed together.
OTHER_WORKERS = "_other"

router = APIRouter(tags=["inspection (JSON)"])


def _buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus' cumulative buckets from per-bucket counts (one more than ``bounds``)."""
    out, total = [], 0
    for bound, n in zip(bounds, counts):
        total += n
        out.append((repr(float(bound)), total))
    total += counts[-1]
    out.append(("+Inf", total))
    return out


def _status(status: int) -> str:
    return str(status) if status else "none"


class ShardCollector:
    """Reads one shard's state (a FastAPI ``app.state`` made by :func:`server.app.create_app`)
    at each collection."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state
        yield from self._shard(state)
        yield from self._requests(state.traffic)
        yield from self._writes(state)
        yield from self._admission(state.gate)
        yield from self._persistence(state.durability)
        yield from self._auth(state)

    # -- the shard ------------------------------------------------------------------------

    def _shard(self, state: Any) -> Iterator[Metric]:
        config, store = state.config, state.store
        info = GaugeMetricFamily(
            "paramshard_shard_info",
            "This shard: its place in the fleet, its incarnation (new at every start) and "
            "release; always 1.",
            labels=["shard", "num_shards", "incarnation", "version"],
        )
        info.add_metric(
            [
                str(config.shard_index),
                str(config.num_shards),
                state.incarnation,
                __version__,
            ],
            1,
        )
        yield info
        yield GaugeMetricFamily(
            "paramshard_start_time_seconds",
            "When this shard process started (Unix seconds).",
            value=state.started_at,
        )
        yield GaugeMetricFamily(
            "paramshard_variables", "Variables this shard holds.", value=len(store)
        )
        yield GaugeMetricFamily(
            "paramshard_variable_bytes",
            "Bytes this shard holds in variables' values and optimizer slots.",
            value=store.nbytes,
        )
        yield GaugeMetricFamily(
            "paramshard_state_version",
            "The shard's state version (goes up with every change of state).",
            value=store.state_version,
        )
        yield GaugeMetricFamily(
            "paramshard_polls_waiting",
            "Polls waiting for a new version now.",
            value=store.waiters.polls,
        )
        yield GaugeMetricFamily(
            "paramshard_workers",
            "Workers whose writes the shard remembers (its dedup table).",
            value=len(store.dedup),
        )

    # -- requests -------------------------------------------------------------------------

    def _requests(self, traffic: Any) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "paramshard_requests",
            "HTTP requests answered, by verb (data-plane verb or endpoint) and status "
            "('none': the client went away before any response).",
            labels=["verb", "status"],
        )
        latency = HistogramMetricFamily(
            "paramshard_request_duration_seconds",
            "Time from a request's head to its response's end, by verb and status.",
            labels=["verb", "status"],
        )
        received = CounterMetricFamily(
            "paramshard_received_bytes",
            "Request body bytes (Content-Length) of requests not refused before their body "
            "was read, by verb.",
            labels=["verb"],
        )
        sent = CounterMetricFamily(
            "paramshard_sent_bytes", "Response body bytes sent, by verb.", labels=["verb"]
        )
        by_verb: dict[str, list[int]] = {}
        pushes_refused = 0
        backpressure = {429: 0, 503: 0}
        for (verb, status), counts in sorted(traffic.routes.items()):
            n = counts.count
            labels = [verb, _status(status)]
            requests.add_metric(labels, n)
            latency.add_metric(
                labels,
                buckets=_buckets(LATENCY_BOUNDS, counts.buckets),
                sum_value=counts.seconds,
            )
            totals = by_verb.setdefault(verb, [0, 0])
            totals[0] += counts.received
            totals[1] += counts.sent
            if verb == "push" and status >= 400:
                pushes_refused += n
            if status in backpressure:
                backpressure[status] += n
        for verb, (nin, nout) in sorted(by_verb.items()):
            received.add_metric([verb], nin)
            sent.add_metric([verb], nout)
        yield from (requests, latency, received, sent)
        pushes = CounterMetricFamily(
            "paramshard_pushes",
            "Push requests: applied (whole; a retry of one applied already is a duplicate in "
            "paramshard_writes_total), refused (answered 4xx or 5xx: nothing of it applied).",
            labels=["outcome"],
        )
        pushes.add_metric(["applied"], self.state.store.dedup.totals.pushes)
        pushes.add_metric(["refused"], pushes_refused)
        yield pushes
        pressure = CounterMetricFamily(
            "paramshard_backpressure_responses",
            "Requests answered 429 (too much in flight) or 503 (not ready, paused, draining, "
            "cannot persist), all verbs.",
            labels=["status"],
        )
        for status, n in backpressure.items():
            pressure.add_metric([str(status)], n)
        yield pressure

    # -- writes -----------------------------------------------------------------------------

    def _writes(self, state: Any) -> Iterator[Metric]:
        dedup = state.store.dedup
        totals = dedup.totals
        writes = CounterMetricFamily(
            "paramshard_writes",
            "Writes carrying a worker's seq (push, assign, increment, set_optimizer, delete): "
            "applied, answered as a duplicate (a retry of one applied already), refused as "
            "expired (a seq too old to tell).",
            labels=["outcome"],
        )
        for outcome, n in zip(("applied", "duplicate", "expired"), totals.writes):
            writes.add_metric([outcome], n)
        yield writes
        gradients = CounterMetricFamily(
            "paramshard_push_gradients",
            "Gradients of applied pushes (one per variable): applied, accepted into a sync "
            "round, dropped by a variable's training mode (too stale), applied with a scaled "
            "step.",
            labels=["outcome"],
        )
        for outcome, n in zip(("applied", "accepted", "dropped", "scaled"), totals.gradients):
            gradients.add_metric([outcome], n)
        yield gradients
        staleness = HistogramMetricFamily(
            "paramshard_push_staleness_versions",
            "Of each applied push that said the versions its gradients were computed on, the "
            "largest staleness (the variable's version minus that one).",
        )
        staleness.add_metric(
            [], buckets=_buckets(STALENESS_BOUNDS, totals.staleness), sum_value=totals.staleness_sum
        )
        yield staleness
        yield from self._workers(dedup.records(), state.config.metrics_workers)

    @staticmethod
    def _workers(records: list[tuple[str, Any]], top: int) -> Iterator[Metric]:
        writes = CounterMetricFamily(
            "paramshard_worker_writes",
            'Per worker (the most active ones; the others summed as worker="_other"): writes '
            "applied, duplicates, expired.",
            labels=["worker", "outcome"],
        )
        gradients = CounterMetricFamily(
            "paramshard_worker_gradients",
            "Per worker (as paramshard_worker_writes): gradients applied, accepted, dropped, "
            "scaled.",
            labels=["worker", "outcome"],
        )
        last_seen = GaugeMetricFamily(
            "paramshard_worker_last_seen_seconds",
            "Per worker (the most active ones): when it last wrote (Unix seconds).",
            labels=["worker"],
        )
        ranked = sorted(records, key=lambda wr: wr[1].applied + wr[1].duplicates, reverse=True)
        other = [0, 0, 0, 0, 0, 0, 0]
        for i, (worker, r) in enumerate(ranked):
            counts = [r.applied, r.duplicates, r.expired, *r.gradients]
            if i >= top:
                other = [a + b for a, b in zip(other, counts)]
                continue
            _worker_series(writes, gradients, worker, counts)
            last_seen.add_metric([worker], r.last_seen)
        if len(ranked) > top:
            _worker_series(writes, gradients, OTHER_WORKERS, other)
        yield from (writes, gradients, last_seen)

    # -- admission, persistence, auth ---------------------------------------------------------

    @staticmethod
    def _admission(gate: Any) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "paramshard_admission_requests_in_flight",
            "Data-plane requests admitted and not yet answered.",
            value=gate.requests,
        )
        yield GaugeMetricFamily(
            "paramshard_admission_bytes_in_flight",
            "Body bytes of the requests admitted and not yet answered.",
            value=gate.bytes,
        )
        yield GaugeMetricFamily(
            "paramshard_admission_queue_depth",
            "Requests waiting in line for room now.",
            value=gate.stats()["waiting"],
        )
        yield CounterMetricFamily(
            "paramshard_admission_waits",
            "Requests that waited in line for room.",
            value=gate.waited,
        )
        yield CounterMetricFamily(
            "paramshard_admission_wait_seconds",
            "Seconds requests waited in line for room, in all.",
            value=gate.wait_seconds,
        )
        yield CounterMetricFamily(
            "paramshard_admission_refused",
            "Requests refused for want of room (429) after waiting or with the line full.",
            value=gate.refused,
        )
        yield GaugeMetricFamily(
            "paramshard_ready",
            "1 while the shard takes requests (restored, not draining, able to persist).",
            value=1 if gate.ready and gate.persist_error is None else 0,
        )

    @staticmethod
    def _persistence(durability: Any) -> Iterator[Metric]:
        last = durability.last
        restored = durability.restored
        newest = last or restored
        if newest is not None:
            yield GaugeMetricFamily(
                "paramshard_snapshot_age_seconds",
                "Seconds since the newest snapshot of this shard's state was taken (written by "
                "this process, or restored at its start).",
                value=max(0.0, time.time() - float(newest["created_at"])),
            )
        if last is not None:
            yield GaugeMetricFamily(
                "paramshard_snapshot_duration_seconds",
                "How long writing the last snapshot took.",
                value=last["seconds"],
            )
            yield GaugeMetricFamily(
                "paramshard_snapshot_bytes",
                "Values' bytes in the last snapshot written.",
                value=last["bytes"],
            )
        if restored is not None:
            yield GaugeMetricFamily(
                "paramshard_restore_duration_seconds",
                "How long restoring this shard's snapshot took at its start.",
                value=restored["seconds"],
            )
        yield GaugeMetricFamily(
            "paramshard_cannot_persist",
            "1 while the shard's snapshots fail (writes are refused meanwhile).",
            value=0 if durability.cannot_persist is None else 1,
        )

    @staticmethod
    def _auth(state: Any) -> Iterator[Metric]:
        guard = getattr(state, "auth", None)
        refused = getattr(guard, "refused", None)
        if not isinstance(refused, dict):
            return
        family = CounterMetricFamily(
            "paramshard_auth_refused",
            "Requests refused by the token check, by reason (401: missing, malformed, wrong; "
            "403: forbidden, a read token on a write).",
            labels=["reason"],
        )
        for reason, n in sorted(refused.items()):
            family.add_metric([str(reason)], n)
        yield family


def _worker_series(writes: Any, gradients: Any, worker: str, counts: list[int]) -> None:
    for outcome, n in zip(("applied", "duplicate", "expired"), counts[:3]):
        writes.add_metric([worker, outcome], n)
    for outcome, n in zip(("applied", "accepted", "dropped", "scaled"), counts[3:]):
        gradients.add_metric([worker, outcome], n)


def registry_for(state: Any) -> CollectorRegistry:
    """A registry of its own for one shard app (several apps may share a process, in tests),
    made at the first scrape."""
    registry = getattr(state, "metrics_registry", None)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ShardCollector(state))
        state.metrics_registry = registry
    return registry


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """The shard's metrics in Prometheus' text format (docs/PROTOCOL.md §4, Metrics)."""
    body = generate_latest(registry_for(request.app.state))
    return Response(body, media_type=CONTENT_TYPE_LATEST)
