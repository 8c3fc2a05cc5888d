"""The demo's yardstick: the digits model trained in one process, without a parameter server.

:func:`train_one_process` runs the same model, data, optimizer and number of gradient steps as
a fleet's workers together, with the shard's own optimizer code (:mod:`server.optim`), so the
accuracy ``paramshard demo`` (and tests/test_training.py) compare against is what the fleet
would reach if asynchrony cost nothing.
"""

from __future__ import annotations

import numpy as np

from client_sdk.optimizers import Adagrad

from .. import optim
from . import digits_worker

__all__ = ["train_one_process"]


def train_one_process(
    data: digits_worker.Dataset, *, steps: int, batch_size: int, lr: float, seed: int
) -> dict[str, np.ndarray]:
    """``steps`` Adagrad steps on mini-batches of the whole training set, in this process, from
    the workers' initial weights. Blocks (CPU only); returns the final weights.
    """
    opt = Adagrad(lr=lr)
    params = digits_worker.init_params(seed)
    state = {name: optim.init_state(opt, value) for name, value in params.items()}
    rng = np.random.default_rng([seed, 1 << 20])
    n = len(data.y_train)
    for step in range(1, steps + 1):
        batch = rng.choice(n, size=batch_size, replace=n < batch_size)
        _, grads = digits_worker.loss_and_grads(params, data.X_train[batch], data.y_train[batch])
        for name, grad in grads.items():
            optim.apply(opt, params[name], grad, state[name], step=step, scratch=True)
    return params
