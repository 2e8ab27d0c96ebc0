"""The torch attention path's prefill, beyond its agreement with the Triton kernels
(test_triton_attention.py) and with transformers (test_engine_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import reference
from engine.attention.reference import paged_decode_attention, paged_prefill_attention
from engine.kv_cache.codec import FP8_E4M3, INT8


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal attention of q (the last positions) over keys/values, heads repeated for GQA."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * q.shape[-1] ** -0.5
    visible = torch.ones(q.shape[0], keys.shape[0], dtype=torch.bool).tril(diagonal=offset)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def test_prefill_feeds_sdpa_batched_tensors_and_stays_exact(monkeypatch):
    # Regression: given 3-d tensors, CPU SDPA takes its unfused path, 4x slower on a 1,024-token
    # prompt than the flash kernel it uses for [batch, heads, len, head_dim] inputs.
    dims: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        dims.append(query.dim())
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(reference.F, "scaled_dot_product_attention", recording)
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 8, 6, 2, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    table = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32)
    # Sequence 0: a whole 14-token prompt; sequence 1: 6 new tokens after a cached prefix of 10.
    q = torch.randn(14 + 6, heads, head_dim)
    out = paged_prefill_attention(q, k_cache, v_cache, table, torch.tensor([0, 14, 20]), torch.tensor([14, 16]),
                                  head_dim**-0.5)
    assert dims == [4, 4]
    for rows, seq, seq_len in ((slice(0, 14), 0, 14), (slice(14, 20), 1, 16)):
        keys = k_cache[table[seq].long()].reshape(-1, kv_heads, head_dim)[:seq_len]
        values = v_cache[table[seq].long()].reshape(-1, kv_heads, head_dim)[:seq_len]
        expected = _naive(q[rows], keys, values, seq_len - q[rows].shape[0])
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_chunk_after_a_prefix_attends_in_two_flash_passes_as_one_masked_pass_would(dtype):
    """A chunk of SPLIT_QUERY queries or more after cached positions: prefix and causal passes joined
    by their log-sum-exps (context parallelism's later slices) compute the masked attention."""
    torch.manual_seed(1)
    block_size, heads, kv_heads, head_dim, cached = 16, 6, 2, 16, 200
    query_len = reference.SPLIT_QUERY + 44
    seq_len = cached + query_len
    blocks = -(-seq_len // block_size)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    table = torch.randperm(blocks, dtype=torch.int32)[None, :]
    q = torch.randn(query_len, heads, head_dim, dtype=dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, table, torch.tensor([0, query_len]), torch.tensor([seq_len]),
                                  head_dim**-0.5)
    keys = k_cache[table[0].long()].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    values = v_cache[table[0].long()].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    expected = _naive(q.float(), keys, values, cached)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("codec", [FP8_E4M3, INT8], ids=lambda c: c.name)
def test_a_quantized_cache_is_read_as_its_decoded_values(codec):
    torch.manual_seed(0)
    k_cache, v_cache = (codec.encode(torch.randn(8, 4, 2, 16)) for _ in range(2))
    k_values, v_values = (codec.decode(cache, torch.float32) for cache in (k_cache, v_cache))
    table = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32)
    q = torch.randn(20, 6, 16)
    args = (table, torch.tensor([0, 14, 20]), torch.tensor([14, 16]), 0.25)
    assert torch.equal(paged_prefill_attention(q, k_cache, v_cache, *args, codec),
                       paged_prefill_attention(q, k_values, v_values, *args))
    lens = torch.tensor([9, 16])
    assert torch.equal(paged_decode_attention(q[:2], k_cache, v_cache, table, lens, 0.25, codec),
                       paged_decode_attention(q[:2], k_values, v_values, table, lens, 0.25))
