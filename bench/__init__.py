"""``make bench`` (``python -m bench``): paramshard measured next to a reference, in one run.

Every number is printed beside a reference that moves the same bytes on the same machine in
the same run, because on a shared 2-core box absolute figures drift from run to run while
ratios measured side by side hold. The reference for transfers is a raw TCP socket
(:mod:`bench.rawsock`).

A **case** is a module listed in :data:`CASES` with

* ``DESCRIPTION``: one line for ``--list`` and the table heading;
* ``DEFAULT_SIZES``: the variable sizes (elements) it runs when ``--sizes`` is not given,
  or ``()`` if sizes mean nothing to it;
* ``run(ctx: bench.context.Context) -> list[dict]``: result rows, one per (op, size, system),
  each ``{"case", "op", "size", "system", "reference": bool, ...bench.timing.summarize(...)}``.
  The row with ``reference: True`` in a group of the same (case, op, size) is what the others
  are compared with.

``ctx`` starts shared processes lazily (``ctx.fleet(n)``, ``ctx.raw()``, ``ctx.peers()``) and
stops them at the end. A new case is a new module plus one line here. After the tables come
the server CPU per GB, the GOALS (:mod:`bench.goals`) and the SCALE estimate
(:mod:`bench.scale`).
"""

from __future__ import annotations

__all__ = ["CASES"]

#: case name -> module; run in this order.
CASES: dict[str, str] = {
    "transfer": "bench.transfer",
    "link": "bench.link",
    "step": "bench.step",
    "workers": "bench.workers",
    "snapshot": "bench.snapshot",
    "optimizers": "bench.optimizers",
    "broadcast": "bench.broadcast",
    "syncround": "bench.syncround",
    "rows": "bench.rows",
    "shardsize": "bench.shardsize",
    "concurrency": "bench.concurrency",
    "fanout": "bench.fanout",
    "frameworks": "bench.frameworks",
    "floor": "bench.floor",
    "replication": "bench.replication",
    "failover": "bench.failover",
}
