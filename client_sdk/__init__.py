"""paramshard worker SDK: route variables to shards, pull weights, push gradients.

    from client_sdk import PSClient
    from client_sdk.optimizers import Adagrad
    with PSClient(["http://127.0.0.1:7100", "http://127.0.0.1:7101"], worker_id="w0") as ps:
        ps.init({"w": w0}, optimizer=Adagrad(lr=0.1))
        w = ps.pull(["w"])["w"]
        ps.push({"w": grad})

Needs only httpx2, msgpack and numpy.
"""

from ._exceptions import (
    AuthError,
    BadRequestError,
    BadTensorError,
    ConfigError,
    ConflictError,
    FleetMismatchError,
    NotReadyError,
    OverloadedError,
    ProtocolError,
    PSError,
    PushError,
    RequestRejectedError,
    ServerError,
    ShardUnavailableError,
    UnknownVariableError,
)
from .client import AsyncPSClient, PSClient

__version__ = "0.1.0"

__all__ = [
    "AsyncPSClient",
    "AuthError",
    "BadRequestError",
    "BadTensorError",
    "ConfigError",
    "ConflictError",
    "FleetMismatchError",
    "NotReadyError",
    "OverloadedError",
    "PSClient",
    "PSError",
    "ProtocolError",
    "PushError",
    "RequestRejectedError",
    "ServerError",
    "ShardUnavailableError",
    "UnknownVariableError",
]
