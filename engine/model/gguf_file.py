"""One parsed GGUF file per process, whoever reads it.

gguf's reader parses every metadata field when it opens a file, the tokenizer's ~49k tokens and
merges among them, as numpy views of a memory map: seconds for the shipped model. A worker reads the
file for its weights and again for its tokenizer, a gateway for each version's tokenizer and
context length, so they share one parse. Torch-free: the gateway uses it.
"""

from __future__ import annotations

import functools
import os

from gguf import GGUFReader


def gguf_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """The parsed file at `path`, opened once per process (again when the file changes)."""
    status = os.stat(path)
    return _open(os.path.realpath(path), status.st_mtime_ns, status.st_size)


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)
