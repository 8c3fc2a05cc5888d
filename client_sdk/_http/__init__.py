"""How a request of the SDK becomes an HTTP exchange with a shard.

``_transport.py`` chooses a sender and retries; a sender performs one exchange by its deadline:

* ``native.py``: the senders over the SDK's own keep-alive HTTP/1.1 connections, for
  ``http://`` shards: ``http11.py`` (requests as values, response parsing; no I/O),
  ``connection.py`` (a connection's sending and receiving, and the reuse of idle ones),
  ``pool.py`` (blocking, ``PSClient``), ``asyncpool.py`` (asyncio, ``AsyncPSClient``) and
  ``fanout.py`` (a call's requests to several shards driven from one thread);
* ``httpx_senders.py``: the senders over httpx2, for ``https://`` shards and injected
  transports; ``httpx_deadline.py`` is the one module that reaches into httpx2's internals.

Nothing here knows the protocol beyond a :class:`~client_sdk._flow.ShardRequest` and a
:class:`~client_sdk._flow.Reply`; failures are httpx2's exception classes, translated by
``_transport.py``.
"""
