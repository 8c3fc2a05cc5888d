"""A ``torch.nn.Module`` trained through a paramshard fleet: :func:`bind`.

    from client_sdk import PSClient
    from client_sdk.optimizers import Adagrad
    from client_sdk.torch import bind

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    with PSClient() as ps:
        fleet = bind(ps, model, prefix="digits/", optimizer=Adagrad(lr=0.05))
        fleet.init()                      # create-if-absent, then pull the fleet's values
        for x, y in batches:
            fleet.pull()                  # the parameters refreshed in place
            loss_fn(model(x), y).backward()
            fleet.push()                  # every .grad handed to the SDK, sent in the background
        fleet.flush()

The module's ``named_parameters()`` are the variables, named ``prefix + name``
(``digits/0.weight``).
:meth:`Binding.pull` writes the pulled values into the parameters' own storage through
``PSClient.pull(out=)`` (numpy views of it; the values are received from the socket into
them): nothing parameter-sized is allocated or copied and every parameter keeps its address,
so an optimizer, a hook or a ``torch.compile``d graph holding it sees the new values.
:meth:`Binding.push` hands over each parameter's ``.grad`` without a copy: the SDK sends
from the gradient's own memory and the parameter's ``.grad`` becomes ``None`` (as after
``zero_grad()``), so the next backward writes new ones instead of the ones in flight.

**Buffers** (a BatchNorm's running statistics) follow ``buffers=``: ``"local"`` (the default)
keeps each worker's own, never sent; ``"chief"`` makes them variables too (created by
:meth:`Binding.init`), which the binding made with ``chief=True`` assigns from its module on
each :meth:`Binding.push` and every binding pulls into its module on each :meth:`Binding.pull`:
every worker evaluates with the chief's statistics. Averaging them over workers is not offered
(a running average of running averages weights workers by when they pushed).

A ``torch.compile``d module is bound through its original module (``_orig_mod``: the same
parameter tensors), so its variables have the names of the plain module's. Refused with
:class:`~client_sdk.BadTensorError` when binding, and when a parameter was replaced since: a
parameter or buffer not on the CPU (move the module with ``.cpu()`` first), not contiguous, or
of a dtype numpy has no type for (bfloat16, complex); a parameter that is not a float. Sparse
gradients are refused when pushed.

torch is imported only when :func:`bind` is called, so ``import client_sdk`` never loads it.
This module uses torch's public API alone (``named_parameters``, ``named_buffers``,
``Tensor.detach().numpy()``, ``Tensor.grad``), present across torch 2.x; it is tested with
torch 2.13 (CPU), which ``pip install 'paramshard[torch]'`` installs. Not thread-safe: one
binding per training thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ._args import valid_name
from ._exceptions import BadRequestError, BadTensorError
from .optimizers import Optimizer

if TYPE_CHECKING:  # pragma: no cover - types only; torch is imported when bind() runs
    import torch

    from .client import PSClient

__all__ = ["Binding", "bind"]

Buffers = Literal["local", "chief"]
OptimizerArg = Optimizer | Mapping[str, Optimizer] | Sequence[Mapping[str, Any]] | None


def bind(
    ps: PSClient,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    optimizer: OptimizerArg = None,
    buffers: Buffers = "local",
    chief: bool = False,
) -> Binding:
    """Bind ``module``'s parameters to variables of the fleet ``ps`` talks to.

    ``optimizer`` (what :meth:`Binding.init` creates the variables with) is one spec for every
    parameter, a dict parameter name -> spec (every parameter named), or torch's parameter
    groups: a list of ``{"params": [tensors], "optimizer": spec}``, every parameter in one
    group. ``buffers`` and ``chief`` say what becomes of the module's buffers (see the module's
    docstring). Raises :class:`~client_sdk.BadTensorError` for a parameter or buffer the SDK
    cannot use in place (not on the CPU, not contiguous, a dtype numpy lacks, a parameter that
    is not a float) and :class:`~client_sdk.BadRequestError` for a bad argument, before
    anything is sent.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise BadRequestError(f"bind takes a torch.nn.Module, got {type(module).__name__}")
    if buffers not in ("local", "chief"):
        raise BadRequestError(f"bind: buffers must be 'local' or 'chief', got {buffers!r}")
    return Binding(ps, _original(module), prefix, optimizer, buffers, chief)


