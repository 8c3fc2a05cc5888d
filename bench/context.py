"""What a case gets to run with: the run's settings and lazily started shared processes."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import processes

__all__ = ["Context"]


@dataclass
class Context:
    """Settings of one ``python -m bench`` run plus the processes cases share.

    ``sizes`` is ``None`` unless ``--sizes`` was given (a case then uses its ``DEFAULT_SIZES``).
    ``reps``/``min_reps`` feed :func:`bench.timing.reps_for`. Processes are started on first
    use and stopped by :meth:`close`. Not thread-safe: call it from the main thread.
    """

    sizes: tuple[int, ...] | None
    reps: int
    min_reps: int
    warmup: int
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="paramshard-bench-")))
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)
    _shards: dict[int, list[str]] = field(default_factory=dict, repr=False)
    _raw: tuple[str, int] | None = field(default=None, repr=False)

    def sizes_for(self, defaults: tuple[int, ...]) -> tuple[int, ...]:
        return self.sizes if self.sizes is not None else defaults

    def shard_urls(self, n: int = 1) -> list[str]:
        """URLs of a fresh fleet of ``n`` shards, started once per run and shared by the cases
        (use unique variable names). Blocks until the shards are healthy."""
        if n not in self._shards:
            d = self.logdir / f"fleet{n}"
            d.mkdir(exist_ok=True)
            # --log-level warning: no per-request logging inside the timed path
            self._shards[n] = self._stack.enter_context(
                processes.shards(n, d, "--log-level", "warning"))
        return self._shards[n]

    def raw_address(self) -> tuple[str, int]:
        """``(host, port)`` of the raw-socket reference server (:mod:`bench.rawsock`)."""
        if self._raw is None:
            self._raw = self._stack.enter_context(processes.raw_server(self.logdir))
        return self._raw

    def close(self, keep_logs: bool = False) -> None:
        """Stop the processes; remove their logs unless ``keep_logs`` (say, after a failure)."""
        self._stack.close()
        if not keep_logs:
            shutil.rmtree(self.logdir, ignore_errors=True)
