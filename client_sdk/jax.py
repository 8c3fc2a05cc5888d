"""JAX: a pytree of parameters trained through a fleet (``pip install 'paramshard[jax]'``).

    from client_sdk import PSClient
    from client_sdk.jax import bind
    from client_sdk.optimizers import Adagrad

    with PSClient(shards, worker_id="w0") as ps:
        model = bind(ps, params, prefix="mlp", optimizer=Adagrad(lr=0.05))
        model.init()                      # create-if-absent: any worker may call it
        for X, y in batches:
            params = model.pull()         # the same tree, of jax arrays with the fleet's values
            model.push(grad_fn(params, X, y))   # async; model.flush() waits for all of them
        model.flush()

This module imports jax; ``import client_sdk`` never does. Tested with jax 0.4.38 and 0.10
(the extra's range), on the CPU.

**Names.** Each leaf of the tree becomes one variable, named by its path in the tree
(``jax.tree_util.tree_flatten_with_path``): the keys from the root down, joined by ``/``,
after ``prefix``. A dict key or an attribute name stands as it is, a list or tuple index as
its decimal number: ``{"layer1": {"kernel": w}}`` with ``prefix="mlp"`` is ``mlp/layer1/kernel``;
an equinox module's ``layers[0].weight`` is ``layers/0/weight``; Flax's ``{"params":
{"Dense_0": {"kernel": ...}}}`` is ``params/Dense_0/kernel``. The names depend on the tree's
keys alone, not on the order of leaves or on the library that made the tree, so every worker
(and a later run) that binds the same model gets the same names. A key that would make an
invalid variable name (characters outside ``A-Z a-z 0-9 _ . : / -``, or too long) or two
paths with one name (``{"a/b": x, "a": {"b": y}}``) raise :class:`~client_sdk.BadRequestError`
naming the path. Leaves are float arrays (``jax.Array`` or ``numpy.ndarray``, float16/32/64):
another leaf raises :class:`~client_sdk.BadTensorError` at :func:`bind` (keep integer state such
as step counts out of the bound tree, and cast bfloat16 leaves to float32).

**Copies.** A pull arrives as read-only numpy views of the reply's body, which starts at a
64-byte boundary, and each tensor in it too: ``jax.device_put`` makes a CPU jax array of such a
view without copying it (jax aliases host memory that is 64-byte aligned and copies anything
else; ``jnp.asarray`` always copies). So :meth:`Binding.pull` copies nothing for a reply of
64 KB or more; a smaller reply was copied once out of the SDK's receive buffer and JAX copies
its arrays again (small ones, by definition), and a float64 variable is narrowed to float32
unless ``jax_enable_x64`` is on. A variable unchanged since the last pull comes back as the
same jax array. The arrays stay valid for as long as they are referenced (they keep the body
alive); the SDK never writes into a body it handed out. On the push side a CPU jax array is
viewed by numpy without a copy (``np.asarray``), and since a jax array never changes, the push
is sent from that view: :meth:`Binding.push` copies nothing but the numpy leaves of a gradient
tree (which the caller might change while the push travels).

**Devices.** The binding is for CPU training: pulled arrays are placed on jax's CPU device,
and a gradient on another device (a GPU's) raises :class:`~client_sdk.BadTensorError` saying to
bring it to the host (``jax.device_get``) first.

Thread-safety: as the :class:`~client_sdk.PSClient` it wraps; one binding per training loop.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import jax
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "client_sdk.jax needs jax: pip install 'paramshard[jax]' (or pip install jax)"
    ) from exc

from . import wire
from ._exceptions import BadRequestError, BadTensorError
from .client import PSClient
from .optimizers import Optimizer
from .placement import validate_name

__all__ = ["Binding", "bind", "leaf_names"]

#: ``optimizer=``: one spec for every leaf, a dict name -> spec, or a function of the name.
OptimizerChoice = Optimizer | Mapping[str, Optimizer] | Callable[[str], Optimizer | None] | None


def leaf_names(tree: Any, prefix: str = "") -> list[str]:
    """The variable name of each leaf of ``tree``, in ``jax.tree_util``'s leaf order (the rule
    is in this module's docstring). Raises :class:`~client_sdk.BadRequestError` for a key that
    makes no valid name and for two leaves with one name."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return _names(paths, prefix)


