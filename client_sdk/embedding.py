"""Embedding tables: the spec a worker creates a table with, and the rows a new id starts from.

An embedding table holds one row of ``dim`` float32 numbers per int64 id, any id (negative and
huge ones too); its rows are spread over the shards by :func:`client_sdk.placement.row_shard`.
The spec is shared by the SDK and the shard, like :mod:`client_sdk.optimizers`:

    ps.create_table("user_emb", dim=64, initializer=Normal(std=0.01), optimizer=Adagrad(lr=0.1))

* :class:`TableSpec`: ``dim``, ``dtype`` (``"float32"``), ``initializer``, ``optimizer`` (a spec
  of :mod:`client_sdk.optimizers`, applied per row with per-row slots and step counts) and
  ``seed``; every field checked at construction (``SpecError`` naming the field), and on the
  shard (400) when it comes over the wire (:func:`spec_from_wire`);
* initializers :class:`Zeros`, :class:`Constant`, :class:`Uniform` (the default:
  ``Uniform(-0.05, 0.05)``) and :class:`Normal` (not truncated);
* :func:`initial_rows`: a row's first value, a pure function of (seed, table name, id, column),
  computed for a whole array of ids at once with no per-id Python. The same id gives the same
  row on any shard count, after any restart, in any language: docs/PROTOCOL.md §1 states the
  steps;
* :func:`segment_sum`: the sum of the gradients of each distinct id (sort-based), as a push
  applies them (:func:`segment_sums`: the same, for a caller that splits them).

Optimizers on tables take no learning-rate ``schedule`` (a row's updates are counted per row;
there is no one step for the table to schedule by); ``clip_norm`` scales a push's gradient as a
whole (the rows it touches on one shard). Imports numpy only.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from .optimizers import Adagrad, Optimizer, SpecError, from_wire
from .optimizers import Constant as _ConstantSchedule

__all__ = [
    "DTYPES",
    "MAX_ADMISSION_VALUE",
    "MAX_DIM",
    "MAX_SEED",
    "Admission",
    "Constant",
    "Initializer",
    "Normal",
    "TableSpec",
    "Uniform",
    "Zeros",
    "admission_from_wire",
    "distinct",
    "initial_rows",
    "initializer_from_wire",
    "mix64",
    "put_rows",
    "segment_sum",
    "segment_sums",
    "spec_from_wire",
    "table_key",
]

#: The largest row width a table may have.
MAX_DIM = 65_536
#: Seeds are in 0..MAX_SEED (a signed 64-bit int on the wire).
MAX_SEED = (1 << 63) - 1
#: The row dtypes a table may have.
DTYPES = ("float32",)

_M = np.uint64
_GOLDEN = _M(0x9E3779B97F4A7C15)
_C1 = _M(0xBF58476D1CE4E5B9)
_C2 = _M(0x94D049BB133111EB)
_TWO_POW_32 = 2.0**-32


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (a new array; arithmetic modulo 2**64)."""
    x = x ^ (x >> _M(30))
    x *= _C1
    x ^= x >> _M(27)
    x *= _C2
    x ^= x >> _M(31)
    return x


