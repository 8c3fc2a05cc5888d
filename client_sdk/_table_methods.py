"""The embedding-table methods of :class:`~client_sdk.PSClient` and
:class:`~client_sdk.AsyncPSClient` (mixed into each; they differ only by ``await``): each drives
a flow of ``_verbs/tables.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import _verbs
from ._core import Core
from ._exceptions import BadRequestError
from ._flow import Flow
from .embedding import Admission, Initializer, TableSpec
from .optimizers import Optimizer, SpecError

__all__ = ["AsyncTableMethods", "TableMethods", "table_spec"]

T = TypeVar("T")


def table_spec(
    dim: Any,
    dtype: Any,
    initializer: Initializer | None,
    optimizer: Optimizer | None,
    seed: Any,
    admission: Admission | None = None,
) -> TableSpec:
    """The spec of ``create_table``'s arguments; :class:`BadRequestError` naming the field."""
    args: dict[str, Any] = {"dim": dim, "dtype": dtype, "seed": seed}
    if admission is not None:
        args["admission"] = admission
    if initializer is not None:
        args["initializer"] = initializer
    if optimizer is not None:
        args["optimizer"] = optimizer
    try:
        return TableSpec(**args)
    except SpecError as exc:
        raise BadRequestError(f"create_table: {exc}", details={"field": exc.field}) from None


class TableMethods:
    """``create_table``, ``pull_rows``, ``push_rows`` of the blocking client."""

    _core: Core

    if TYPE_CHECKING:

        def _drive(self, flow: Flow[T]) -> T: ...

    def create_table(
        self,
        name: str,
        dim: int,
        dtype: str = "float32",
        *,
        initializer: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int = 0,
        admission: Admission | None = None,
    ) -> bool:
        """Create embedding table ``name`` unless it exists; True if this call created it.
        Blocks.

        Rows are ``dim`` float32 numbers keyed by any int64 id. A row starts, on its first
        push, from ``initializer`` (default ``Uniform(-0.05, 0.05)``; a pure function of
        ``seed``, the name and the id, so the same on any number of shards), and is updated by
        ``optimizer`` (default ``Adagrad(lr=0.1)``; no schedule) with its own slots and step
        count. ``admission`` (:class:`~client_sdk.embedding.Admission`: ``min_count``,
        ``ttl``, ``max_rows``) says which ids get a row and when rows are evicted (default:
        every pushed id, none evicted). Any worker may call it; the same spec again is no
        error. Raises
        :class:`ConflictError` for a dense variable of that name or a table made with another
        spec (naming the field), :class:`BadRequestError` for a bad spec.
        """
        spec = table_spec(dim, dtype, initializer, optimizer, seed, admission)
        return self._drive(_verbs.create_table(self._core, name, spec))

    def pull_rows(self, name: str, ids: Any, *, allow_backup: bool = False) -> np.ndarray:
        """The rows of ``ids`` (int64, repeats allowed) as a new float32 array [len(ids),
        dim]. Blocks. An id never pushed gets its initializer's row (nothing is stored). With
        ``PSClient(wire_dtype=)`` the rows travel in that dtype (rounded to nearest); a row
        beyond float16's range is :class:`BadTensorError` naming the table.
        ``allow_backup=True``: a backup of each shard may answer, as for
        :meth:`PSClient.pull <client_sdk.PSClient.pull>`."""
        core = self._core.backup_reads() if allow_backup else self._core
        return self._drive(_verbs.pull_rows(core, name, ids))

    def push_rows(self, name: str, ids: Any, grads: Any) -> dict[str, Any]:
        """Apply ``grads`` [len(ids), dim] to rows ``ids`` with the table's optimizer. Blocks.

        Repeated ids' gradients are summed first, then each row is updated once. Each shard's
        part is applied whole or not at all, once (retried safely). Returns ``{"rows",
        "created", "counted", "duplicate"}`` (``counted``: ids not admitted yet, whose
        gradients were dropped: the table's ``Admission.min_count``). Raises
        :class:`BadTensorError` for ids that are not integers, grads of the wrong shape, NaN or
        infinities (nothing applied on that shard), or, with ``PSClient(wire_dtype=
        "float16")``, a summed gradient beyond float16's range (nothing sent).
        """
        return self._drive(_verbs.push_rows(self._core, name, ids, grads))


class AsyncTableMethods:
    """``create_table``, ``pull_rows``, ``push_rows`` of the asyncio client, as
    :class:`TableMethods`."""

    _core: Core

    if TYPE_CHECKING:

        async def _drive(self, flow: Flow[T]) -> T: ...

    async def create_table(
        self,
        name: str,
        dim: int,
        dtype: str = "float32",
        *,
        initializer: Initializer | None = None,
        optimizer: Optimizer | None = None,
        seed: int = 0,
        admission: Admission | None = None,
    ) -> bool:
        """:meth:`PSClient.create_table <client_sdk.PSClient.create_table>`, awaited."""
        spec = table_spec(dim, dtype, initializer, optimizer, seed, admission)
        return await self._drive(_verbs.create_table(self._core, name, spec))

    async def pull_rows(self, name: str, ids: Any, *, allow_backup: bool = False) -> np.ndarray:
        """:meth:`PSClient.pull_rows <client_sdk.PSClient.pull_rows>`, awaited."""
        core = self._core.backup_reads() if allow_backup else self._core
        return await self._drive(_verbs.pull_rows(core, name, ids))

    async def push_rows(self, name: str, ids: Any, grads: Any) -> dict[str, Any]:
        """:meth:`PSClient.push_rows <client_sdk.PSClient.push_rows>`, awaited."""
        return await self._drive(_verbs.push_rows(self._core, name, ids, grads))
