"""Step groups: a list of variables registered once, then pulled and pushed as one buffer.

A worker that pulls and pushes the same many small variables every step registers them as a
*group* (``POST /v1/groups``, docs/PROTOCOL.md §3, Step groups). The shard checks the list
once — names it owns, existing, distinct, dense variables of one dtype, at most
``--max-request-names`` of them, their bytes within ``--max-request-bytes`` — and keeps the
variables in order (:class:`Group`); a group's pull then answers the values as one body
(the variables' bytes back to back, in the group's order, no padding) with the versions as one
int64 array, and a group's push takes the gradients the same way. Neither names a variable on
the wire nor looks a name up.

What a group is not: state. It holds no value and changes nothing; a group push is an ordinary
push of its variables (one operation with the push's ``worker_id`` and ``seq``, journaled and
replicated as a push by name: :meth:`~server.store.ParameterStore.push`), so a backup needs no
group to apply it. Groups are not in snapshots and not replicated: a restarted shard, a backup
promoted to primary, or a shard that let the group go (it keeps at most :data:`MAX_GROUPS`,
the least recently used goes first) answers its id with 404 ``unknown_group``, and the client
registers the list again (the SDK does, unseen). A group's id names the shard's start and a
counter, so an id is never taken for another list.

A group stays right as variables come and go: it holds the :class:`Variable` objects, and once
a delete ran (:attr:`~server.store.state.StoreState.deletions` moved) or the state was replaced
whole (a backup brought up to date by a snapshot), each use first checks that every name still
holds the same variable: if one was deleted (or deleted and made again, whatever its shape),
each use of the group is refused with 409 ``group_stale``, telling the client to make
the group again; it never answers another variable's bytes. A delete makes the groups holding a
deleted variable stale at once and they let go of their variables (:meth:`Groups.released`),
so no group keeps a deleted value's memory alive.

No HTTP in here; the event-loop thread only.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ShardError
from .checks import native
from .variable import export_all

if TYPE_CHECKING:
    from .state import StoreState
    from .variable import Variable

__all__ = [
    "MAX_GROUPS",
    "Group",
    "GroupGrads",
    "GroupRows",
    "GroupVersions",
    "Groups",
    "RowsApplied",
]

#: Groups a shard keeps; registering one more lets the least recently used go (its client
#: registers it again on its next use, as after a restart).
MAX_GROUPS = 1024


class Group:
    """One registered list of variables, in order, and what its pulls and pushes need."""

    __slots__ = (
        "id",
        "names",
        "variables",
        "gone",
        "dtype",
        "shapes",
        "sizes",
        "nbytes",
        "uniform",
        "pushable",
        "checked_at",
        "pull_head",
    )

    def __init__(self, gid: str, variables: list[Variable], checked_at: tuple[int, int]) -> None:
        self.id = gid
        self.variables = variables
        #: The names deleted since the group was made, once it is found stale (it then holds
        #: no variable: a deleted value is not kept alive by a group).
        self.gone: list[str] | None = None
        self.names = [v.name for v in variables]
        first = variables[0].value
        self.dtype: np.dtype = first.dtype
        self.shapes = [v.value.shape for v in variables]
        self.sizes = [v.value.size for v in variables]
        self.nbytes = sum(v.value.nbytes for v in variables)
        #: Every variable of one shape (with at least one element): the gradients are then the
        #: rows of one ``(count, *shape)`` block, checked and applied as a table's are.
        self.uniform: tuple[int, ...] | None = (
            first.shape if first.size and all(s == first.shape for s in self.shapes) else None
        )
        #: Gradients may be pushed to it: its one dtype is a float one (the store's
        #: :func:`~server.store.checks.check_dtypes_and_shapes`, once for the group).
        self.pushable = self.dtype.kind == "f"
        #: The store's (deletions, restores) when the variables were last found current.
        self.checked_at = checked_at
        #: What a pull's reply body holds besides the versions and values, which never
        #: changes for a group: the bytes before the versions, and those between them and
        #: the values (:func:`server.routes_groups.group_pull_reply`); made at the first pull.
        self.pull_head: tuple[bytes, bytes] | None = None

    def describe(self) -> dict[str, Any]:
        """The registration's answer (docs/PROTOCOL.md, Step groups)."""
        return {
            "group": self.id,
            "names": self.names,
            "dtype": self.dtype.str,
            "shapes": [list(s) for s in self.shapes],
            "nbytes": self.nbytes,
            "versions": [v.version for v in self.variables],
        }

    def versions(self) -> np.ndarray:
        """The variables' versions, in order, as one int64 array."""
        return np.fromiter([v.version for v in self.variables], np.int64, len(self.variables))

    def read(self, as_arrays: bool) -> tuple[np.ndarray, list[Any]]:
        """The versions and the values at this instant: the values as the pieces of one flat
        body, read-only views of the live memory (:meth:`Variable.export
        <server.store.variable.Variable.export>`: no update writes them while the pieces are
        held), or one piece, the slab's block, when the group is one slab's members in its
        order, all home. ``as_arrays``: the pieces as ndarrays (for a vectored write, which
        takes any buffer), else byte memoryviews."""
        variables = self.variables
        values = export_all(variables)
        versions = self.versions()
        slab = variables[0]._slab
        if slab is not None and not slab.away and variables == slab.members:
            return versions, [slab.whole(tuple(values))]
        if as_arrays:
            return versions, values
        return versions, [a.reshape(-1).view(np.uint8).data for a in values]

    def split(self, flat: np.ndarray) -> tuple[GroupGrads, np.ndarray | None]:
        """A flat gradient buffer (the group's dtype, :attr:`nbytes`) as name -> each
        variable's gradient (views, made when asked), and the rows as one block when the
        group is uniform."""
        if self.uniform is not None:
            block = flat.reshape(len(self.names), *self.uniform)
            return GroupGrads(self, block), block
        return GroupGrads(self, flat), None

    def cut(self, flat: np.ndarray) -> list[np.ndarray]:
        """A flat buffer of the group's dtype and :attr:`nbytes` as each variable's part
        (views, in order)."""
        out = []
        at = 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(flat[at : at + size].reshape(shape))
            at += size
        return out