def _original(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile``d one wraps (its ``_orig_mod``), else ``module``."""
    import torch

    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


class Binding:
    """A module's parameters (and, with ``buffers="chief"``, its buffers) as variables; made
    by :func:`bind`."""

    def __init__(
        self,
        ps: PSClient,
        module: torch.nn.Module,
        prefix: str,
        optimizer: OptimizerArg,
        buffers: Buffers,
        chief: bool,
    ) -> None:
        self.ps = ps
        self.module = module
        self.prefix = prefix
        self.chief = chief
        #: variable name -> the parameter (or buffer) it is bound to
        self.params: dict[str, torch.Tensor] = {
            self._name(n): p for n, p in module.named_parameters()
        }
        self.buffers: dict[str, torch.Tensor] = (
            {self._name(n): b for n, b in module.named_buffers()} if buffers == "chief" else {}
        )
        if not self.params:
            raise BadRequestError("bind: the module has no parameters to train")
        self._optimizers = _optimizers(optimizer, module, prefix, self.params)
        self._views: dict[str, np.ndarray] = {}
        self._addresses: dict[str, int] = {}
        self._refresh()
        self._names = list(self._views)

    def _name(self, name: str) -> str:
        return valid_name(self.prefix + name)

    @property
    def names(self) -> list[str]:
        """The variables' names: the parameters', then the shared buffers'."""
        return list(self._names)

    def _refresh(self) -> None:
        """(Re)make the numpy views of every tensor's storage, checking each."""
        views, addresses = {}, {}
        for name, tensor in (*self.params.items(), *self.buffers.items()):
            views[name] = _view(name, tensor, parameter=name in self.params)
            addresses[name] = tensor.data_ptr()
        self._views, self._addresses = views, addresses

    def _current(self) -> dict[str, np.ndarray]:
        """The views, made again if a tensor was replaced or moved since (``module.to(...)``,
        ``p.data = ...``): one address compared per tensor."""
        tensors = {**self.params, **self.buffers}
        if any(tensors[n].data_ptr() != a for n, a in self._addresses.items()):
            self._refresh()
        return self._views

    def init(self, *, pull: bool = True) -> None:
        """Create the variables from the module's current values where they do not exist yet
        (the first worker's values win, as :meth:`PSClient.init`), then (``pull``) write the
        fleet's values into the module, so every worker starts from the same ones."""
        views = self._current()
        params = {n: views[n] for n in self.params}
        self.ps.init(params, optimizer=self._optimizers)
        if self.buffers:
            self.ps.init({n: views[n] for n in self.buffers})
        if pull:
            self.pull()

    def pull(self) -> None:
        """Write the fleet's current values into the module's parameters (and shared buffers)
        in place: the same storage, no parameter-sized allocation. Blocks."""
        self.ps.pull(self._names, out=self._current())

    def push(
        self, *, wait: bool = False
    ) -> concurrent.futures.Future[dict[str, dict[str, Any]]] | dict[str, dict[str, Any]]:
        """Send every parameter's ``.grad`` (those without one are left out) and hand them over:
        each ``.grad`` is ``None`` afterwards. In the background by default (the
        :meth:`PSClient.push_async` future; :meth:`flush` waits for all); ``wait=True`` returns
        once the shards applied it (:meth:`PSClient.push`'s result). The chief of a binding with
        shared buffers assigns them first. Raises :class:`~client_sdk.BadRequestError` when no
        parameter has a gradient (backward was not run since the last push)."""
        views = self._current()
        if self.chief and self.buffers:
            self.ps.assign({n: views[n] for n in self.buffers})
        grads: dict[str, Any] = {}
        for name, param in self.params.items():
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse or grad.device.type != "cpu":
                raise BadTensorError(
                    f"push: the gradient of {name!r} is "
                    f"{'sparse' if grad.is_sparse else f'on {grad.device}'}: the fleet takes "
                    "dense CPU gradients (an nn.Embedding(sparse=False), a module on the CPU)",
                    code="bad_tensor",
                    details={"variable": name},
                )
            grads[name] = grad.detach()
        if not grads:
            raise BadRequestError(
                "push: no parameter has a gradient: run backward() before push() (push hands "
                "the gradients over, so each is sent once)"
            )
        result = self.ps.push(grads) if wait else self.ps.push_async(grads, copy=False)
        for name in grads:
            self.params[name].grad = None
        return result

    def flush(self) -> None:
        """Wait until every push so far was applied (:meth:`PSClient.flush`)."""
        self.ps.flush()


def _view(name: str, tensor: torch.Tensor, *, parameter: bool) -> np.ndarray:
    """A writable numpy view of ``tensor``'s storage; :class:`BadTensorError` if it has none."""
    problem = None
    if tensor.device.type != "cpu":
        problem = f"is on {tensor.device}: move the module to the CPU first (module.cpu())"
    elif parameter and not tensor.is_floating_point():
        problem = f"is {tensor.dtype}: parameters must be float tensors"
    elif not tensor.is_contiguous():
        problem = "is not contiguous: make it so (p.data = p.data.contiguous()) before binding"
    if problem is None:
        try:
            return tensor.detach().numpy()
        except (TypeError, RuntimeError) as exc:
            problem = f"has no numpy view ({exc}): use float16/32/64 (or integer) tensors"
    raise BadTensorError(
        f"bind: {name!r} {problem}",
        code="bad_tensor",
        details={"variable": name, "dtype": str(tensor.dtype), "device": str(tensor.device)},
    )


def _optimizers(
    optimizer: OptimizerArg,
    module: torch.nn.Module,
    prefix: str,
    params: Mapping[str, torch.Tensor],
) -> Optimizer | dict[str, Optimizer] | None:
    """``bind``'s ``optimizer`` as :meth:`PSClient.init` takes it (keyed by variable name)."""
    if optimizer is None or isinstance(optimizer, Optimizer):
        return optimizer
    by_name: dict[str, Any]
    if isinstance(optimizer, Mapping):
        by_name = {prefix + k: v for k, v in optimizer.items()}
        unknown = sorted(set(by_name) - set(params))
        if unknown:
            raise BadRequestError(f"bind: optimizer names parameters the module lacks: {unknown}")
    elif isinstance(optimizer, Iterable) and not isinstance(optimizer, (str, bytes)):
        of = {id(p): n for n, p in params.items()}
        by_name = {}
        for i, group in enumerate(optimizer):
            if not isinstance(group, Mapping) or "params" not in group:
                raise BadRequestError(
                    f"bind: optimizer group {i} must be a dict with 'params' and 'optimizer'"
                )
            for p in group["params"]:
                name = of.get(id(p))
                if name is None:
                    raise BadRequestError(
                        f"bind: optimizer group {i} holds a tensor that is not one of the "
                        "module's parameters"
                    )
                by_name[name] = group.get("optimizer")
    else:
        raise BadRequestError(
            "bind: optimizer must be a spec (e.g. Adagrad(lr=0.05)), a dict parameter name -> "
            f"spec or a list of parameter groups; got {type(optimizer).__name__}"
        )
    missing = [n for n in params if n not in by_name]
    if missing:
        raise BadRequestError(
            f"bind: no optimizer given for {missing}: name every parameter (or pass one spec)"
        )
    bad = [n for n, o in by_name.items() if not isinstance(o, Optimizer)]
    if bad:
        raise BadRequestError(
            f"bind: the optimizer of {bad} is not a spec such as Adagrad(lr=0.05)"
        )
    return by_name