def bind(
    ps: PSClient, params: Any, *, prefix: str = "", optimizer: OptimizerChoice = None
) -> Binding:
    """Bind the pytree ``params`` to the fleet ``ps`` talks to: each leaf a variable named by
    its path after ``prefix`` (:func:`leaf_names`). Nothing is sent; :meth:`Binding.init`
    creates the variables. ``optimizer`` is one spec from :mod:`client_sdk.optimizers` for
    every leaf, a dict name -> spec, or a function name -> spec (``None``: the shard's
    default, ``SGD(lr=0.01)``), e.g. ``lambda n: Adam(lr=1e-3, weight_decay=0 if
    n.endswith("bias") else 1e-4)``. Raises :class:`~client_sdk.BadRequestError` for names
    (see :func:`leaf_names`), :class:`~client_sdk.BadTensorError` for a leaf that is not a
    float array in host memory."""
    return Binding(ps, params, prefix=prefix, optimizer=optimizer)


class Binding:
    """A pytree of parameters bound to variables of a fleet (made by :func:`bind`)."""

    def __init__(
        self, ps: PSClient, params: Any, *, prefix: str = "", optimizer: OptimizerChoice = None
    ) -> None:
        if not isinstance(ps, PSClient):
            raise BadRequestError(
                f"bind takes a PSClient (the blocking client), got {type(ps).__name__}"
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if not flat:
            raise BadRequestError("bind: the tree has no leaves: there is nothing to train")
        names = _names([path for path, _ in flat], prefix)
        leaves = {name: _host(name, leaf, "bind") for name, (_, leaf) in zip(names, flat)}
        self.ps = ps
        #: The variable names, in the tree's leaf order.
        self.names: tuple[str, ...] = tuple(names)
        #: The tree's structure; :meth:`pull` returns trees of it, :meth:`push` takes them.
        self.treedef = treedef
        #: Each leaf's path in the tree, as ``jax.tree_util.keystr`` writes it.
        self.paths: tuple[str, ...] = tuple(jax.tree_util.keystr(path) for path, _ in flat)
        self._shapes = {name: leaf.shape for name, leaf in leaves.items()}
        self._initial = leaves
        self._specs = _optimizers(optimizer, self.names)
        self._cpu = jax.devices("cpu")[0]
        # name -> (the numpy array the SDK returned last, the jax array made of it)
        self._held: dict[str, tuple[np.ndarray, jax.Array]] = {}

    def __repr__(self) -> str:
        return f"<Binding of {len(self.names)} variables, e.g. {self.names[0]!r}>"

    def init(self) -> dict[str, dict[str, Any]]:
        """Create each variable from the tree given to :func:`bind` unless it exists (the first
        worker's values win; see :meth:`PSClient.init`, which this calls). Blocks; returns
        name -> ``{"version", "created"}``. Raises :class:`~client_sdk.ConflictError` if a
        variable exists with another shape or dtype (another model under the same prefix)."""
        return self.ps.init(self._initial, optimizer=self._specs)

    def wait_ready(self, timeout: float | None = 60.0) -> None:
        """Block until every variable exists (:meth:`PSClient.wait_ready`)."""
        self.ps.wait_ready(list(self.names), timeout=timeout)

    def pull(self) -> Any:
        """The fleet's current values as a tree of the bound structure, of CPU jax arrays.
        Blocks. Copies nothing for replies of 64 KB or more (module docstring). Raises what
        :meth:`PSClient.pull` raises, and :class:`~client_sdk.BadTensorError` if the fleet's
        variable has another shape than the bound leaf (another model under this prefix)."""
        pulled = self.ps.pull(self.names)
        held, leaves = self._held, []
        for name in self.names:
            value = pulled[name]
            last = held.get(name)
            if last is not None and last[0] is value:  # unchanged: the SDK's cached array
                leaves.append(last[1])
                continue
            if value.shape != self._shapes[name]:
                raise BadTensorError(
                    f"{name}: the fleet holds shape {list(value.shape)}, the bound tree's leaf "
                    f"has {list(self._shapes[name])}: another model uses this prefix; bind "
                    "with another prefix, or delete the variables (ps.delete)",
                    code="bad_tensor",
                    details={"variable": name},
                )
            array = jax.device_put(value, self._cpu)
            held[name] = (value, array)
            leaves.append(array)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def push(
        self, grads: Any, *, wait: bool = False
    ) -> concurrent.futures.Future[dict[str, dict[str, Any]]] | dict[str, dict[str, Any]]:
        """Send a tree of gradients of the bound structure, computed on the values of the last
        :meth:`pull`. By default in the background (:meth:`PSClient.push_async`: returns its
        future at once, unless too many pushes are in flight; errors also surface on
        :meth:`flush`); ``wait=True`` blocks until applied and returns what
        :meth:`PSClient.push` returns.

        Checked whole before anything is sent: a tree of another structure (the leaves'
        paths differ), a leaf of another shape, a non-float leaf or one not in host memory
        raise :class:`~client_sdk.BadRequestError` / :class:`~client_sdk.BadTensorError`.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
        if not _same(treedef, self.treedef):
            raise BadRequestError(_structure_error(flat, treedef, self))
        arrays: dict[str, np.ndarray] = {}
        for name, (_, leaf) in zip(self.names, flat):
            array = _host(name, leaf, "push")
            if array.shape != self._shapes[name]:
                raise BadTensorError(
                    f"push: the gradient of {name} has shape {list(array.shape)}, its "
                    f"parameter {list(self._shapes[name])}",
                    code="bad_tensor",
                    details={"variable": name},
                )
            # A jax array never changes: its view is sent as it is. A numpy leaf may be
            # changed by the caller while the push travels: that one is copied.
            arrays[name] = array.copy() if isinstance(leaf, np.ndarray) else array
        if wait:
            return self.ps.push(arrays)
        return self.ps.push_async(arrays, copy=False)

    def flush(self) -> None:
        """Block until every background push so far finished (:meth:`PSClient.flush`)."""
        self.ps.flush()

    def values(self, tree: Any) -> dict[str, np.ndarray]:
        """``tree`` (of the bound structure) as name -> numpy array, no copy where numpy can
        view the leaf: for :meth:`PSClient.assign` and the like."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if not _same(treedef, self.treedef):
            raise BadRequestError(_structure_error(flat, treedef, self))
        return {name: _host(name, leaf, "values") for name, (_, leaf) in zip(self.names, flat)}


# -- names -------------------------------------------------------------------------------------


def _key_part(key: Any) -> str:
    """One path entry as a name part: a dict key or attribute as it is, an index in decimal."""
    for attr in ("key", "name", "idx"):  # DictKey/FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            part = getattr(key, attr)
            break
    else:
        part = key
    if isinstance(part, bool) or not isinstance(part, (str, int)):
        raise BadRequestError(
            f"a tree key {part!r} ({type(part).__name__}) makes no variable name: use str or "
            "int keys"
        )
    return str(part)


def _names(paths: Sequence[tuple[Any, ...]], prefix: str) -> list[str]:
    if not isinstance(prefix, str):
        raise BadRequestError(f"prefix must be a str, got {type(prefix).__name__}")
    prefix = prefix.strip("/")
    names: list[str] = []
    seen: dict[str, str] = {}
    for path in paths:
        where = jax.tree_util.keystr(path) or "the root"
        name = "/".join([prefix, *map(_key_part, path)] if prefix else map(_key_part, path))
        if not name:
            raise BadRequestError("bind: the tree is a single array: give it a name as prefix=")
        try:
            validate_name(name)
        except ValueError as exc:
            raise BadRequestError(
                f"the leaf at {where} would be variable {name[:80]!r}: {exc}; rename its key "
                "or use a shorter prefix"
            ) from None
        if name in seen:
            raise BadRequestError(
                f"the leaves at {seen[name]} and {where} would both be variable {name!r}: "
                "rename one of the keys"
            )
        seen[name] = where
        names.append(name)
    return names


def _structure_error(flat: list[tuple[Any, Any]], treedef: Any, binding: Binding) -> str:
    """Why a tree is not of the bound structure, by its leaves' paths where they differ."""
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    have, bound = set(paths), set(binding.paths)
    missing = [p for p in binding.paths if p not in have]
    extra = [p for p in paths if p not in bound]
    if missing or extra:
        why = [f"no leaf at {_few(missing)}"] if missing else []
        why += [f"extra leaves at {_few(extra)}"] if extra else []
        return (
            f"the tree is not the bound one: {'; '.join(why)}; pass a tree of the structure "
            "given to bind()"
        )
    return (
        f"the tree's structure {treedef} is not the bound {binding.treedef} (the same paths in "
        "other containers): pass a tree of the structure given to bind()"
    )


def _same(a: Any, b: Any) -> bool:
    """Whether two tree structures are equal (PyTreeDef's ``==``)."""
    return bool(a == b)


def _few(items: list[str]) -> str:
    return ", ".join(items[:5]) + (", ..." if len(items) > 5 else "")


# -- leaves ------------------------------------------------------------------------------------


def _host(name: str, leaf: Any, verb: str) -> np.ndarray:
    """A float leaf as a numpy array of host memory (a view of a CPU jax array, no copy)."""
    if isinstance(leaf, jax.Array):
        if isinstance(leaf, jax.core.Tracer):
            raise BadRequestError(
                f"{verb}: {name} is a traced value: call {verb} outside jax.jit / jax.grad, "
                "with the concrete arrays they return"
            )
        platforms = {d.platform for d in leaf.devices()}
        if platforms != {"cpu"}:
            where = ", ".join(sorted(str(d) for d in leaf.devices()))
            raise BadTensorError(
                f"{verb}: {name} is on {where}, not in host memory: bring it to the host first "
                "(jax.device_get(tree)); the SDK sends host memory only",
                code="bad_tensor",
                details={"variable": name, "device": where},
            )
        if leaf.is_deleted():
            raise BadTensorError(
                f"{verb}: {name} was deleted (donated to a jitted function?): pass live arrays",
                code="bad_tensor",
                details={"variable": name},
            )
        array = np.asarray(leaf)
    elif isinstance(leaf, np.ndarray):
        array = leaf
    else:
        raise BadTensorError(
            f"{verb}: {name} is a {type(leaf).__name__}, not an array: leaves are jax or numpy "
            "float arrays (jnp.asarray(x, jnp.float32))",
            code="bad_tensor",
            details={"variable": name},
        )
    dtype = array.dtype
    if dtype.kind != "f" or f"f{dtype.itemsize}" not in wire.DTYPES:
        raise BadTensorError(
            f"{verb}: {name} has dtype {dtype}; parameters are float16/32/64 (cast bfloat16 to "
            "float32; keep integer state such as step counts out of the bound tree)",
            code="bad_tensor",
            details={"variable": name, "dtype": str(dtype)},
        )
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def _optimizers(
    optimizer: OptimizerChoice, names: Sequence[str]
) -> Optimizer | dict[str, Optimizer] | None:
    if optimizer is None or isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, Mapping):
        unknown = sorted(set(optimizer) - set(names))
        if unknown:
            raise BadRequestError(
                f"bind: optimizers given for names that are no leaf of the tree: {unknown[:5]} "
                f"(the leaves are e.g. {list(names[:3])})"
            )
        return dict(optimizer)
    if callable(optimizer):
        chosen = {name: optimizer(name) for name in names}
        for name, spec in chosen.items():
            if spec is not None and not isinstance(spec, Optimizer):
                raise BadRequestError(
                    f"bind: optimizer({name!r}) returned {spec!r}, not a spec such as SGD(lr=0.1)"
                )
        return {name: spec for name, spec in chosen.items() if spec is not None}
    raise BadRequestError(
        "bind: optimizer is a spec such as Adagrad(lr=0.05), a dict name -> spec or a function "
        f"name -> spec; got {type(optimizer).__name__}"
    )
