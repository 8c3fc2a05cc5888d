"""Step groups: the variables a training step pulls and pushes, registered once and then moved
as one flat buffer per shard (what DDP calls a bucket).

    g = ps.group(names)            # once: one registration per shard the names live on
    for step in range(steps):
        params = g.pull()          # name -> view of the group's flat buffer (filled in place)
        g.push(grads)              # dict name -> gradient, or one flat array
        # or: write each gradient into g.grads[name] (views of a flat buffer), then g.push()

A step of many small variables spends most of a per-variable :meth:`PSClient.pull
<client_sdk.PSClient.pull>` on the names: each side encodes, looks up and checks every one. A
group names them once; then a pull is one request per shard answered with the values back to
back and the versions as one int64 array, received from the socket straight into one flat
buffer, and a push is the gradients back to back: each side's work per step no longer grows
with the number of variables but for the arithmetic. The shard applies a group push as an
ordinary push of those variables (each with its own optimizer, once per ``seq``, replicated
to backups like any push).

Rules: a group's variables exist and have one dtype (make one group per dtype), at most the
shard's ``--max-request-names`` (2,048 by default) of them per shard and at most
``--max-request-bytes`` of values per shard; no embedding tables and no partitioned variables
(group their parts, or pull them apart). A group moves values and gradients in the variables'
own dtype: a client's ``wire_dtype`` does not apply to it. ``StepGroup`` is not thread-safe:
one training loop uses it (make one group per thread). :class:`StepGroup` drives
:class:`~client_sdk.PSClient`, :class:`AsyncStepGroup` :class:`~client_sdk.AsyncPSClient`, with
the same methods.

A :class:`StepGroup` on one ``http://`` shard that has no replicas takes the direct path
(``_direct.py``): its pull and push are sent and received from the calling thread, the pull's
request built once, with the general path's retries, deadlines and errors for anything but a
``200``.

A shard that restarted, a replica that became primary, or a shard that let the group go
answers the group's id as unknown: the client registers the group again and sends the request
again, unseen (a push keeps its ``seq``: applied once). If a variable of the group was deleted
(or deleted and made again) since the group was made, the call raises
:class:`~client_sdk.StaleGroupError` and applies nothing on that shard: make the group again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._direct import GroupRoute
from ._verbs import group as _group

if TYPE_CHECKING:
    from .client import AsyncPSClient, PSClient

__all__ = ["AsyncStepGroup", "StepGroup"]


class _Base:
    def __init__(self, state: _group.GroupState) -> None:
        self._state = state

    @property
    def names(self) -> list[str]:
        """The group's variables, in the order given (duplicates refused)."""
        return list(self._state.names)

    @property
    def views(self) -> dict[str, np.ndarray]:
        """Name -> a view of the group's flat buffer on its shard, made once: each
        :meth:`pull` without ``out`` writes the values here (change a view, and the next pull
        overwrites it)."""
        return self._state.views

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """Name -> a view of the group's own gradient buffer on its shard (made on first use,
        zeros): write each gradient into its view (``np.copyto``, or ``out=`` of the
        computation), then ``push()`` with no argument sends those buffers as they are, with
        nothing gathered or copied — what DDP does with its buckets."""
        return self._state.grad_views()

    @property
    def flat(self) -> np.ndarray:
        """The flat buffer of a group on one shard (every view is a slice of it)."""
        parts = self._state.parts
        if len(parts) != 1:
            raise ValueError(f"this group spans {len(parts)} shards: it has one flat buffer each")
        assert parts[0].flat is not None
        return parts[0].flat

    @property
    def versions(self) -> dict[str, int]:
        """Name -> the version of its value in the last pull (empty before the first)."""
        out: dict[str, int] = {}
        for part in self._state.parts:
            if part.versions is not None:
                out.update(zip(part.names, part.versions.tolist()))
        return {name: out[name] for name in self._state.names if name in out}

    def __repr__(self) -> str:
        state = self._state
        return (
            f"<{type(self).__name__} {len(state.names)} variables on {len(state.parts)} shard(s)>"
        )


class StepGroup(_Base):
    """A registered list of variables, pulled and pushed as one flat buffer per shard (module
    docstring). Made by :meth:`PSClient.group <client_sdk.PSClient.group>`."""

    def __init__(self, client: PSClient, names: Any) -> None:
        state = _group.GroupState(client._core, names)
        client._drive(_group.register(client._core, state))
        super().__init__(state)
        self._client = client
        #: The direct path of a group on one shard, where it is taken (``_direct.py``).
        self._route = GroupRoute.make(client, state)

    def pull(self, out: Any = None) -> dict[str, np.ndarray]:
        """The group's values (blocks): name -> :attr:`views` (the group's own buffers,
        overwritten by the next pull). ``out``: one flat array of the group's dtype and size
        (a group on one shard: the values are received into it, and the result maps each name
        to a view of ``out``, made once per buffer: pass the same ``out`` every step), or a
        dict name -> array (copied into from :attr:`views`; the result is ``out``). Always
        moves every value (a group's pull is for variables that change every step;
        :meth:`PSClient.pull` sends only the changed ones)."""
        route = self._route
        if route is not None and route.ready():
            return route.pull(out)
        return self._client._drive(_group.pull(self._client._core, self._state, out))

    def push(self, grads: Any = None) -> dict[str, Any]:
        """Apply gradients (blocks until every shard applied its part): a dict name ->
        gradient for every variable of the group (the group's dtype, each variable's shape),
        (a group on one shard) one flat array laid out as :attr:`flat`, or nothing: what
        :attr:`grads` holds. The versions sent
        are those of the last :meth:`pull`, so the shard measures staleness. Returns
        ``{"versions": name -> new version, "applied": how many were applied, "variables":
        name -> the entry of each that was not}`` (``duplicate``, a sync round's ``accepted``,
        ``dropped``; as :meth:`PSClient.push` describes them). Retried with its ``seq`` after
        any connection failure: applied once."""
        route = self._route
        if route is not None and route.ready():
            return route.push(grads)
        return self._client._drive(_group.push(self._client._core, self._state, grads))


class AsyncStepGroup(_Base):
    """:class:`StepGroup` for :class:`~client_sdk.AsyncPSClient`: made by ``await
    ps.group(names)``; ``await g.pull()``, ``await g.push(grads)``."""

    def __init__(self, client: AsyncPSClient, state: _group.GroupState) -> None:
        super().__init__(state)
        self._client = client

    @classmethod
    async def make(cls, client: AsyncPSClient, names: Any) -> AsyncStepGroup:
        state = _group.GroupState(client._core, names)
        await client._drive(_group.register(client._core, state))
        return cls(client, state)

    async def pull(self, out: Any = None) -> dict[str, np.ndarray]:
        """:meth:`StepGroup.pull`."""
        return await self._client._drive(_group.pull(self._client._core, self._state, out))

    async def push(self, grads: Any = None) -> dict[str, Any]:
        """:meth:`StepGroup.push`."""
        return await self._client._drive(_group.push(self._client._core, self._state, grads))
