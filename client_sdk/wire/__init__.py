"""The wire format both sides share: messages, tensors, tensor tables, errors, and the
protocol's names.

The SDK and the shard import it as one module (``from client_sdk import wire``;
``wire.encode(...)``); it imports msgpack and numpy only. docs/PROTOCOL.md is the prose form
of it, written so a client in another language can be built from that page alone.

* ``constants.py``: the protocol's names and numbers, spelled once (version, content types,
  headers, environment variables, features, the frame's layout, default limits);
* ``errors.py``: the error codes and their statuses, the error payload, :class:`WireError`;
* ``tensors.py``: one tensor: dtype and shape checked, its map decoded as a view;
* ``messages.py``: a message's body, one msgpack map or framed (a small msgpack header, then
  the tensors' own bytes, aligned), encoded, unpacked, its tensor fields decoded;
* ``tables.py``: many tensors as one tensor table of a framed body;
* ``halves.py``: float32 values and gradients narrowed to float16 or bfloat16 for the wire, and
  widened back (a pull's ``wire_dtype``).

Which fields of a message are tensors is fixed by each verb's schema (docs/PROTOCOL.md); the
decoder is told, it does not guess.
"""

from . import constants
from .constants import *  # noqa: F403 (the names of constants.__all__, listed there once)
from .errors import ERROR_STATUS, WireError, error_payload
from .messages import Encoded, check_end, encode, header_end, tensors_of, unpack
from .tables import Span, encode_row, encode_table, table_rows, table_spans
from .tensors import Buffer, decode_tensor, framed_view, is_tensor, parse_dtype

__all__ = [
    *constants.__all__,
    "ERROR_STATUS",
    "Buffer",
    "Encoded",
    "Span",
    "WireError",
    "check_end",
    "decode_tensor",
    "encode",
    "encode_row",
    "encode_table",
    "error_payload",
    "framed_view",
    "header_end",
    "is_tensor",
    "parse_dtype",
    "table_rows",
    "table_spans",
    "tensors_of",
    "unpack",
]
