"""The CPU kernels' RMSNorm, rotary embedding, SwiGLU gating and paged decode attention
(engine/model/kernels) against the torch ops
they replace, for every build this CPU runs (the scalar one always), and where the engine uses them."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import SHORT_QUERY, TorchPagedAttention, paged_decode_attention
from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable
from engine.model.llama import rms_norm, silu_mul
from engine.model.rope import apply_rotary

VARIANTS = [variant.name for variant in runnable(cpu_flags())]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (3, 2, 64), (2, 13)])
def test_rms_norm_matches_torch_within_float32_summation_order(variant, shape):
    # Only the order of the mean's float32 sum differs from torch's (n terms, each rounding by at
    # most 2^-24 of the running sum): 1e-6 relative is above that at n = 576 and far below what a
    # wrong mean, epsilon or weight moves (1e-3 and more).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    got = kernels(variant).rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6)
    tiny = torch.full(shape, 1e-4)  # where eps is most of the mean of squares
    torch.testing.assert_close(kernels(variant).rms_norm(tiny, weight, 1e-5), rms_norm(tiny, weight, 1e-5),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rms_norm_of_a_row_does_not_depend_on_its_batch(variant):
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(576)
    batched = kernels(variant).rms_norm(x, weight, 1e-6)
    assert all(torch.equal(batched[i], kernels(variant).rms_norm(x[i : i + 1], weight, 1e-6)[0]) for i in range(7))
    assert torch.equal(kernels(variant).rms_norm(x.t().contiguous().t(), weight, 1e-6), batched)  # strided input


@pytest.mark.parametrize("variant", VARIANTS)
def test_rotary_rotates_a_view_in_place_bit_for_bit_as_apply_rotary(variant):
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 15 * 64, generator=gen)  # 12 rotated heads, then 3 that must stay as they are
    angles = torch.rand(5, 1, 32, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    want = apply_rotary(qkv[:, : 12 * 64].view(5, 12, 64), cos, sin)
    untouched = qkv[:, 12 * 64 :].clone()
    view = qkv[:, : 12 * 64].view(5, 12, 64)
    got = kernels(variant).rotary(view, cos, sin)
    assert got.data_ptr() == view.data_ptr() and torch.equal(got, want)
    assert torch.equal(qkv[:, 12 * 64 :], untouched)


@pytest.mark.parametrize("variant", VARIANTS)
def test_silu_mul_matches_torch_within_a_few_ulp(variant):
    # The AVX2 build's exp is a polynomial a few ulp from expf (exp8.h), the scalar one std::exp;
    # 1e-6 relative is above that and far below a wrong sign or half swapped (1e-1 and more).
    gen = torch.Generator().manual_seed(3)
    # Halves of 1,547: sixteen lanes to 1,536 (AVX-512), eight to 1,544, then three alone.
    gate_up = torch.randn(4, 2 * 1547, generator=gen) * 4
    gate_up[0, :12] = torch.tensor([-200.0, -100.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 100.0, 200.0])
    got = kernels(variant).silu_mul(gate_up)
    torch.testing.assert_close(got, silu_mul(gate_up), rtol=1e-6, atol=1e-30)
    assert torch.equal(kernels(variant).silu_mul(gate_up[2:3]), got[2:3])  # a row alone
    wide = torch.zeros(4, 2 * gate_up.shape[1] + 8)
    wide[:, : gate_up.shape[1]] = gate_up
    assert torch.equal(kernels(variant).silu_mul(wide[:, : gate_up.shape[1]]), got)  # rows of a wider tensor


@pytest.mark.skipif(not {"avx512bf16", "avx2"} <= set(VARIANTS),
                    reason="a CPU that runs both the AVX512-BF16 and the AVX2 builds")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sixteen_lanes_gate_bit_for_bit_as_eight(dtype):
    # exp16 is exp8's arithmetic on sixteen lanes (exp8.h): the AVX-512 build's SwiGLU must equal the
    # AVX2 build's, specials and the clamped range included.
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(5, 2 * 1547, generator=gen) * 30
    gate_up[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 88.4, -88.4, 1e-38, -1e-38])
    gate_up = gate_up.to(dtype)
    got = kernels("avx512bf16").silu_mul(gate_up)
    want = kernels("avx2").silu_mul(gate_up)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_in_bf16_the_norm_rotary_and_gating_round_where_torchs_bf16_ops_round(variant):
    # A bf16 model's ops (engine.model.llama in bf16): the rotary embedding rounds each product and
    # sum as torch does, so bit for bit; RMSNorm and SwiGLU compute in fp32 before rounding, where
    # their sum order (RMSNorm) and exp (SwiGLU) may differ from torch's by an fp32 ulp: the bf16
    # results then differ only where a value sits on a rounding boundary, by one bf16 ulp.
    gen = torch.Generator().manual_seed(5)
    ops = kernels(variant)
    x = (torch.randn(6, 576, generator=gen) * 3).bfloat16()
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).bfloat16()
    _assert_within_a_bf16_ulp(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    gate_up = (torch.randn(6, 2 * 1536, generator=gen) * 4).bfloat16()
    _assert_within_a_bf16_ulp(ops.silu_mul(gate_up), silu_mul(gate_up))
    qk = (torch.randn(6, 12, 64, generator=gen)).bfloat16()
    angles = torch.rand(6, 1, 32, generator=gen) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    want = apply_rotary(qk, cos, sin)
    assert torch.equal(ops.rotary(qk, cos, sin), want)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        ops.rms_norm(x, weight.float(), 1e-5)


def _assert_within_a_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert (got != want).float().mean().item() < 0.01  # nearly all the same bits


def _paged_batch(seed: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 16):
    """A cache of scattered blocks and a decode batch of 3 sequences (one reaching exactly a block's end)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(2, 12, block_size, kv_heads, head_dim, generator=gen).unbind(0)
    seq_lens = torch.tensor([37, 1, 32], dtype=torch.int32)
    tables = torch.tensor([[7, 2, 9, 0], [4, 0, 0, 0], [11, 5, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for b, n in enumerate(seq_lens.tolist())])
    q = torch.randn(3, heads, head_dim, generator=gen)
    k, v = torch.randn(2, 3, kv_heads, head_dim, generator=gen).unbind(0)
    return q, k, v, k_cache, v_cache, slots, tables, seq_lens


@pytest.mark.parametrize("variant", VARIANTS)
# Query heads per KV head: the op serves groups of 1 to 4 heads with their own register shapes and
# larger groups in pieces of at most 4 (6 = 4 + 2, 5 = 4 + 1).
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (3, 3), (8, 4), (8, 2), (12, 2), (10, 2)])
def test_decode_attention_stores_the_rows_and_matches_the_torch_path(variant, heads, kv_heads):
    q, k, v, k_cache, v_cache, slots, tables, seq_lens = _paged_batch(0, heads=heads, kv_heads=kv_heads)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for cache, rows in ((want_k, k), (want_v, v)):
        cache.view(-1, *rows.shape[1:])[slots] = rows
    want = paged_decode_attention(q, want_k, want_v, tables, seq_lens, 0.125)
    got = kernels(variant).decode_attention(q, k, v, k_cache, v_cache, slots, tables, seq_lens, 0.125)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # Softmax-weighted sums of unit-scale values over at most 37 rows in fp32: 1e-5 is above the
    # rounding of either order and far below a misread row, head or scale (1e-2 and more).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = kernels(variant).decode_attention(q[:1], k[:1], v[:1], k_cache, v_cache, slots[:1], tables[:1],
                                              seq_lens[:1], 0.125)
    assert torch.equal(alone[0], got[0])  # a sequence's result does not depend on its batch


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_attention_splits_one_long_sequence_over_threads_with_the_same_result(variant):
    # One sequence has only its KV heads as tasks: at 1,200 positions its three are spread over two
    # threads (the op splits by rows read, not by task count), each head still computed whole.
    gen = torch.Generator().manual_seed(3)
    length, block_size = 1200, 16
    blocks = length // block_size + 1
    k_cache, v_cache = torch.randn(2, blocks + 1, block_size, 3, 64, generator=gen).unbind(0)
    tables = (torch.randperm(blocks, generator=gen) + 1).int().view(1, -1)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    slots = torch.tensor([int(tables[0, (length - 1) // block_size]) * block_size + (length - 1) % block_size])
    q, k, v = torch.randn(1, 9, 64, generator=gen), *torch.randn(2, 1, 3, 64, generator=gen).unbind(0)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(kernels(variant).decode_attention(q, k, v, k_cache.clone(), v_cache.clone(), slots,
                                                             tables, seq_lens, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for cache, rows in ((want_k, k), (want_v, v)):
        cache.view(-1, 3, 64)[slots] = rows
    want = paged_decode_attention(q, want_k, want_v, tables, seq_lens, 0.125)
    torch.testing.assert_close(results[1], want, rtol=1e-5, atol=1e-5)


def _pairs_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention as the avx512bf16 build computes it over bf16 pages, in fp32 otherwise: the
    queries and the softmax's exponentials rounded to bf16, the sum they are divided by not."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        blocks = tables[b, : -(-length // block_size)].long()
        keys, values = (c[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, 1)
                        for c in (k_cache, v_cache))
        scores = torch.einsum("hd,thd->ht", q[b].bfloat16().float(), keys) * scale
        e = torch.exp(scores - scores.amax(1, keepdim=True))
        out[b] = torch.einsum("ht,thd->hd", e.bfloat16().float(), values) / e.sum(1, keepdim=True)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_decode_attention_over_bf16_pages_rounds_the_rows_as_torch(variant, head_dim):
    q, k, v, k_cache, v_cache, slots, tables, seq_lens = _paged_batch(4, head_dim=head_dim)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for cache, rows in ((want_k, k), (want_v, v)):
        cache.view(-1, *rows.shape[1:])[slots] = rows.bfloat16()  # torch's round to nearest-even
    got = kernels(variant).decode_attention(q, k, v, k_cache, v_cache, slots, tables, seq_lens, 0.125)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    if variant == "avx512bf16" and head_dim % 32 == 0:
        # bf16 pairs through vdpbf16ps: products exact, sums in fp32 in another order than the
        # reference's, so the same 1e-5 bound; a skipped rounding moves outputs by 1e-3 and more.
        want = _pairs_reference(q, want_k, want_v, tables, seq_lens, 0.125)
        widened = paged_decode_attention(q, want_k.float(), want_v.float(), tables, seq_lens, 0.125)
        assert (got - widened).abs().max() > 1e-4
    else:  # the pages widened to fp32 (exact) and everything in fp32
        want = paged_decode_attention(q, want_k.float(), want_v.float(), tables, seq_lens, 0.125)
    # Same bound as over fp32 pages: both sum the same fp32 values in another order.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = kernels(variant).decode_attention(q[2:], k[2:], v[2:], k_cache, v_cache, slots[2:], tables[2:],
                                              seq_lens[2:], 0.125)
    assert torch.equal(alone[0], got[2])  # a sequence's result does not depend on its batch
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels(variant).decode_attention(q, k, v, k_cache, v_cache.float(), slots, tables, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels(variant).decode_attention(q, k, v, k_cache, v_cache.float(), slots, tables, seq_lens, 0.125)


def _recording_op(calls: list[int]):
    def recording(*args):
        calls.append(args[0].shape[0])
        return kernels().decode_attention(*args)

    return recording


def _decode_meta(slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                             seq_lens=seq_lens, block_tables=tables, query_lens_list=(1, 1, 1),
                             seq_lens_list=tuple(seq_lens.tolist()))


def test_decode_attention_refuses_a_block_id_outside_the_cache():
    q, k, v, k_cache, v_cache, slots, tables, seq_lens = _paged_batch(1)
    tables[0, 2] = 12
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels().decode_attention(q, k, v, k_cache, v_cache, slots, tables, seq_lens, 0.125)


def test_the_torch_backend_runs_fp32_and_bf16_decode_batches_through_the_op_and_the_rest_through_torch():
    q, k, v, k_cache, v_cache, slots, tables, seq_lens = _paged_batch(2)
    calls: list[int] = []
    recording = _recording_op(calls)
    meta = _decode_meta(slots, tables, seq_lens)
    fast_k, fast_v = k_cache.clone(), v_cache.clone()
    got = TorchPagedAttention(dense_decode=recording).forward(q, k, v, fast_k, fast_v, meta, 0.125)
    want = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert calls == [3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast_k, k_cache) and torch.equal(fast_v, v_cache)
    TorchPagedAttention(dense_decode=recording).forward(q.double(), k.double(), v.double(), k_cache.double(),
                                                        v_cache.double(), meta, 0.125)
    assert calls == [3]  # not fp32 or bf16: the torch path
    bf16_k, bf16_v = k_cache.bfloat16(), v_cache.bfloat16()
    fast_k, fast_v = bf16_k.clone(), bf16_v.clone()
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16())
    got = TorchPagedAttention(dense_decode=recording).forward(*args, fast_k, fast_v, meta, 0.125)
    want = TorchPagedAttention().forward(*args, bf16_k, bf16_v, meta, 0.125)
    assert calls == [3, 3] and got.dtype == torch.bfloat16
    assert torch.equal(fast_k, bf16_k) and torch.equal(fast_v, bf16_v)
    # Both compute in fp32 over the same values; each output is then rounded to bf16 once (2^-8 relative).
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)


def test_a_head_dim_the_op_cannot_step_through_is_refused_by_it_and_served_by_torch():
    # The op reads eight dimensions at a time; a model with another head size must still decode.
    q, k, v, k_cache, v_cache, slots, tables, seq_lens = _paged_batch(3, head_dim=12)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8"):
        kernels().decode_attention(q, k, v, k_cache.clone(), v_cache.clone(), slots, tables, seq_lens, 0.125)
    calls: list[int] = []
    recording = _recording_op(calls)
    meta = _decode_meta(slots, tables, seq_lens)
    got = TorchPagedAttention(dense_decode=recording).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
    want = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert calls == []
    assert torch.equal(got, want)


def test_short_chunks_attend_through_the_op_each_row_over_its_own_prefix():
    # A speculative verification (drafts after the last token) is a chunk of a few rows: the op
    # serves it as one decode row per query row, row j of n seeing the first seq_len - n + j + 1
    # positions; a longer chunk is a prompt's and takes the prompt path.
    gen = torch.Generator().manual_seed(4)
    block_size, blocks = 16, 12
    k_cache, v_cache = torch.randn(2, blocks, block_size, 3, 64, generator=gen).unbind(0)
    query_lens, seq_lens = (5, 1, SHORT_QUERY), (37, 20, 40)
    tables = torch.tensor([[7, 2, 9, 0], [4, 3, 0, 0], [11, 5, 6, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size
                          for b, (n, s) in enumerate(zip(query_lens, seq_lens, strict=True)) for p in range(s - n, s)])
    tokens = sum(query_lens)
    q = torch.randn(tokens, 9, 64, generator=gen)
    k, v = torch.randn(2, tokens, 3, 64, generator=gen).unbind(0)
    starts = torch.tensor([0, 5, 6, tokens], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             query_lens_list=query_lens, seq_lens_list=seq_lens)
    calls: list[int] = []
    fast_k, fast_v = k_cache.clone(), v_cache.clone()
    got = TorchPagedAttention(dense_decode=_recording_op(calls)).forward(q, k, v, fast_k, fast_v, meta, 0.125)
    want = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert calls == [tokens]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast_k, k_cache) and torch.equal(fast_v, v_cache)
    rows = torch.randn(SHORT_QUERY + 1, 9, 64, generator=gen)
    kv = torch.randn(SHORT_QUERY + 1, 3, 64, generator=gen)
    longer = AttentionMetadata(
        slot_mapping=torch.tensor([int(tables[2, p // block_size]) * block_size + p % block_size
                                   for p in range(2, SHORT_QUERY + 3)]),
        query_start_loc=torch.tensor([0, SHORT_QUERY + 1], dtype=torch.int32),
        seq_lens=torch.tensor([SHORT_QUERY + 3], dtype=torch.int32), block_tables=tables[2:].contiguous(),
        query_lens_list=(SHORT_QUERY + 1,), seq_lens_list=(SHORT_QUERY + 3,))
    TorchPagedAttention(dense_decode=_recording_op(calls)).forward(rows, kv, kv, k_cache, v_cache, longer, 0.125)
    assert calls == [tokens]  # a prompt-sized chunk: not the op