class GroupGrads(Mapping[str, np.ndarray]):
    """A group push's gradients as name -> gradient (a view of the request's body), made
    without a step per variable: the store takes a current group's :meth:`rows` as they are
    (:meth:`Writes.push <server.store.writes.Writes.push>`), while anything else (the journal,
    a push whose group went stale meanwhile) reads it as a mapping."""

    __slots__ = ("_group", "_data", "_rows", "_index")

    def __init__(self, group: Group, data: np.ndarray) -> None:
        self._group = group
        #: The block of rows (a uniform group) or the flat buffer.
        self._data = data
        self._rows: list[np.ndarray] | None = None
        self._index: dict[str, int] | None = None

    def rows(self) -> list[np.ndarray]:
        """The gradients in the group's order."""
        if self._rows is None:
            group = self._group
            self._rows = list(self._data) if group.uniform is not None else group.cut(self._data)
        return self._rows

    def ordered(self) -> GroupRows:
        """The gradients in the group's order, cut into one array per variable only when read
        one by one: an update of the whole block (a slab's) needs just their count."""
        return GroupRows(self)

    def __getitem__(self, name: str) -> np.ndarray:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._group.names)}
        return self.rows()[self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group.names)

    def __len__(self) -> int:
        return len(self._group.names)


class GroupRows(Sequence[np.ndarray]):
    """:meth:`GroupGrads.rows` as a sequence whose length is known without making the rows."""

    __slots__ = ("_grads",)

    def __init__(self, grads: GroupGrads) -> None:
        self._grads = grads

    def __len__(self) -> int:
        return len(self._grads._group.names)

    def __getitem__(self, i: Any) -> Any:
        return self._grads.rows()[i]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self._grads.rows())