def _real(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(name, f"{owner} {name} must be a finite number, got {value!r}")
    return float(value)


# -- initializers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Initializer:
    """How a new row's value is made from its id (:func:`initial_rows`)."""

    type: ClassVar[str] = ""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for f in fields(self):
            object.__setattr__(self, f.name, _real(owner, f.name, getattr(self, f.name)))
        self._check()

    def _check(self) -> None:
        """Checks of more than one field."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class Zeros(Initializer):
    """Every entry 0."""

    type: ClassVar[str] = "zeros"


@dataclass(frozen=True)
class Constant(Initializer):
    """Every entry ``value``."""

    type: ClassVar[str] = "constant"
    value: float = 0.0


@dataclass(frozen=True)
class Uniform(Initializer):
    """Entries uniform in ``[low, high)``."""

    type: ClassVar[str] = "uniform"
    low: float = -0.05
    high: float = 0.05

    def _check(self) -> None:
        if not self.low <= self.high:
            raise SpecError("high", f"Uniform needs low <= high, got {self.low} and {self.high}")


@dataclass(frozen=True)
class Normal(Initializer):
    """Entries normal with ``mean`` and ``std`` (not truncated)."""

    type: ClassVar[str] = "normal"
    std: float = 0.01
    mean: float = 0.0

    def _check(self) -> None:
        if self.std < 0:
            raise SpecError("std", f"Normal std must be >= 0, got {self.std}")


_INITIALIZERS: dict[str, type[Initializer]] = {
    c.type: c for c in (Zeros, Constant, Uniform, Normal)
}


def initializer_from_wire(spec: Any) -> Initializer:
    """Parse an initializer map (``{"type": "normal", "std": 0.01}``); ``SpecError`` (its
    ``field`` the path, e.g. ``"initializer.std"``) for anything else."""
    if not isinstance(spec, Mapping):
        raise SpecError("initializer", "initializer must be a map like {'type': 'zeros'}")
    kind = spec.get("type")
    cls = _INITIALIZERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SpecError(
            "initializer.type", f"unknown initializer type {kind!r}; known: {sorted(_INITIALIZERS)}"
        )
    names = {f.name for f in fields(cls)}
    extra = sorted(str(k) for k in set(spec) - names - {"type"})
    if extra:
        raise SpecError(
            f"initializer.{extra[0]}",
            f"initializer {kind!r} has no field(s) {extra}; fields: {sorted(names)}",
        )
    try:
        return cls(**{k: v for k, v in spec.items() if k != "type"})
    except SpecError as exc:
        raise SpecError(f"initializer.{exc.field}", str(exc)) from None


# -- admission and eviction -----------------------------------------------------------------

#: The largest ``min_count``, ``ttl`` and ``max_rows`` an Admission takes.
MAX_ADMISSION_VALUE = (1 << 62) - 1


@dataclass(frozen=True)
class Admission:
    """Which ids get a row, and when rows are dropped, on each shard (all off by default):

    * ``min_count``: an id gets a row on the push that brings the pushes naming it to
      ``min_count`` (a push counts an id once); before, its pushes are counted, not stored,
      and a pull answers the initializer's row. 1: every pushed id gets a row at once.
    * ``ttl``: a row no push updated for ``ttl`` of the table's updates on its shard is
      evicted (checked every ``max(1, ttl // 8)`` updates). ``None``: never.
    * ``max_rows``: a shard keeps at most this many rows of the table, evicting the least
      recently updated ones to make room. ``None``: up to the shard's ``--max-table-rows``
      (past which pushes are refused, 413).

    An evicted row is forgotten whole: a later push starts it again from the initializer."""

    min_count: int = 1
    ttl: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        rules = (("min_count", 1, False), ("ttl", 1, True), ("max_rows", 1, True))
        for name, low, optional in rules:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise SpecError(
                    f"admission.{name}",
                    f"Admission.{name} must be an int >= {low}"
                    + (" or None" if optional else "")
                    + f", got {value!r}",
                )
            if not low <= value <= MAX_ADMISSION_VALUE:
                raise SpecError(
                    f"admission.{name}",
                    f"Admission.{name} must be in {low}..2**62-1, got {value}",
                )
            object.__setattr__(self, name, int(value))

    @property
    def off(self) -> bool:
        """Whether every rule is off (every pushed id gets a row; none is evicted)."""
        return self.min_count == 1 and self.ttl is None and self.max_rows is None

    def to_wire(self) -> dict[str, Any]:
        return {"min_count": self.min_count, "ttl": self.ttl, "max_rows": self.max_rows}


def admission_from_wire(spec: Any) -> Admission:
    """Parse an admission map; ``SpecError`` naming the field."""
    if not isinstance(spec, Mapping):
        raise SpecError("admission", "admission must be a map {min_count, ttl, max_rows}")
    known = {f.name for f in fields(Admission)}
    extra = sorted(str(k) for k in set(spec) - known)
    if extra:
        raise SpecError(
            f"admission.{extra[0]}", f"admission has no field(s) {extra}; fields: {sorted(known)}"
        )
    return Admission(**spec)


# -- the spec -------------------------------------------------------------------------------


def _default_initializer() -> Initializer:
    return Uniform()


def _default_optimizer() -> Optimizer:
    return Adagrad(lr=0.1)


@dataclass(frozen=True)
class TableSpec:
    """An embedding table's spec: fixed when the table is created (a create with another spec
    is refused, 409 naming the field)."""

    dim: int
    dtype: str = "float32"
    initializer: Initializer = field(default_factory=_default_initializer)
    optimizer: Optimizer = field(default_factory=_default_optimizer)
    seed: int = 0
    admission: Admission = field(default_factory=Admission)

    def __post_init__(self) -> None:
        dim = self.dim
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise SpecError("dim", f"dim must be an int in 1..{MAX_DIM}, got {dim!r}")
        if not 1 <= dim <= MAX_DIM:
            raise SpecError("dim", f"dim must be in 1..{MAX_DIM}, got {dim}")
        object.__setattr__(self, "dim", int(dim))
        dtype = self.dtype
        if isinstance(dtype, np.dtype) or (
            isinstance(dtype, type) and issubclass(dtype, np.generic)
        ):
            dtype = np.dtype(dtype).name
        if dtype not in DTYPES:
            raise SpecError("dtype", f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.initializer, Initializer):
            raise SpecError(
                "initializer",
                "initializer must be Zeros(), Constant(v), Uniform(low, high) or Normal(std), "
                f"got {self.initializer!r}",
            )
        if not isinstance(self.optimizer, Optimizer):
            raise SpecError(
                "optimizer",
                f"optimizer must be a spec of client_sdk.optimizers, got {self.optimizer!r}",
            )
        schedule = getattr(self.optimizer, "schedule", None)
        if schedule is not None and type(schedule) is not _ConstantSchedule:
            raise SpecError(
                "optimizer.schedule",
                "an embedding table's optimizer takes no schedule: each row counts its own "
                "updates; use a constant learning rate",
            )
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise SpecError("seed", f"seed must be an int in 0..2**63-1, got {seed!r}")
        if not 0 <= seed <= MAX_SEED:
            raise SpecError("seed", f"seed must be in 0..2**63-1, got {seed}")
        object.__setattr__(self, "seed", int(seed))
        if not isinstance(self.admission, Admission):
            raise SpecError(
                "admission",
                "admission must be client_sdk.embedding.Admission(min_count, ttl, max_rows), "
                f"got {self.admission!r}",
            )

    def to_wire(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "dtype": self.dtype,
            "initializer": self.initializer.to_wire(),
            "optimizer": self.optimizer.to_wire(),
            "seed": self.seed,
            "admission": self.admission.to_wire(),
        }


def spec_from_wire(spec: Any) -> TableSpec:
    """Parse a table spec map; ``SpecError`` naming the field (its path, e.g.
    ``"optimizer.lr"``) for anything that is not a valid spec."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "the table spec must be a map {dim, dtype, initializer, ...}")
    known = {f.name for f in fields(TableSpec)}
    extra = sorted(str(k) for k in set(spec) - known)
    if extra:
        raise SpecError(extra[0], f"a table spec has no field(s) {extra}; fields: {sorted(known)}")
    if "dim" not in spec:
        raise SpecError("dim", "a table spec needs 'dim'")
    args: dict[str, Any] = {k: spec[k] for k in ("dim", "dtype", "seed") if k in spec}
    if spec.get("initializer") is not None:
        args["initializer"] = initializer_from_wire(spec["initializer"])
    if spec.get("optimizer") is not None:
        try:
            args["optimizer"] = from_wire(spec["optimizer"])
        except SpecError as exc:
            raise SpecError(f"optimizer.{exc.field}", str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise SpecError("optimizer", str(exc)) from None
    if spec.get("admission") is not None:
        args["admission"] = admission_from_wire(spec["admission"])
    return TableSpec(**args)


# -- the first value of a row ---------------------------------------------------------------


def table_key(seed: int, name: str) -> int:
    """The 64-bit key of a table's initializer: blake2b-64 of the seed's 8 little-endian bytes
    followed by the name's UTF-8 bytes, read little-endian."""
    data = int(seed).to_bytes(8, "little") + name.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _bits(row_keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """``mix64(row_key + counter * GOLDEN)`` for every (row, counter): shape [n, len(counters)]."""
    return mix64(row_keys[:, None] + counters[None, :] * _GOLDEN)


def _halves(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The high and the low 32 bits of each entry, each as a float64 in [0, 1) (times 2**-32)."""
    high = (bits >> _M(32)).view(np.int64).astype(np.float64)  # int64 converts faster
    low = (bits & _M(0xFFFFFFFF)).view(np.int64).astype(np.float64)
    high *= _TWO_POW_32
    low *= _TWO_POW_32
    return high, low


def initial_rows(spec: TableSpec, name: str, ids: np.ndarray) -> np.ndarray:
    """The initial rows of ``ids`` (int64, shape [n]) in table ``name``: float32 [n, dim].

    Row key ``r = mix64(table_key(seed, name) + id * G)`` (the id's two's-complement bits as a
    uint64, ``G = 0x9E3779B97F4A7C15``, arithmetic modulo 2**64); ``bits(k) = mix64(r + k *
    G)``; ``hi(k)`` and ``lo(k)`` are its high and low 32 bits times 2**-32 (in [0, 1)).
    ``Uniform(low, high)``: column ``2k - 2`` is ``low + (high - low) * hi(k)`` and column
    ``2k - 1`` is ``low + (high - low) * lo(k)``, for k = 1, 2, ... ``Normal(std, mean)``:
    column ``c`` is ``mean + std * sqrt(-2 ln(1 - hi(c + 1))) * cos(2 pi lo(c + 1))``
    (Box-Muller, not truncated). Computed in float64, rounded to float32 (to nearest)."""
    init = spec.initializer
    n, dim = len(ids), spec.dim
    if type(init) is Zeros:
        return np.zeros((n, dim), np.float32)
    if type(init) is Constant:
        return np.full((n, dim), init.value, np.float32)
    keys = np.asarray(ids, dtype=np.int64).view(np.uint64)
    row_keys = mix64(_M(table_key(spec.seed, name)) + keys * _GOLDEN)
    if type(init) is Uniform:
        pairs = (dim + 1) // 2
        high, low = _halves(_bits(row_keys, np.arange(1, pairs + 1, dtype=np.uint64)))
        u = np.empty((n, 2 * pairs), np.float64)
        u[:, 0::2] = high
        u[:, 1::2] = low
        u = u[:, :dim]
        u *= init.high - init.low
        u += init.low
        return u.astype(np.float32)
    assert type(init) is Normal
    u1, u2 = _halves(_bits(row_keys, np.arange(1, dim + 1, dtype=np.uint64)))
    np.subtract(1.0, u1, out=u1)  # in (0, 1]: its log is finite
    np.log(u1, out=u1)
    u1 *= -2.0
    np.sqrt(u1, out=u1)
    u2 *= 2.0 * math.pi
    np.cos(u2, out=u2)
    u1 *= u2
    u1 *= init.std
    u1 += init.mean
    return u1.astype(np.float32)


#: Above this many repeats of one id, :func:`segment_sum` adds with ``np.add.reduceat``.
_MAX_LEVELS = 64


def _stable_order(ids: np.ndarray) -> np.ndarray:
    """``np.argsort(ids, kind="stable")`` of int64 ``ids`` [n >= 1], sorted 16 bits at a time
    from the lowest (LSD radix: numpy sorts 16-bit keys stably by counting, in one pass) over
    the bits the ids' span needs: 1 pass for ids within 65,536 of each other, 2 within 2^32,
    at most 4; quicker than a comparison sort of the int64s, by 4x for a batch of 4,096 ids
    spanning 10^6."""
    low = ids.min()
    span = int(ids.max()) - int(low)
    offset: np.ndarray = ids.view(np.uint64) - low.view(np.uint64)  # modulo 2^64: exact
    # (a cast to uint16 keeps the low 16 bits; the methods skip numpy's Python wrappers: on a
    # batch whose memory is out of the cache, each call costs more than its arithmetic)
    order: np.ndarray = offset.astype(np.uint16).argsort(kind="stable")
    shift = 16
    while shift < 64 and span >> shift:
        key = (offset >> _M(shift)).astype(np.uint16)
        order = order[key[order].argsort(kind="stable")]
        shift += 16
    return order


def _segments(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(order, first, starts, unique)`` of int64 ``ids`` [n >= 1]: the stable sorting
    permutation, whether each sorted position starts a run of one id, where the runs start,
    and the distinct ids (sorted)."""
    order = _stable_order(ids)
    ordered = ids[order]
    first = np.empty(len(ids), dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = first.nonzero()[0]
    return order, first, starts, ordered[starts]


def distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique ids, sorted; inverse)``, ``unique[inverse] == ids``: what
    ``np.unique(ids, return_inverse=True)`` gives for int64 ``ids`` [n], in fewer passes."""
    if not len(ids):
        return ids, np.zeros(0, np.int64)
    order, first, _, unique = _segments(ids)
    inverse = np.empty(len(ids), np.int64)
    inverse[order] = first.cumsum() - 1
    return unique, inverse


def segment_sum(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique ids, sorted; the sum of each one's gradient rows)``: sort-based, the rows of an
    id added in the order given (first + second, + third, ...; for an id given more than
    ``_MAX_LEVELS + 1`` times, in ``np.add.reduceat``'s pairwise order). Ids already distinct
    and sorted come back as they are (no copy). The sums are :func:`segment_sums`' gathered."""
    unique, base, index = segment_sums(ids, grads)
    return unique, base if index is None else base.take(index, axis=0)


def segment_sums(
    ids: np.ndarray, grads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`segment_sum` but for its last gather: ``(unique, base, index)``, the sum of
    ``unique[k]`` being row ``index[k]`` of ``base`` (row ``k`` where ``index`` is ``None``).
    A caller that splits the sums (a push through several shards) gathers each part from
    ``base`` once (``base[index[positions]]``), instead of gathering all of them in order and
    then each part again.

    After a stable sort, each row's rank among its id's rows is known. The rows are gathered
    once into a level-major copy: first the rank-0 row of every id, then the rank-1 rows, and
    so on, each level's rows in the same order of ids, the ids with the most rows first. The
    ids that have a rank-r row are then the first ones of the rank-0 block, so each level is
    one in-place add of a contiguous block into a prefix of the sums (a batch repeats an id a
    few times: a few adds); ``index`` is each id's place in that order."""
    n = len(ids)
    if n < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, grads, None
    order, first, starts, unique = _segments(ids)
    u = len(starts)
    if u == n:
        return unique, grads, order
    lengths = np.empty(u, np.int64)
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    lengths[-1] = n - starts[-1]
    levels = int(lengths.max())
    if levels > _MAX_LEVELS + 1:
        return unique, np.add.reduceat(grads[order], starts, axis=0), None
    # Each id's place among the ids ordered by their row count, most first (stable).
    by_count = (levels - lengths).astype(np.uint8).argsort(kind="stable")
    place = np.empty(u, np.int64)
    place[by_count] = np.arange(u)
    # have[r]: the ids with a rank-r row; level r's block starts at offsets[r].
    have = u - np.bincount(lengths, minlength=levels + 1).cumsum()[:-1]
    offsets = have.cumsum() - have
    segment = first.cumsum() - 1  # each sorted row's id (its number among unique)
    rank = np.arange(n) - starts[segment]
    source = np.empty(n, np.int64)
    source[offsets[rank] + place[segment]] = order
    work = grads.take(source, axis=0)
    for count, at in zip(have[1:].tolist(), offsets[1:].tolist()):
        work[:count] += work[at : at + count]
    return unique, work, place


def put_rows(dest: np.ndarray, where: np.ndarray, rows: np.ndarray) -> None:
    """``dest[where] = rows``: rows ``where`` (distinct, valid row numbers) of the 2-d array
    ``dest`` set to ``rows`` (of its dtype and width). Where both are C-contiguous, each row
    is copied as one item (a void of the row's bytes), which numpy does with one ``memcpy``
    per row instead of a loop over its columns: about twice as fast for rows of 64 float32.
    (Reading rows is ``np.take(a, where, axis=0)``, as fast; with ``out=``, pass
    ``mode="clip"``, or numpy gathers into a copy of ``out`` first.)"""
    if not (
        dest.ndim == rows.ndim == 2
        and dest.shape[1] == rows.shape[1] > 0
        and dest.dtype == rows.dtype
        and dest.flags.c_contiguous
        and rows.flags.c_contiguous
    ):
        dest[where] = rows
        return
    item = np.dtype((np.void, dest.shape[1] * dest.itemsize))
    dest.view(item).reshape(-1).put(where, rows.view(item).reshape(-1), mode="clip")
