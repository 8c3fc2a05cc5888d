"""The verbs of the worker SDK, one module each: what each sends, and what it makes of the
replies.

A verb is a flow (``_flow.py``): a generator over the client's :class:`~client_sdk._core.Core`
that yields the requests of one round (one per shard, sent concurrently), is sent their results,
and returns the verb's result. It checks its arguments before it yields anything
(``_args.py`` for names, arrays and optimizer specs; its own for the rest), starts with
:meth:`Core.require_fleet <client_sdk._core.Core.require_fleet>`, builds each request with
:meth:`Core.post <client_sdk._core.Core.post>` and accepts the replies with
:meth:`Core.collect <client_sdk._core.Core.collect>`. It does no I/O and never sleeps:
``PSClient`` and ``AsyncPSClient`` (``client.py``) drive every verb alike.

To add a verb: a module here with its flow, exported below, and a method on each shell that
drives it (``return self._drive(_verbs.name(self._core, ...))``, ``await``-ed in the async one).
"""

from . import partitioned
from .assign import assign
from .checkpoint import checkpoint
from .delete import delete
from .increment import increment
from .init import init
from .poll import poll
from .pull import pull
from .push import PushJob, check_push, merge_push, prepare_push, push
from .set_optimizer import set_optimizer
from .tables import create_table, pull_rows, push_rows
from .variables import variables
from .wait import wait

__all__ = [
    "PushJob",
    "assign",
    "check_push",
    "checkpoint",
    "create_table",
    "delete",
    "increment",
    "init",
    "merge_push",
    "partitioned",
    "poll",
    "prepare_push",
    "pull",
    "pull_rows",
    "push",
    "push_rows",
    "set_optimizer",
    "variables",
    "wait",
]
