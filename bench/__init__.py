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

``ctx`` starts shared processes lazily (``ctx.shard_urls(n)``, ``ctx.raw_address()``) and stops
them at the end. A new case (small-request latency, many variables per step, several workers,
TensorFlow / Redis / Ray as peers) is a new module plus one line here.
"""

from __future__ import annotations

__all__ = ["CASES"]

#: case name -> module; run in this order.
CASES: dict[str, str] = {
    "transfer": "bench.transfer",
}
