"""Waiting for a condition a test observes through the real system, instead of sleeping.

    eventually(lambda: admission(url)["waiting"] == 1, "the pull waits for room")

A fixed sleep either waits longer than needed or, on a loaded machine, not long enough, and a
test that asserts after it fails at random or passes without checking anything. Here the test
names what it waits for (a status the shard reports, a counter, a connection's state) and goes
on once it holds. ``timeout`` only guards against a hang: it is many times what the condition
needs, never a claim about speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["eventually", "eventually_async"]

T = TypeVar("T")


def eventually(check: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Call ``check`` until it returns something true, and return that; fail saying ``what``
    was awaited if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:g} s: {what} (last: {result!r})")
        time.sleep(0.01)


async def eventually_async(check: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """:func:`eventually` on an event loop: other tasks run between the checks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if result:
            return result
        if loop.time() > deadline:
            raise AssertionError(f"still waiting after {timeout:g} s: {what} (last: {result!r})")
        await asyncio.sleep(0.001)
