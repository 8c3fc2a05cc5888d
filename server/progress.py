"""Progress of long work, for a person watching a terminal: one line redrawn in place
(``restoring snapshot-00000012: 45% (1.2 GiB of 2.7 GiB)``), and nothing at all when the
stream is not a terminal, so logs and pipes stay quiet.

``paramshard reshard`` reports reading and writing the checkpoint, and ``paramshard serve``
reports reading its snapshot at start (:mod:`server.durability`), both on standard error.
Thread-safe enough for its use: one piece of work reports at a time, from one thread.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "human_bytes"]

#: The line is redrawn at most this often (seconds).
REDRAW = 0.2


def human_bytes(n: int | float) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """``begin(what, total)``, then ``add(nbytes)`` as the work goes, then ``end()``; shown
    only when ``stream`` (default: standard error at each ``begin``) is a terminal."""

    def __init__(
        self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stream = stream
        self._clock = clock
        self.shown = False
        self.what = ""
        self.total = 0
        self.done = 0
        self._started = 0.0
        self._drawn = -REDRAW

    @property
    def stream(self) -> TextIO:
        return sys.stderr if self._stream is None else self._stream

    def begin(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, max(0, total), 0
        self.shown = _is_terminal(self.stream)
        self._started = self._clock()
        self._drawn = -REDRAW
        self._draw(force=True)

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        self._draw()

    def end(self) -> None:
        if self.shown:
            seconds = self._clock() - self._started
            self.stream.write(
                f"\r\x1b[K{self.what}: done, {human_bytes(self.done)} in {seconds:.1f}s\n"
            )
            self.stream.flush()
        self.shown = False

    def _draw(self, force: bool = False) -> None:
        if not self.shown:
            return
        now = self._clock()
        if not force and now - self._drawn < REDRAW:
            return
        self._drawn = now
        share = f"{100 * self.done / self.total:3.0f}% " if self.total else ""
        self.stream.write(
            f"\r\x1b[K{self.what}: {share}({human_bytes(self.done)} of {human_bytes(self.total)})"
        )
        self.stream.flush()
