"""How a shard process allocates its big buffers: from the heap, reused, not mapped anew each time.

Every push allocates a buffer the size of its tensors (the request body, which the socket
writes into) and frees the previous one, and so does every update that cannot go in place (its
new values, while a reader holds the old ones); every one of them is big. glibc's
``malloc`` maps a block above its mmap threshold (at most 32 MiB) fresh from the kernel and
unmaps it when freed, so each push of a 100 MB tensor would make the kernel zero-fill 100-200 MB of new
pages and fault them in one by one: measured here, ``np.empty(100 MB)`` plus a copy into it
took 24 ms, against 14 ms into memory already touched. :func:`keep_big_buffers` raises the
thresholds so that blocks up to 1 GiB come from the heap, and freed ones stay there for the
next request, which takes them back at the speed of touched memory.

The cost is that the process keeps its peak heap instead of returning it to the system, which
for a shard, a process that holds its variables for its whole life and sees the same request
sizes again and again, is the point. Only the main thread's heap grows this way (glibc's
per-thread arenas are capped at 64 MiB), so the shard allocates big buffers on its event-loop
thread (the store does, for updates computed in worker threads; so does the body read).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["HEAP_LIMIT", "keep_big_buffers"]

#: Blocks up to this size are served from (and returned to) the heap.
HEAP_LIMIT = 1 << 30

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


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
