"""Which worker holds which prompt prefixes, as far as this gateway's own routing tells it.

Prompts are cut into blocks of the workers' block size and each full block named by the hash chain
of the workers' prefix caches (engine.kv_cache.block_hash), without their salt: only the gateway
compares these names. Every prompt routed to a worker is recorded there; each worker's record is
an LRU bounded by its KV cache size, since that is the most it can hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Per worker, the block hashes of the prompts sent there (most recent last)."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def cached_tokens(self, address: str, hashes: Sequence[bytes], block_size: int) -> int:
        """How many leading prompt tokens the worker likely holds."""
        held = self._held.get(address)
        if not held:
            return 0
        blocks = 0
        for digest in hashes:
            if digest not in held:
                break
            blocks += 1
        return blocks * block_size

    def record(self, address: str, hashes: Sequence[bytes], capacity_blocks: int) -> None:
        """The worker was sent a prompt with these blocks; keep at most `capacity_blocks` per worker."""
        held = self._held.setdefault(address, OrderedDict())
        for digest in hashes:
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > max(0, capacity_blocks):
            held.popitem(last=False)

    def forget(self, address: str) -> None:
        """The worker is gone (or restarted with an empty cache)."""
        self._held.pop(address, None)
