"""Worker processes keep one malloc arena, so the engine thread reuses freed activations (regression:
in a thread arena of its own a prefill worker computed 16-18% slower than in-process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

from environment import needs

pytestmark = needs(platform.libc_ver()[0] == "glibc", "glibc (malloc arenas are glibc's)")

# A fresh process each time: the cap concerns threads started after it, and this session has many.
_SCRIPT = textwrap.dedent("""
    import ctypes, sys, tempfile, threading
    from services.common.malloc_arenas import limit_malloc_arenas

    applied = limit_malloc_arenas() if sys.argv[1] == "limit" else False
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc.restype = ctypes.c_void_p

    def allocate():
        libc.free(ctypes.c_void_p(libc.malloc(1 << 20)))

    threads = [threading.Thread(target=allocate) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with tempfile.NamedTemporaryFile() as info:
        stream = libc.fopen(info.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        print(applied, open(info.name).read().count("<heap nr="))
""")


def _arenas(mode: str, **env: str) -> tuple[str, int]:
    inherited = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=60,
                          env={**inherited, **env}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    applied, heaps = done.stdout.split()
    return applied, int(heaps)


def test_threads_share_the_main_arena_once_limited() -> None:
    assert _arenas("limit") == ("True", 1)


def test_threads_get_arenas_of_their_own_by_default() -> None:
    # Shows the check above can fail: without the cap, allocating threads get their own arenas.
    assert _arenas("default")[1] > 1


def test_an_explicit_malloc_arena_max_is_left_alone() -> None:
    assert _arenas("limit", MALLOC_ARENA_MAX="2")[0] == "False"