class GroupVersions(Mapping[str, int]):
    """A group push's ``versions`` (each gradient's version, as the worker pulled it) as name
    -> version over the int64 array the request carries, made without a step per variable;
    :class:`RowsApplied` takes the array as it is."""

    __slots__ = ("_group", "array", "_values", "_index")

    def __init__(self, group: Group, array: np.ndarray) -> None:
        self._group = group
        #: The versions in the group's order (int64, one per variable).
        self.array = array
        self._values: list[int] | None = None
        self._index: dict[str, int] | None = None

    def __getitem__(self, name: str) -> int:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._group.names)}
            self._values = self.array.tolist()
        return self._values[self._index[name]]  # type: ignore[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group.names)

    def __len__(self) -> int:
        return len(self._group.names)


class RowsApplied(Mapping[str, dict[str, Any]]):
    """A step group's push applied whole (:meth:`Writes.push
    <server.store.writes.Writes.push>` with its group): name -> ``{"status": "applied",
    "version", "staleness"}`` as any push answers, each entry made only when asked;
    :attr:`versions` holds the new versions in the group's order."""

    __slots__ = ("_variables", "versions", "_held", "_index")

    def __init__(
        self, variables: list[Variable], versions: list[int], held: Mapping[str, int] | None
    ) -> None:
        self._variables = variables
        self.versions = versions
        self._held = held
        self._index: dict[str, int] | None = None

    def worst(self) -> int | None:
        """The largest staleness (the version a gradient was applied to less the one it was
        computed on), or None if the push said no version."""
        held = self._held
        if not held:
            return None
        if isinstance(held, GroupVersions) and len(held.array) == len(self.versions):
            return int((np.array(self.versions, np.int64) - held.array).max()) - 1
        names = [var.name for var in self._variables]
        if len(held) != len(names):
            seen = [(i, held[n]) for i, n in enumerate(names) if n in held]
            if not seen:
                return None
            return max(self.versions[i] - 1 - v for i, v in seen)
        before = np.array(self.versions, np.int64)
        before -= np.fromiter(map(held.__getitem__, names), np.int64, len(names))
        return int(before.max()) - 1

    def __getitem__(self, name: str) -> dict[str, Any]:
        if self._index is None:
            self._index = {var.name: i for i, var in enumerate(self._variables)}
        i = self._index[name]
        version = self.versions[i]
        seen = self._held.get(name) if self._held else None
        staleness = None if seen is None else version - 1 - seen
        return {"status": "applied", "version": version, "staleness": staleness}

    def __iter__(self) -> Iterator[str]:
        return (var.name for var in self._variables)

    def __len__(self) -> int:
        return len(self._variables)


