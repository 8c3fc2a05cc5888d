"""paramshard worker SDK: route variables to shards, pull weights, push gradients.

    from client_sdk import PSClient
    from client_sdk.optimizers import Adagrad
    with PSClient(["http://127.0.0.1:7100", "http://127.0.0.1:7101"], worker_id="w0") as ps:
        ps.init({"w": w0}, optimizer=Adagrad(lr=0.1))
        w = ps.pull(["w"])["w"]
        ps.push({"w": grad})

Needs only httpx2, msgpack and numpy.

How it is built (each module opens with what it owns):

    client.py       PSClient and AsyncPSClient: thin shells that drive the verbs
                    (_table_methods.py: their embedding-table methods)
    _verbs/         one module per verb: a flow of requests and replies, no I/O
    _core.py        what the verbs share: requests built, replies accepted, the fleet check
    _fleet.py       the shard list, placement, each shard's features and incarnation
    _cache.py       the version cache: what was pulled, at which version
    _args.py        arguments checked and converted (_settings.py: the client's options)
    _replies.py     replies decoded, or mapped to the PSError tree (_exceptions.py)
    _pusher.py      push_async: bounded, coalescing, no failure lost
    _transport.py   a request sent and retried (_abort.py: a raced one cut short);
                    _http/ performs the HTTP exchanges
    wire/           the wire format, shared with the shards
    _parts.py       the layouts of partitioned variables this client learned
    groups.py       step groups: a list of variables pulled and pushed as one flat buffer
    placement.py, partitions.py, optimizers.py, modes.py, embedding.py, training.py: the public
                    helpers
"""

from ._exceptions import (
    AuthError,
    BadRequestError,
    BadTensorError,
    ConfigError,
    ConflictError,
    FleetMismatchError,
    FrozenError,
    NotPrimaryError,
    NotReadyError,
    OverloadedError,
    PartitionedError,
    ProtocolError,
    PSError,
    PushError,
    RequestRejectedError,
    ServerError,
    ShardUnavailableError,
    StaleGroupError,
    UnknownVariableError,
)
from .client import AsyncPSClient, PSClient
from .groups import AsyncStepGroup, StepGroup

__version__ = "0.1.0"

__all__ = [
    "AsyncPSClient",
    "AsyncStepGroup",
    "AuthError",
    "BadRequestError",
    "BadTensorError",
    "ConfigError",
    "ConflictError",
    "FleetMismatchError",
    "FrozenError",
    "NotPrimaryError",
    "NotReadyError",
    "OverloadedError",
    "PSClient",
    "PSError",
    "PartitionedError",
    "ProtocolError",
    "PushError",
    "RequestRejectedError",
    "ServerError",
    "ShardUnavailableError",
    "StaleGroupError",
    "StepGroup",
    "UnknownVariableError",
]
