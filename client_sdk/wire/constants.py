"""The protocol's names and numbers, spelled once: its version, content types, header names,
environment variable names, the features a shard lists, the framed body's layout and the
default limits. The SDK and the shard both read them from here (``tests/sdk/test_wire.py``
holds that no other module spells them).
"""

from __future__ import annotations

import struct

__all__ = [
    "ALIGN",
    "COUNT_FROM",
    "DTYPES",
    "ENV_PREFIX",
    "ENV_SHARDS",
    "ENV_TOKEN",
    "ENV_WORKER_ID",
    "FEATURE_COUNTER_KIND",
    "FEATURE_DELETE",
    "FEATURE_EMBEDDING_TABLES",
    "FEATURE_GROUPS",
    "FEATURE_PACKED",
    "FEATURE_POLL",
    "FEATURE_ROWS_WIRE_DTYPE",
    "FEATURE_SET_OPTIMIZER",
    "FEATURE_TABLES",
    "FEATURE_WIRE_DTYPE",
    "FRAME",
    "FRAME_MAGIC",
    "FRAME_PREFIX",
    "FRAME_THRESHOLD",
    "HEADER_ALLOW_BACKUP",
    "HEADER_DELETIONS",
    "HEADER_EPOCH",
    "HEADER_FLEET",
    "HEADER_FORWARDED",
    "HEADER_INCARNATION",
    "HEADER_LSN",
    "HEADER_OWNER",
    "HEADER_PROTOCOL",
    "HEADER_ROLE",
    "HEADER_SHARD",
    "HEADER_STAGE",
    "HEADER_STATE_VERSION",
    "JSON",
    "MAX_NDIM",
    "MAX_REQUEST_NAMES",
    "MSGPACK",
    "OBJECTS_PER_NAME",
    "PROTOCOL_VERSION",
]

PROTOCOL_VERSION = 1

MSGPACK = "application/msgpack"
FRAME = "application/x-paramshard-frame"
JSON = "application/json"

#: Every response carries these, so a client can tell which shard answered and whether it restarted.
HEADER_SHARD = "x-paramshard-shard"  # "<index>/<num_shards>"
HEADER_INCARNATION = "x-paramshard-incarnation"
HEADER_PROTOCOL = "x-paramshard-protocol"
#: The shard's state version (sum of its variables' versions), once it has restored its state.
HEADER_STATE_VERSION = "x-paramshard-state-version"
#: How many deletes removed something on the shard since it started (absent while none did):
#: a variable deleted and made again may reach the version a client cached of the old one, so
#: a client keys cached values by incarnation and this count together.
HEADER_DELETIONS = "x-paramshard-deletions"
#: Between replicas: the id of a stage, a body a primary streams to a backup as it arrives
#: (docs/PROTOCOL.md §6, Stages).
HEADER_STAGE = "x-paramshard-stage"
#: A data-plane request names the shard it is meant for, ``"<index>/<num_shards>"``; a shard
#: that is not that one answers 421 ``fleet_mismatch``.
HEADER_FLEET = "x-paramshard-fleet"
#: Set by a shard on a ``GET /v1/variables/{name}`` it asks the owner on a caller's behalf
#: (never followed again), and the owner's ``"<index>/<num_shards>"`` on the answer it relays.
HEADER_FORWARDED = "x-paramshard-forwarded"
HEADER_OWNER = "x-paramshard-owner"
#: A read (pull, pull_rows, poll, wait) that a backup of the index may answer: ``1``. Without
#: it, a replica that is not the primary refuses reads with 421 ``not_primary``.
HEADER_ALLOW_BACKUP = "x-paramshard-allow-backup"
#: On every reply of a replica of a group: its role (``primary``, ``backup``, ``unknown``),
#: epoch, and the lsn it had applied when the request came in (the reply's values hold every
#: write up to that lsn).
HEADER_ROLE = "x-paramshard-role"
HEADER_EPOCH = "x-paramshard-epoch"
HEADER_LSN = "x-paramshard-lsn"

#: Every environment variable paramshard reads starts with this: the SDK's three below, and a
#: shard's settings (``PARAMSHARD_`` and the flag's name, see ``paramshard serve --help``).
ENV_PREFIX = "PARAMSHARD_"
#: The fleet's shard URLs, comma-separated, in shard-index order (the SDK, ``paramshard status``).
ENV_SHARDS = ENV_PREFIX + "SHARDS"
#: The worker's id (the SDK).
ENV_WORKER_ID = ENV_PREFIX + "WORKER_ID"
#: The bearer token the SDK sends.
ENV_TOKEN = ENV_PREFIX + "TOKEN"

#: What a shard lists in ``/v1/cluster`` ``features`` when its verbs take tensor tables in
#: requests (push ``grads``); every shard that lists it also answers pulls in tables.
FEATURE_TABLES = "tables"
#: A shard's verbs take request tables with a ``uniform`` map, packed or not (§2).
FEATURE_PACKED = "packed"
#: A shard's increment takes ``kind`` (``"int"`` or ``"float"``), the counter's kind stated
#: instead of read from the msgpack type of ``delta``.
FEATURE_COUNTER_KIND = "counter_kind"
#: A shard has ``POST /v1/poll``: a pull that waits for newer versions (§3).
FEATURE_POLL = "poll"
#: A shard has the verbs ``set_optimizer`` and ``delete`` (docs/PROTOCOL.md §3).
FEATURE_SET_OPTIMIZER = "set_optimizer"
FEATURE_DELETE = "delete"
#: A shard has embedding tables: ``create_table``, ``pull_rows``, ``push_rows`` (§3).
FEATURE_EMBEDDING_TABLES = "embedding_tables"
#: A shard's pull and poll take ``wire_dtype``: float32 values narrowed to half precision (§3).
FEATURE_WIRE_DTYPE = "wire_dtype"
#: A shard's pull_rows takes ``wire_dtype``, and its push_rows half-precision gradients (§3).
FEATURE_ROWS_WIRE_DTYPE = "rows_wire_dtype"
#: A shard has step groups: ``groups``, ``group_pull``, ``group_push`` (§3).
FEATURE_GROUPS = "groups"

FRAME_MAGIC = b"PSF1"
#: A framed body's prefix: :data:`FRAME_MAGIC` and the header's length, a little-endian uint32.
FRAME_PREFIX = struct.Struct("<4sI")
ALIGN = 64
#: Messages whose tensors hold at least this many bytes in all are framed by default.
FRAME_THRESHOLD = 64 * 1024

#: The dtypes a tensor may have on the wire (byte order is free; ``|`` for one-byte types).
DTYPES = frozenset({"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"})
MAX_NDIM = 32
#: The most entries one request may hold in any one list or map (names, variables, gradients,
#: a table's rows) that a shard takes by default (``--max-request-names``): past it, 413
#: ``too_large``. The Python SDK splits bigger batches into requests of at most this many.
MAX_REQUEST_NAMES = 2048
#: A message of more bytes than this (a msgpack body, or a framed body's header) is decoded
#: counting its lists, maps and their entries, at most :data:`OBJECTS_PER_NAME` per allowed
#: name: a body of nothing but empty maps would otherwise decode to ~64 bytes of memory per
#: byte.
COUNT_FROM = 1 << 20
OBJECTS_PER_NAME = 8
