"""Which shard owns a variable: pure functions, the same on the worker and on the shard.

``shard_for(name, num_shards)`` is Lamping & Veach's jump consistent hash of a 64-bit key, the key
being the first 8 bytes of ``blake2b(name.encode("utf-8"), digest_size=8)`` read little-endian.
Growing a fleet from N to N+1 shards moves about 1/(N+1) of the names, and only onto the new
shard. The steps are written out in docs/PROTOCOL.md with test vectors, so any language can
place names exactly as this module does; Python's ``hash()`` is never used (it is salted).

``row_shard(table, ids, num_shards)`` places the rows of an embedding table the same way, for a
whole int64 array of ids at once: the key of row ``id`` is ``mix64(name_key(table) + id * G)``
(SplitMix64's finalizer, ``G = 0x9E3779B97F4A7C15``, the id's two's-complement bits as a uint64,
arithmetic modulo 2**64), then jump consistent hash of that key.
"""

from __future__ import annotations

import functools
import hashlib
import re

import numpy as np

__all__ = [
    "MAX_NAME_LENGTH",
    "NAME_PATTERN",
    "jump_hash",
    "jump_hash_array",
    "name_key",
    "row_keys",
    "row_shard",
    "rows_on",
    "shard_for",
    "validate_name",
]

_MASK64 = (1 << 64) - 1
MAX_NAME_LENGTH = 256
NAME_PATTERN = r"[A-Za-z0-9_.:/-]{1,256}"
_NAME_RE = re.compile(NAME_PATTERN)


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid variable name, else raise ``ValueError`` saying why."""
    if not isinstance(name, str):
        raise ValueError(f"variable names are strings, got {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid variable name {name[:80]!r}: use 1-{MAX_NAME_LENGTH} characters "
            "from A-Z a-z 0-9 _ . : / -"
        )
    return name


def name_key(name: str) -> int:
    """The 64-bit key of a name: blake2b-64 of its UTF-8 bytes, little-endian."""
    if not isinstance(name, str):
        raise TypeError(f"variable names are strings, got {type(name).__name__}")
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def jump_hash(key: int, num_buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach, 2014) of a 64-bit ``key`` into ``num_buckets``.

    Raises ``TypeError`` unless both are ints (bools are not), ``ValueError`` unless
    ``0 <= key < 2**64`` and ``num_buckets >= 1``.
    """
    if not _is_int(key) or not _is_int(num_buckets):
        raise TypeError(
            f"jump_hash takes two ints, got {type(key).__name__} and {type(num_buckets).__name__}"
        )
    if not 0 <= key <= _MASK64:
        raise ValueError(f"key must be an unsigned 64-bit int, got {key}")
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    b, j = -1, 0
    while j < num_buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def shard_for(name: str, num_shards: int) -> int:
    """The index, in ``range(num_shards)``, of the shard that owns variable ``name``.

    Does not validate the name (see :func:`validate_name`); raises ``TypeError`` for a
    non-string name or non-int count and ``ValueError`` for ``num_shards < 1``.
    """
    return jump_hash(name_key(name), num_shards)


_M = np.uint64
_GOLDEN = _M(0x9E3779B97F4A7C15)
_JUMP = _M(2862933555777941757)
_TOP = _M(1 << 63)


def row_keys(table: str, ids: np.ndarray) -> np.ndarray:
    """The 64-bit placement keys (uint64 [n]) of rows ``ids`` (int64 [n]) of ``table``."""
    from .embedding import mix64  # imports numpy only; placement stays importable alone

    keys = np.asarray(ids, dtype=np.int64).view(np.uint64) * _GOLDEN
    keys += _M(_table_key(table))
    return mix64(keys)


#: A table's :func:`name_key`, kept: every push and pull of its rows places them.
_table_key = functools.lru_cache(maxsize=1024)(name_key)


def jump_hash_array(keys: np.ndarray, num_buckets: int) -> np.ndarray:
    """:func:`jump_hash` of every uint64 key in ``keys`` (int64 [n]): the same numbers, each
    key's loop run for all keys at once (a few dozen numpy passes, none per key)."""
    if not _is_int(num_buckets) or num_buckets < 1:
        raise ValueError(f"num_buckets must be an int >= 1, got {num_buckets!r}")
    out = np.zeros(len(keys), dtype=np.int64)
    if num_buckets == 1 or not len(keys):
        return out
    if num_buckets == 2:
        # The loop's first step gives j = 2^31 / (top 31 bits of the stepped key + 1): at
        # least 2 (so bucket 0) exactly when those bits are below 2^30, i.e. the stepped key's
        # top bit is 0; else j is 1 and the second step, whose j is always at least 2, ends
        # at bucket 1. So the bucket is that top bit.
        stepped: np.ndarray = np.asarray(keys, dtype=np.uint64) * _JUMP + _M(1)
        top: np.ndarray = stepped >> _M(63)
        return top.view(np.int64)
    key = np.array(keys, dtype=np.uint64)
    j = np.zeros(len(keys), dtype=np.int64)
    todo = np.arange(len(keys))
    scale = float(1 << 31)
    while todo.size:
        b = j
        key = key * _JUMP + _M(1)
        j = ((b + 1) * (scale / ((key >> _M(33)).view(np.int64).astype(np.float64) + 1.0))).astype(
            np.int64
        )
        done = j >= num_buckets
        if done.any():
            out[todo[done]] = b[done]
            keep = ~done
            todo, key, j = todo[keep], key[keep], j[keep]
    return out


def row_shard(table: str, ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (int64 [n], in ``range(num_shards)``) of each row ``ids`` (int64 [n]) of
    embedding table ``table``. Pure and vectorized; the SDK sends each row to it, the shard
    refuses (421) a row that is not its own, and a reshard moves rows by it."""
    if num_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return jump_hash_array(row_keys(table, ids), num_shards)


def rows_on(table: str, ids: np.ndarray, num_shards: int, shard: int) -> bool:
    """Whether every row ``ids`` (int64 [n]) of ``table`` is on ``shard``: what
    ``(row_shard(table, ids, num_shards) == shard).all()`` says, in fewer passes for 2
    shards (a shard checking the rows of each request it is sent)."""
    if not len(ids):
        return True
    if num_shards == 1:
        return shard == 0
    if num_shards != 2:
        return bool((row_shard(table, ids, num_shards) == shard).all())
    # The bucket is the top bit of the stepped key (jump_hash_array): all 0 for shard 0, all
    # 1 for shard 1; one reduction tells, with no array of buckets.
    stepped = row_keys(table, ids)
    stepped *= _JUMP
    stepped += _M(1)
    if shard == 0:
        return bool(stepped.max() < _TOP)
    return shard == 1 and bool(stepped.min() >= _TOP)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
