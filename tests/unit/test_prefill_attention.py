"""The CPU kernels' causal prefill attention over bf16 (engine/model/kernels/prefill_attention.cpp):
against SDPA, its refusals, and where the torch backend uses it. The op exists only in the build for
CPUs with AVX512-BF16; elsewhere the tests that call it skip, naming the flag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from environment import needs

import engine.model.kernels as kernel_module
from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import TorchPagedAttention
from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable

WITH_OP = [v.name for v in runnable(cpu_flags()) if v.name == "avx512bf16"]
needs_op = needs(bool(WITH_OP), "a build with prefill_attention (a CPU with avx512_bf16)")


def _op():
    """The build's op itself, which also runs where the CPU has AMX (the engine does not use it there)."""
    return kernels(WITH_OP[0])._ops.prefill_attention


def _chunk(seed: int, queries: int, keys: int, heads: int, kv_heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, heads, head_dim, generator=gen).bfloat16()
    k, v = torch.randn(2, keys, kv_heads, head_dim, generator=gen).bfloat16().unbind(0)
    return q, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference in fp32 over the same bf16 values: query i sees keys 0..S−T+i."""
    queries, keys = q.shape[0], k.shape[0]
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)
    out = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


@needs_op
@pytest.mark.parametrize(("queries", "keys", "heads", "kv_heads", "head_dim"), [
    (37, 37, 9, 3, 64),  # a whole prompt, the shipped model's heads; a short last tile of rows
    (20, 53, 9, 3, 64),  # a later chunk over a cached prefix
    (1, 5, 4, 4, 64),  # one query, one head per KV head
    (64, 64, 8, 2, 128),  # two passes of 64 dimensions, four heads per KV head
])
def test_prefill_attention_matches_sdpa_within_bf16_rounding(queries, keys, heads, kv_heads, head_dim):
    q, k, v = _chunk(queries + keys, queries, keys, heads, kv_heads, head_dim)
    got = _op()(q, k, v, head_dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # Outputs are softmax-weighted means of unit-normal values (|out| < 4): the exponentials rounded
    # to bf16 (2^-9 relative) and the output rounded once more stay below 1.6e-2; a misread key,
    # head or mask moves outputs by 0.1 and more.
    torch.testing.assert_close(got.float(), _sdpa(q, k, v, head_dim**-0.5), rtol=0, atol=1.6e-2)


@needs_op
def test_prefill_attention_refuses_what_it_cannot_step_through():
    op = _op()
    q, k, v = _chunk(0, 8, 8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op(q.float(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 64"):
        op(*_chunk(0, 8, 8, 4, 2, 32), 0.125)
    with pytest.raises(RuntimeError, match=r"must be 1\.\.8"):
        op(*_chunk(0, 9, 8, 4, 2, 64)[:1], k, v, 0.125)


def test_no_prefill_op_where_the_cpu_has_amx_or_the_build_lacks_it(monkeypatch):
    for variant in runnable(cpu_flags()):
        if variant.name != "avx512bf16":
            assert kernels(variant.name).prefill_attention is None
    if WITH_OP:
        # Served where the CPU has no AMX; where it has, torch's flash kernel runs on AMX tiles.
        assert (kernels(WITH_OP[0]).prefill_attention is None) == ("amx_bf16" in cpu_flags())
        monkeypatch.setattr(kernel_module, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
        assert kernels(WITH_OP[0]).prefill_attention is None  # torch's flash kernel runs on AMX tiles


def _prefill_meta(tokens: int, block_size: int = 16) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    blocks = -(-tokens // block_size)
    table = torch.arange(blocks, dtype=torch.int32).flip(0)[None]  # scattered: last block first
    slots = torch.tensor([int(table[0, t // block_size]) * block_size + t % block_size for t in range(tokens)])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
                             seq_lens=torch.tensor([tokens], dtype=torch.int32), block_tables=table,
                             query_lens_list=(tokens,), seq_lens_list=(tokens,))
    k_cache, v_cache = torch.zeros(2, blocks, block_size, 3, 64, dtype=torch.bfloat16).unbind(0)
    return meta, k_cache, v_cache


def test_the_torch_backend_runs_bf16_prompt_chunks_through_the_op_and_fp32_ones_through_sdpa():
    q, k, v = _chunk(7, 40, 40, 9, 3, 64)
    calls: list[int] = []

    def recording(*args):
        calls.append(args[0].shape[0])
        return _sdpa(*args).bfloat16()  # the op's contract, computed by the reference

    meta, k_cache, v_cache = _prefill_meta(40)
    got = TorchPagedAttention(dense_prefill=recording).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    want = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert calls == [40]
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1.6e-2)
    TorchPagedAttention(dense_prefill=recording).forward(q.float(), k.float(), v.float(), k_cache.float(),
                                                         v_cache.float(), meta, 0.125)
    assert calls == [40]  # fp32: SDPA


@needs_op
def test_the_op_through_the_torch_backend_matches_sdpa_over_scattered_pages():
    q, k, v = _chunk(8, 40, 40, 9, 3, 64)
    meta, k_cache, v_cache = _prefill_meta(40)
    backend = TorchPagedAttention(dense_prefill=kernels(WITH_OP[0]).prefill_attention)
    got = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    want = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1.6e-2)


def test_the_avx512bf16_build_is_served_first_only_where_the_cpu_has_every_flag_it_compiles_for():
    zen5 = frozenset(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                      "avx512_vnni"])
    assert [v.name for v in runnable(zen5)] == ["avx512bf16", "avx2", "scalar"]
    assert [v.name for v in runnable(zen5 - {"avx512_bf16"})] == ["avx2", "scalar"]
    assert [v.name for v in runnable(zen5 - {"avx512_vnni"})] == ["avx2", "scalar"]
    assert [v.name for v in runnable(frozenset(["avx2", "fma", "f16c"]))] == ["avx2", "scalar"]