class Groups:
    """A shard's groups by id (module docstring). Registering the same list again gives the
    same group while the shard keeps it."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(4)
        self._count = 0
        self._by_id: OrderedDict[str, Group] = OrderedDict()
        self._by_names: dict[tuple[str, ...], str] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def clear(self) -> None:
        self._by_id.clear()
        self._by_names.clear()

    def released(self, deleted: list[Variable]) -> None:
        """``deleted`` were just deleted: every group holding one of them becomes stale now
        and lets go of its variables, so that no group keeps a deleted value alive. Work in
        proportion to the groups' names, on a delete only."""
        if not self._by_id or not deleted:
            return
        ids = {id(v) for v in deleted}
        for group in self._by_id.values():
            if group.gone is None and any(id(v) in ids for v in group.variables):
                _stale(group, [n for n, v in zip(group.names, group.variables) if id(v) in ids])

    def register(
        self, store: StoreState, names: Sequence[Any], max_names: int, max_bytes: int
    ) -> Group:
        """The group of ``names`` (checked whole, nothing kept on a refusal): 400 for an
        empty, too long or repeated list or mixed dtypes, 400/421/404/409 for names as any verb
        (bad, not ours, unknown, a table or a partitioned variable), 413 for more bytes than a
        push may carry."""
        if not names:
            raise ShardError(
                "bad_request",
                "groups: 'names' is empty: a group needs at least one variable",
                {"field": "names"},
            )
        if len(names) > max_names:
            raise ShardError(
                "bad_request",
                f"groups: {len(names)} names, more than this shard's limit of {max_names} per "
                "request (--max-request-names): split the variables into several groups",
                {"field": "names", "limit": max_names},
            )
        key = tuple(names)
        gid = self._by_names.get(key)
        if gid is not None:
            have = self._by_id.get(gid)
            if have is not None and self._current(store, have):
                self._by_id.move_to_end(gid)
                return have
        if len(set(key)) != len(key):
            seen: set[Any] = set()
            twice = next(n for n in key if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise ShardError(
                "bad_request",
                f"groups: {twice!r} is named twice: name each variable once",
                {"field": "names", "variable": twice},
            )
        variables = store._existing(store.check_names(key))
        dtypes = {native(v.value.dtype).str for v in variables}
        if len(dtypes) > 1:
            by = {}
            for v in variables:
                by.setdefault(v.value.dtype.str, v.name)
            raise ShardError(
                "bad_request",
                f"groups: the variables have {len(dtypes)} dtypes ({sorted(by)}; e.g. "
                f"{sorted(by.values())}): a group holds variables of one dtype, so make one "
                "group per dtype",
                {"field": "names", "dtypes": by},
            )
        nbytes = sum(v.value.nbytes for v in variables)
        if nbytes > max_bytes:
            raise ShardError(
                "too_large",
                f"groups: the variables hold {nbytes} bytes, more than a push may carry "
                f"(--max-request-bytes {max_bytes}): split them into smaller groups",
                {"field": "names", "nbytes": nbytes, "limit": max_bytes},
            )
        self._count += 1
        group = Group(f"{self._token}-{self._count}", variables, _era(store))
        if gid is not None:
            self._by_id.pop(gid, None)
        self._by_id[group.id] = group
        self._by_names[key] = group.id
        while len(self._by_id) > MAX_GROUPS:
            _, old = self._by_id.popitem(last=False)
            self._by_names.pop(tuple(old.names), None)
        return group

    def get(self, store: StoreState, gid: Any) -> Group:
        """The group ``gid``, its variables current: 404 ``unknown_group`` if this shard does
        not hold it, 409 ``group_stale`` if one of its variables was deleted since (the group
        then stays stale, holding no variable). Changes no state."""
        group = self._by_id.get(gid) if type(gid) is str else None
        if group is None:
            raise ShardError(
                "unknown_group",
                f"this shard holds no group {gid!r} (it restarted, another replica answers "
                "now, or it let the group go): register the names again (POST /v1/groups; "
                "the SDK does this by itself)",
                {"group": gid if isinstance(gid, (str, int)) else repr(gid)},
            )
        if (
            group.gone is None
            and group.checked_at != _era(store)
            and not self._current(store, group)
        ):
            _stale(
                group,
                [n for n, v in zip(group.names, group.variables) if store._vars.get(n) is not v],
            )
        gone = group.gone
        if gone is not None:
            # Kept, without its variables (a refusal changes nothing: the shard's protocol may
            # offer the request to the usual way after this), and refused again at each use,
            # until registering the names again replaces it or it is let go.
            raise ShardError(
                "group_stale",
                f"group {gid!r}: variable(s) {gone[:10]} were deleted (or deleted and made "
                "again) since the group was made, so its layout no longer holds: make the "
                "group again (ps.group(names)) once the variables exist",
                {"group": gid, "variables": gone},
            )
        return group

    @staticmethod
    def _current(store: StoreState, group: Group) -> bool:
        """Whether every name of ``group`` still holds the same variable (then the group is
        marked checked as of now); never for a stale group."""
        if group.gone is not None:
            return False
        known = store._vars
        if all(known.get(n) is v for n, v in zip(group.names, group.variables)):
            group.checked_at = _era(store)
            return True
        return False


def _stale(group: Group, gone: list[str]) -> None:
    """Mark ``group`` stale (``gone``: the names deleted since it was made) and let go of its
    variables."""
    group.gone = gone
    group.variables = []


def _era(store: StoreState) -> tuple[int, int]:
    """What moves whenever a name may stop holding the variable it held."""
    return (store.deletions, store.restores)
