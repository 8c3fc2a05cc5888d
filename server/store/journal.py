"""The one point every write of a shard's state passes: :func:`journaled`.

Each method that changes the state (the store's ``init``, ``push``, ``push_async``,
``assign``, ``increment``, ``set_optimizer``, ``delete``, ``close_rounds``; the embedding
tables' ``create`` and ``push``) is marked ``@journaled``. When the store has a
:class:`Journal` (``store.journal``: a shard that replicates, :mod:`server.replication.log`),
the mark tells it of the call twice: :meth:`Journal.begin` before the method runs, with the
method's name and its arguments as the caller passed them (the journal may refuse the write
here, as a backup does: nothing has run), and :meth:`Journal.commit` once it is sure to take
effect: where the write calls :func:`decided` (after its last check and before its first
change, with no ``await`` from there to its last change: a push applied on the event loop), or
else once it returned, with no ``await`` in between the method's last change and the commit.
So the order of the commits is the order the changes took effect, and a write the method
refuses (it raises before :func:`decided`) is never committed: it changed nothing. After
:func:`decided` a write must not raise (nothing it does there can be refused). Without a
journal (a shard with no replicas) the mark costs one attribute read.

A journal replays a call by calling the same method with the same arguments inside
:func:`replaying`: the mark then only calls through, so a replayed write is neither refused
nor journaled again (the replayer keeps its own record of it).

The store must never change its state outside a marked method (tests/shard/test_replication.py
drives every write verb and compares a backup's state with its primary's): the time-driven
close of sync rounds goes through ``close_rounds``, which is marked, with the rounds a clock
found due as its arguments.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

__all__ = ["Journal", "decided", "journaled", "journaled_methods", "replaying"]

F = TypeVar("F", bound=Callable[..., Any])

#: Set (per task) while a journal replays calls: the marks call through.
_REPLAYING: ContextVar[bool] = ContextVar("paramshard_replaying", default=False)
#: The journaled write running now (per task) whose commit has not been made yet:
#: ``[journal, begun]`` (``begun`` becomes ``_COMMITTED`` once :func:`decided` made it).
_PENDING: ContextVar[list[Any] | None] = ContextVar("paramshard_pending", default=None)
_COMMITTED = object()


class Journal(Protocol):
    """What a store tells of its writes (module docstring)."""

    def begin(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A write ``method`` is about to run on these arguments (may raise ``ShardError``:
        the write is refused, nothing ran). Returns what :meth:`commit` is given."""

    def commit(self, begun: Any) -> None:
        """The write begun returned: it took effect, after every write committed before."""


def journaled(method: F) -> F:
    """Mark ``method`` (of an object with a ``journal`` attribute: a journal or ``None``) as a
    write: its calls are begun and committed in the journal, under its qualified name
    (``Writes.push``, ``EmbeddingTables.create``)."""
    name = method.__qualname__
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def write_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            journal = self.journal
            if journal is None or _REPLAYING.get():
                return await method(self, *args, **kwargs)
            pending = [journal, journal.begin(name, args, kwargs)]
            token = _PENDING.set(pending)
            try:
                result = await method(self, *args, **kwargs)
            finally:
                _PENDING.reset(token)
            _commit(pending)
            return result

        write_async.journaled = True  # type: ignore[attr-defined]
        return write_async  # type: ignore[return-value]

    @functools.wraps(method)
    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        journal = self.journal
        if journal is None or _REPLAYING.get():
            return method(self, *args, **kwargs)
        pending = [journal, journal.begin(name, args, kwargs)]
        token = _PENDING.set(pending)
        try:
            result = method(self, *args, **kwargs)
        finally:
            _PENDING.reset(token)
        _commit(pending)
        return result

    write.journaled = True  # type: ignore[attr-defined]
    return write  # type: ignore[return-value]


def decided() -> None:
    """The journaled write running now can no longer be refused and is about to make its first
    change: commit it now (its entry is taken, and may go to the backups while the write
    applies). Called by the store where that point is reached with no ``await`` before the
    write's last change; a no-op outside a journaled write, when replaying, or once called."""
    pending = _PENDING.get()
    if pending is not None:
        _commit(pending)


def _commit(pending: list[Any]) -> None:
    begun = pending[1]
    if begun is not _COMMITTED:
        pending[1] = _COMMITTED
        pending[0].commit(begun)


def journaled_methods(cls: type) -> list[str]:
    """The names of ``cls``'s methods marked :func:`journaled`."""
    return sorted(
        name for name in dir(cls) if getattr(getattr(cls, name, None), "journaled", False) is True
    )


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Within the block (in this task and what it awaits), marked methods call through."""
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)
