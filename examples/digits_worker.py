"""A Downpour SGD worker training a small network on scikit-learn's digits through paramshard.

    paramshard up --shards 2 --base-port 7100 --data-dir fleet   # in one terminal
    export PARAMSHARD_SHARDS=http://127.0.0.1:7100,http://127.0.0.1:7101
    python examples/digits_worker.py --worker-index 0 --num-workers 2 &
    python examples/digits_worker.py --worker-index 1 --num-workers 2

The worker itself is ``server/demo/digits_worker.py``: it is installed with paramshard, so that
``paramshard demo`` runs it from a wheel too, and this file runs it. Read (and copy) it there:
its docstring walks through what a Downpour worker does, step by step, and every call is in
sight. ``python -m server.demo.digits_worker`` is the same worker.
"""

import sys

from server.demo.digits_worker import main

if __name__ == "__main__":
    sys.exit(main())
