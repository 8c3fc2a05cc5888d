"""docs/RECIPES.md runs as written: every fenced ``python`` block of it, each a complete worker
program, runs in its own process against a real 2-shard fleet (``PARAMSHARD_SHARDS``) and
exits 0. A renamed argument or verb breaks this test rather than a reader's first run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

RECIPES = ROOT / "docs" / "RECIPES.md"
#: A recipe is a toy that finishes in seconds; this bounds one that hangs.
RUN_TIMEOUT = 180.0


def _blocks() -> list[tuple[str, str]]:
    """(the heading the block sits under, the block's code) for each ```python block."""
    found: list[tuple[str, str]] = []
    heading = "top"
    lines = RECIPES.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            heading = line[3:].strip()
        if line.strip() == "```python":
            end = lines.index("```", i + 1)
            found.append((heading, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


BLOCKS = _blocks()


def test_recipes_has_blocks() -> None:
    assert len(BLOCKS) >= 4, f"{RECIPES} lost its python blocks: {[h for h, _ in BLOCKS]}"


@pytest.mark.parametrize(
    "code", [code for _, code in BLOCKS], ids=[re.sub(r"\W+", "-", h).strip("-") for h, _ in BLOCKS]
)
def test_recipe_runs(code: str, fleet_factory, tmp_path) -> None:
    fleet = fleet_factory(2)
    script = tmp_path / "recipe.py"
    script.write_text(code, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PARAMSHARD_SHARDS": ",".join(fleet.urls),
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, (
        f"the recipe exited {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
