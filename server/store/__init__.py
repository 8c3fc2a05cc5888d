"""The store: the variables one shard owns and the verbs that read and change them."""

from __future__ import annotations

from .verbs import (
    COUNTER_KINDS,
    DEFAULT_OPTIMIZER,
    MAX_WAIT_SECONDS,
    OFFLOAD_BYTES,
    Capture,
    ParameterStore,
    PullRows,
    Variable,
)

__all__ = [
    "COUNTER_KINDS",
    "DEFAULT_OPTIMIZER",
    "MAX_WAIT_SECONDS",
    "OFFLOAD_BYTES",
    "Capture",
    "ParameterStore",
    "PullRows",
    "Variable",
]
