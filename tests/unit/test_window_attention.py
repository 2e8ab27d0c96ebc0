"""Sliding-window attention (engine.kv_cache.window) in the torch and Triton backends: each query
sees exactly the last `size` positions and the sinks, and a block the window freed is never read,
even when it holds NaN. Triton runs in its interpreter without a GPU (see test_triton_attention)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import TorchPagedAttention
from engine.attention.triton_paged import TritonPagedAttention
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.window import KVWindow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 8
NUM_BLOCKS = 40
NAN_BLOCK = 0  # every freed table entry names this block, filled with NaN
HEADS, KV_HEADS, DIM = 4, 2, 32


def _windowed_case(window: KVWindow, query_lens: list[int], seq_lens: list[int], seed: int = 0):
    """Caches, queries and metadata for a batch whose blocks outside `window` are freed: their table
    entries name a NaN block, as a freed block reused by anyone may hold anything."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    k_cache[NAN_BLOCK], v_cache[NAN_BLOCK] = float("nan"), float("nan")
    free_ids = iter(torch.randperm(NUM_BLOCKS - 1, generator=generator).add(1).tolist())
    width = max(blocks_for(n, BLOCK) for n in seq_lens)
    tables, slots = [], []
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        unneeded = window.unneeded_blocks(seq_len - query_len, BLOCK)
        row = [NAN_BLOCK if i in unneeded else next(free_ids) for i in range(blocks_for(seq_len, BLOCK))]
        tables.append(row + [NAN_BLOCK] * (width - len(row)))
        slots += [row[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - query_len, seq_len)]
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), query_start_loc=starts.to(DEVICE, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        query_lens_list=tuple(query_lens), seq_lens_list=tuple(seq_lens))
    q, k, v = (torch.randn(sum(query_lens), h, DIM, generator=generator).to(DEVICE)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, k_cache.to(DEVICE), v_cache.to(DEVICE), meta


def _naive(q, k_cache, v_cache, meta, window: KVWindow) -> torch.Tensor:
    """Per query row: softmax over the visible keys only, read one position at a time."""
    out = torch.empty_like(q)
    row = 0
    for seq, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
        table = meta.block_tables[seq].tolist()
        for query in range(seq_len - query_len, seq_len):
            keys = [p for p in range(seq_len) if window.visible(p, query)]
            k = torch.stack([k_cache[table[p // BLOCK], p % BLOCK] for p in keys]).repeat_interleave(2, 1)
            v = torch.stack([v_cache[table[p // BLOCK], p % BLOCK] for p in keys]).repeat_interleave(2, 1)
            weights = torch.softmax(torch.einsum("hd,khd->hk", q[row], k) * DIM**-0.5, dim=-1)
            out[row] = torch.einsum("hk,khd->hd", weights, v)
            row += 1
    return out


CASES = {
    "model window, decode rows": (KVWindow(12), [1, 1, 1], [5, 30, 47]),
    "model window, prompt chunks and decode": (KVWindow(16), [20, 1, 9], [20, 41, 57]),
    "window and sinks": (KVWindow(10, sink_tokens=8), [1, 13, 1], [40, 50, 9]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_query_sees_its_window_and_never_a_freed_block(case: str, backend: str) -> None:
    window, query_lens, seq_lens = CASES[case]
    q, k, v, k_cache, v_cache, meta = _windowed_case(window, query_lens, seq_lens)
    attention = TorchPagedAttention(window=window) if backend == "torch" else TritonPagedAttention(window=window)
    out = attention.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    assert not out.isnan().any()
    expected = _naive(q, k_cache.cpu(), v_cache.cpu(), meta, window)
    assert (out.cpu() - expected).abs().max().item() < 1e-4


def test_the_window_frees_only_blocks_no_later_query_sees() -> None:
    window = KVWindow(16, sink_tokens=8)
    # Query 40 sees 25..40 and the sinks 0..7: blocks 1 and 2 (8..23) are unneeded, block 3 (24..31) is not.
    assert window.unneeded_blocks(40, 8) == range(1, 3)
    assert window.unneeded_blocks(20, 8) == range(1, 0)  # nothing yet
    assert KVWindow(16).unneeded_blocks(40, 8) == range(0, 3)
    assert window.visible(3, 100) and window.visible(85, 100) and not window.visible(84, 100)
    assert not window.visible(101, 100)
