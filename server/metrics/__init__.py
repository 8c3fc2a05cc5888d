"""What a shard counts for people and scrapers: its HTTP traffic (:mod:`.traffic`, plain ints
counted as requests end) and the Prometheus ``/metrics`` endpoint that reads those counts, and
the store's, gate's and snapshots' own, at scrape time (:mod:`.export`).

:mod:`.traffic` imports nothing of the web stack (the app's middleware imports it);
:mod:`.export` is imported by :func:`server.app.create_app` only, for its router.
"""

from .traffic import Traffic

__all__ = ["Traffic"]
