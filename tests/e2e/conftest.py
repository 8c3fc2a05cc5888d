"""Fixtures the end-to-end modules share: ``groups``, replica groups made per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.replicas import Group, start_group


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[Callable[..., Group]]:
    """``groups(n, *flags, **kwargs)``: a replica group of ``n`` real shard processes
    (:func:`tests.helpers.replicas.start_group`), stopped when the test ends."""
    made: list[Group] = []

    def make(*args: Any, **kwargs: Any) -> Group:
        group = start_group(tmp_path / f"g{len(made)}", *args, **kwargs)
        made.append(group)
        return group

    yield make
    for group in made:
        group.close()
