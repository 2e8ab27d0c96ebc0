"""Chained content hashes of full KV blocks: the engine's prefix cache names its blocks with them (salted
with the model's fingerprint), and the gateway hashes prompts with each worker's reported salt to look
them up in its exact index of the workers' block events. No torch.

A request's `cache_salt` (vLLM's field: a tenant's secret) and the LoRA adapter it runs under are
hashed into its first block only (`first_block_key`), as vLLM puts both in the first block's extra
keys: every later block chains onto that one, so two tenants' blocks, or a base model's and an
adapter's, never share a hash.

A block's hash covers its parent block's hash, so equal hashes mean equal whole prefixes, not just equal
blocks. sha256 over a fixed byte layout keeps hashes stable across processes and machines, which Python's
salted ``hash()`` is not.
"""

import hashlib
import struct
from collections.abc import Sequence

HASH_SIZE = hashlib.sha256().digest_size
# A text a worker and the gateway both tokenize (each with its own tokenizer for the model) and hash
# with the worker's salt when the worker registers: equal hashes say that the gateway's routing hashes
# name the worker's blocks. Long enough for a few blocks at any usual block size, and varied (digits,
# punctuation, accents, a newline) so that tokenizers that differ at all differ on it.
PROBE_TEXT = (
    "Tandem block-hash probe, version 1.\n"
    "The quick brown fox jumps over the lazy dog; 0123456789 times, at 3.14 km/h! "
    "Zoë's café served crème brûlée and naïve coöperation to 42 guests on 2026-12-07. "
    "Pack my box with five dozen liquor jugs: (a) {b} [c] <d> e@f.g #h $i %j ^k &l *m. "
    "How vexingly quick daft zebras jump, and sphinx of black quartz, judge my vow. "
    "Every block of this text is hashed by the worker and by the gateway alike, "
    "and the two chains must agree, block after block, from the first to the last."
)
_ROOT_HASH = bytes(HASH_SIZE)


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: bytes = b"", cache_salt: bytes = b"") -> bytes:
    """Hash one block of token ids chained onto ``parent`` (None for the first block of a sequence).

    Layout: parent hash (32 zero bytes for the root), salt length as little-endian uint64, salt, then each
    token id as little-endian int64; with a ``cache_salt`` (first blocks only), its length as uint64 and
    itself after the tokens. The lengths make the boundaries unambiguous; without a cache salt the
    layout is the one blocks always had.
    """
    if parent is not None and len(parent) != HASH_SIZE:
        raise ValueError(f"parent hash must be {HASH_SIZE} bytes, got {len(parent)}")
    if parent is not None and cache_salt:
        raise ValueError("cache_salt: belongs in a sequence's first block only")
    digest = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    digest.update(struct.pack("<Q", len(salt)))
    digest.update(salt)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if cache_salt:
        digest.update(struct.pack("<Q", len(cache_salt)))
        digest.update(cache_salt)
    return digest.digest()


def first_block_key(cache_salt: str, adapter: bytes = b"") -> bytes:
    """What a sequence's first block hashes after its tokens (`hash_block`'s cache_salt): the
    request's cache_salt and the fingerprint of the LoRA adapter it runs under (engine.lora.adapter;
    b"" for the base model). Without an adapter it is the salt alone, as blocks always hashed; with
    one it starts with 0xff, a byte no UTF-8 salt holds, so no salt can pose as an adapter."""
    if not adapter:
        return cache_salt.encode()
    return b"\xff" + struct.pack("<Q", len(adapter)) + adapter + cache_salt.encode()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"",
                        cache_salt: bytes = b"") -> list[bytes]:
    """Hash chain of every full block of ``token_ids``; a trailing partial block is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], salt, cache_salt if parent is None else b"")
        hashes.append(parent)
    return hashes
