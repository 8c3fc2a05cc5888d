"""The worker API in a dozen calls, each printed with what it returns.

    paramshard up --shards 2 --base-port 7100      # in another terminal
    python examples/quickstart.py

The shards are ``PARAMSHARD_SHARDS`` (comma-separated URLs in shard-index order), or the two
that ``paramshard up --shards 2 --base-port 7100`` starts. Running it again is fine: ``init``
then finds ``w`` and ``b`` already there (``created: False``) and training carries on.
"""

from __future__ import annotations

import os
import pprint
import sys
from typing import Any

import numpy as np

from client_sdk import PSClient, PSError
from client_sdk.optimizers import Adagrad

DEFAULT_SHARDS = "http://127.0.0.1:7100,http://127.0.0.1:7101"


def show(call: str, result: Any) -> None:
    print(f">>> {call}")
    if result is not None:
        print(pprint.pformat(result, width=100, sort_dicts=False))
    print()


def main() -> int:
    shards = os.environ.get("PARAMSHARD_SHARDS", DEFAULT_SHARDS)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    b0 = np.zeros(3, np.float32)
    gw = np.full((4, 3), 0.5, np.float32)  # a made-up gradient
    gb = np.full(3, -0.5, np.float32)

    print(f"shards: {shards}\n")
    # retry_deadline: give up after 5 s (not the default 30 s) if the fleet is not up
    with PSClient(shards.split(","), worker_id="quickstart", retry_deadline=5) as ps:
        show(
            'ps.init({"w": w0, "b": b0}, optimizer=Adagrad(lr=0.1))',
            ps.init({"w": w0, "b": b0}, optimizer=Adagrad(lr=0.1)),
        )
        show('ps.wait_ready(["w", "b"], timeout=60)', ps.wait_ready(["w", "b"], timeout=60))
        show('ps.pull(["w", "b"])', ps.pull(["w", "b"]))
        show('ps.push({"w": gw, "b": gb})', ps.push({"w": gw, "b": gb}))
        fut = ps.push_async({"w": gw})
        show('fut = ps.push_async({"w": gw})', fut)
        show("ps.flush()", ps.flush())
        show("fut.result()", fut.result())
        show('ps.pull(["w"])', ps.pull(["w"]))
        show('ps.increment("global_step")', ps.increment("global_step"))
        show('ps.assign({"w": w0})', ps.assign({"w": w0}))
        show("ps.variables()", ps.variables())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PSError as exc:
        print(
            f"error: {exc}\n\nIs a fleet running? Start one with "
            "`paramshard up --shards 2 --base-port 7100`, or set PARAMSHARD_SHARDS.",
            file=sys.stderr,
        )
        sys.exit(1)
