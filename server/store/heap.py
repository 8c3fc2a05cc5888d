"""How a shard process allocates its big buffers: from the heap, reused, not mapped anew each time.

Every push allocates a buffer the size of its tensors (the request body, which the socket
writes into) and frees the previous one, and so does every update that cannot go in place (its
new values, while a reader holds the old ones); every one of them is big. glibc's
``malloc`` maps a block above its mmap threshold (at most 32 MiB) fresh from the kernel and
unmaps it when freed, so each push of a 100 MB tensor would make the kernel zero-fill 100-200 MB of
new pages and fault them in one by one, which makes a copy into a new buffer cost nearly twice one
into memory already touched. :func:`keep_big_buffers` raises the thresholds so that blocks up to 1
GiB come from the heap, and freed ones stay there for the next request, which takes them back at the
speed of touched memory.

The cost is that the process keeps its peak heap instead of returning it to the system: while
requests keep coming that is the point (the next burst reuses it; it does not grow past the
peak, which admission bounds by ``--max-queued-bytes``), but after a burst of many big pushes
at once a shard would hold that peak, ~2 GiB, for good. So the heap is handed back once the
shard has been idle a moment (:func:`trim_heap`, called by :class:`server.admission.Gate` when
no body has been admitted for :data:`server.admission.TRIM_AFTER` seconds after big ones):
what is not in use goes back to the system, and the next burst faults its pages in afresh.
Only the main thread's heap grows this way (glibc's per-thread arenas are capped at 64 MiB),
so the shard allocates big buffers on its event-loop thread (the store does, for updates
computed in worker threads; so does the body read).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["HEAP_LIMIT", "keep_big_buffers", "trim_heap"]

#: Blocks up to this size are served from (and returned to) the heap.
HEAP_LIMIT = 1 << 30

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def trim_heap() -> bool:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``); False where
    that cannot be done. Thread-safe; takes a few milliseconds per GiB freed, so call it from
    a worker thread."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def keep_big_buffers(limit: int = HEAP_LIMIT) -> bool:
    """Tell glibc's allocator to serve blocks up to ``limit`` bytes from the heap and not to
    give freed memory back below twice that. Returns False (and changes nothing) where the C
    library is not glibc. Call once, early, in the shard process only."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError):
        return False
    trim = min(2 * limit, (1 << 31) - 1)  # mallopt takes a C int
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))
