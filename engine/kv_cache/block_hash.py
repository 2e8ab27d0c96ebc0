"""Chained content hashes of full KV blocks: the engine's prefix cache names its blocks with them (salted
with the model's fingerprint), the gateway's prefix index the prompts it routed (unsalted). No torch.

A block's hash covers its parent block's hash, so equal hashes mean equal whole prefixes, not just equal
blocks. sha256 over a fixed byte layout keeps hashes stable across processes and machines, which Python's
salted ``hash()`` is not.
"""

import hashlib
import struct
from collections.abc import Sequence

HASH_SIZE = hashlib.sha256().digest_size
_ROOT_HASH = bytes(HASH_SIZE)


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """Hash one block of token ids chained onto ``parent`` (None for the first block of a sequence).

    Layout: parent hash (32 zero bytes for the root), salt length as little-endian uint64, salt, then each
    token id as little-endian int64. The salt length makes the salt/token boundary unambiguous.
    """
    if parent is not None and len(parent) != HASH_SIZE:
        raise ValueError(f"parent hash must be {HASH_SIZE} bytes, got {len(parent)}")
    digest = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    digest.update(struct.pack("<Q", len(salt)))
    digest.update(salt)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Hash chain of every full block of ``token_ids``; a trailing partial block is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes
