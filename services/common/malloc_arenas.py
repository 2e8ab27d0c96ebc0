"""One glibc malloc arena per worker process, so that the engine thread reuses freed activations.

glibc gives each new thread an arena of its own. A worker steps its engine on a thread beside the
asyncio loop, and in that thread's arena a prefill's large activations (megabytes, freed and
allocated again in every layer) were handed back to the kernel and returned as fresh zeroed pages,
so a prefill computed markedly slower than the same engine on the main thread, whose arena keeps
them (docs/benchmarks.md, "Decisions settled by experiments"). With one arena the worker computes
as fast as in-process, and threads no longer grow heaps of their own.
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(count: int = 1) -> bool:
    """Cap glibc's malloc arenas at `count` for the threads this process starts from now on (call it
    before any), unless the MALLOC_ARENA_MAX environment variable already chose; whether it applied."""
    if "MALLOC_ARENA_MAX" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, count))
