"""The repository's prose states the present: no file cites a commit of this repository, and
bench/README.md stays a reference a reader finishes in minutes.

A commit hash in a comment, docstring or README points at history, which is git log's job, and
what it describes goes stale while the hash stays. A token of 7 to 40 hex digits in a tracked
``.py`` or ``.md`` file fails the test when ``git`` resolves it to a commit; any other hex
(digests, addresses, constants) is left alone. The check needs the repository itself, so it
skips only where there is none (the sources unpacked from a wheel or an sdist) and fails on
anything else that stops it from running (no ``git`` on the path, a broken repository).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

#: bench/README.md: how to run, what each case measures, the latest results, the goals, the JSON.
BENCH_README_MAX_LINES = 280
_HEX = re.compile(rb"\b[0-9a-f]{7,40}\b")


def _git(*args: str, stdin: bytes | None = None) -> bytes:
    if shutil.which("git") is None:
        pytest.fail(
            "git is not on the path, but this checkout has a .git: install git to run this test"
        )
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], input=stdin, capture_output=True, timeout=60, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"git {' '.join(args)} failed: {done.stderr.decode(errors='replace')}")
    return done.stdout


def _citations() -> list[str]:
    """``path:line: token`` for every hex token in a tracked .py/.md file naming a commit."""
    places: dict[bytes, list[str]] = {}
    for name in _git("ls-files", "-z", "--", "*.py", "*.md").split(b"\0"):
        if not name:
            continue
        path = ROOT / name.decode()
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            for token in _HEX.findall(line):
                places.setdefault(token, []).append(f"{name.decode()}:{number}")
    if not places:
        return []
    tokens = list(places)
    # One git process for every token: "<type>" per input line, "missing"/"ambiguous" otherwise.
    answers = _git(
        "cat-file", "--batch-check=%(objecttype)", stdin=b"\n".join(tokens) + b"\n"
    ).splitlines()
    assert len(answers) == len(tokens), answers
    return [
        f"{where}: {token.decode()}"
        for token, answer in zip(tokens, answers, strict=True)
        if answer == b"commit"
        for where in places[token]
    ]


def test_no_file_cites_a_commit_of_this_repository():
    if not (ROOT / ".git").exists():
        pytest.skip(
            "no .git here (installed from a wheel or an sdist): nothing to resolve hashes against"
        )
    found = _citations()
    assert not found, (
        "these tracked files cite commits of this repository by hash:\n  "
        + "\n  ".join(found)
        + "\nState what is true now and why instead (history is in git log; measurements go "
        "in commit messages and bench results). To name the commit a benchmark ran at, give "
        "its date, e.g. `git log -1 --until='<date>' main`."
    )


def test_the_bench_readme_is_a_reference_not_a_diary():
    lines = (ROOT / "bench" / "README.md").read_text().count("\n")
    assert lines <= BENCH_README_MAX_LINES, (
        f"bench/README.md has {lines} lines, at most {BENCH_README_MAX_LINES}: keep it to how to "
        "run, what each case measures, the latest results, the goals and the JSON; a run's "
        "story goes in its commit message"
    )
