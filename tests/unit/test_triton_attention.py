"""Triton paged attention against the torch reference, and attention backend selection.

Without a GPU the kernels run in Triton's interpreter, which Triton enables per kernel when the
kernel module is imported: hence the environment variable is set before any engine import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import (
    TorchPagedAttention,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.attention.selector import (
    select_attention_backend,
    triton_kv_unsupported_reason,
    triton_unsupported_reason,
)
from engine.attention.triton_paged import (
    TritonPagedAttention,
    num_kv_splits,
    triton_paged_decode_attention,
)
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.codec import DENSE, FP8_E4M3, INT4, INT8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = 1e-5 if DEVICE == "cpu" else 1e-4
NUM_BLOCKS = 80
# (num_heads, num_kv_heads, block_size, head_dim): GQA ratios 3 (the real model), 4 and 1.
SHAPES = [(9, 3, 16, 64), (8, 2, 32, 64), (4, 4, 16, 64), (4, 4, 32, 32), (8, 2, 16, 32)]


def _caches(shape, dtype=torch.float32, seed=0):
    _, num_kv_heads, block_size, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=generator)
    return k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype)


def _block_tables(seq_lens, block_size, seed=0):
    """Disjoint, shuffled (so non-contiguous) block ids per sequence, zero padded plus a spare column."""
    needed = [blocks_for(n, block_size) for n in seq_lens]
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    for i, count in enumerate(needed):
        table[i, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
    return table.to(DEVICE)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _query_start_loc(query_lens):
    return _int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])


def _queries(num_tokens, num_heads, head_dim, dtype=torch.float32, seed=1):
    q = torch.randn(num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return q.to(DEVICE, dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference(shape):
    num_heads, _, block_size, head_dim = shape
    # Length 1, block aligned, partial last blocks.
    seq_lens = [1, block_size, 2 * block_size + 5, 3 * block_size - 1]
    k_cache, v_cache = _caches(shape)
    tables = _block_tables(seq_lens, block_size)
    q = _queries(len(seq_lens), num_heads, head_dim)
    args = (q, k_cache, v_cache, tables, _int32(seq_lens), head_dim**-0.5)
    torch.testing.assert_close(
        triton_paged_decode_attention(*args), paged_decode_attention(*args), atol=FP32_TOL, rtol=FP32_TOL
    )


def test_decode_long_contexts_split_across_programs():
    shape = (9, 3, 16, 64)
    seq_lens = [300, 700, 5]
    assert num_kv_splits(len(seq_lens) * 3, max(seq_lens)) > 1  # otherwise this test misses the merge kernel
    k_cache, v_cache = _caches(shape)
    tables = _block_tables(seq_lens, 16)
    q = _queries(len(seq_lens), 9, 64)
    args = (q, k_cache, v_cache, tables, _int32(seq_lens), 0.125)
    torch.testing.assert_close(
        triton_paged_decode_attention(*args), paged_decode_attention(*args), atol=FP32_TOL, rtol=FP32_TOL
    )


def test_num_kv_splits_fills_the_gpu_but_keeps_slices_long():
    assert num_kv_splits(num_programs=3, max_seq_len=100) == 1
    assert num_kv_splits(num_programs=3, max_seq_len=1000) == 4
    assert num_kv_splits(num_programs=3, max_seq_len=700) == 2  # rounded down to a power of two
    assert num_kv_splits(num_programs=512, max_seq_len=100_000) == 1
    assert num_kv_splits(num_programs=1, max_seq_len=1_000_000) == 32


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cached_prefix", [False, True])
def test_prefill_matches_reference(shape, cached_prefix):
    num_heads, _, block_size, head_dim = shape
    query_lens = [block_size, 1, 2 * block_size + 3, 7]
    prefixes = [block_size + 4, 0, block_size, 2 * block_size] if cached_prefix else [0, 0, 0, 0]
    seq_lens = [n + p for n, p in zip(query_lens, prefixes, strict=True)]
    k_cache, v_cache = _caches(shape)
    tables = _block_tables(seq_lens, block_size)
    q = _queries(sum(query_lens), num_heads, head_dim)
    args = (q, k_cache, v_cache, tables, _query_start_loc(query_lens), _int32(seq_lens), head_dim**-0.5)
    want = paged_prefill_attention(*args)
    got = _served(q, k_cache, v_cache, tables, query_lens, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=FP32_TOL, rtol=FP32_TOL)


def test_prefill_query_tiles_beyond_the_first():
    # 9 heads / 3 KV heads puts 16 query tokens in a tile: 50 tokens span four tiles.
    shape = (9, 3, 16, 64)
    query_lens, seq_lens = [50, 3], [70, 3]
    k_cache, v_cache = _caches(shape)
    tables = _block_tables(seq_lens, 16)
    q = _queries(sum(query_lens), 9, 64)
    args = (q, k_cache, v_cache, tables, _query_start_loc(query_lens), _int32(seq_lens), 0.125)
    want = paged_prefill_attention(*args)
    torch.testing.assert_close(_served(q, k_cache, v_cache, tables, query_lens, seq_lens, 0.125), want,
                               atol=FP32_TOL, rtol=FP32_TOL)


def _metadata(query_lens, seq_lens, tables, block_size):
    slots = []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=_query_start_loc(query_lens),
        seq_lens=_int32(seq_lens),
        block_tables=tables,
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens),
    )


def _served(q, k_cache, v_cache, tables, query_lens, seq_lens, scale):
    """What serves a step, TritonPagedAttention.forward, over caches that already hold the step's keys
    and values: it writes them to their slots again, then attends."""
    meta = _metadata(query_lens, seq_lens, tables, k_cache.shape[1])
    k, v = (cache.view(-1, *cache.shape[2:])[meta.slot_mapping] for cache in (k_cache, v_cache))
    return TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta, scale)


def _backends_agree(shape, query_lens, seq_lens, codec=DENSE):
    num_heads, num_kv_heads, block_size, head_dim = shape
    k_cache, v_cache = (codec.encode(cache) for cache in _caches(shape))
    tables = _block_tables(seq_lens, block_size)
    meta = _metadata(query_lens, seq_lens, tables, block_size)
    num_tokens = sum(query_lens)
    # q, k and v as views into one fused projection output, as a model produces them.
    qkv = _queries(num_tokens, num_heads + 2 * num_kv_heads, head_dim, seed=2).reshape(num_tokens, -1)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    torch_caches = (k_cache.clone(), v_cache.clone())
    got = TritonPagedAttention(codec).forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    want = TorchPagedAttention(codec).forward(q, k, v, *torch_caches, meta, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=FP32_TOL, rtol=FP32_TOL)
    assert torch.equal(k_cache, torch_caches[0]) and torch.equal(v_cache, torch_caches[1])
    # The step's keys really landed in the cache: the first new token's slot holds its (encoded) key.
    slot = int(meta.slot_mapping[0])
    assert torch.equal(k_cache.view(-1, *k_cache.shape[2:])[slot], codec.encode(k[0]))


@pytest.mark.parametrize("shape", [(9, 3, 16, 64), (8, 2, 32, 64)])
def test_forward_mixed_batch_matches_torch_backend(shape):
    block_size = shape[2]
    # Decode rows, a chunk after a cached prefix, a fresh prompt, a one-token prompt.
    query_lens = [1, 12, 17, 1, 1]
    seq_lens = [20, block_size + 13, 17, 1, 2 * block_size]
    _backends_agree(shape, query_lens, seq_lens)


def test_forward_decode_batch_matches_torch_backend():
    _backends_agree((9, 3, 16, 64), query_lens=[1, 1, 1], seq_lens=[400, 33, 1])


@pytest.mark.parametrize("codec", [FP8_E4M3, INT8, INT4], ids=lambda c: c.name)
def test_quantized_cache_mixed_batch_matches_torch_backend(codec):
    # The kernel reads codes and applies each row's scale to its scores and probabilities (int4:
    # widens each tile by its groups' scales and minima, and attends in the rotated basis); the
    # torch backend decodes the rows first (int4: rotates them back): the same numbers up to
    # float32 rounding.
    _backends_agree((9, 3, 16, 64), query_lens=[1, 12, 17, 1], seq_lens=[20, 29, 17, 32], codec=codec)


@pytest.mark.parametrize("codec", [FP8_E4M3, INT8, INT4], ids=lambda c: c.name)
def test_quantized_cache_split_decode_matches_torch_backend(codec):
    _backends_agree((9, 3, 16, 64), query_lens=[1, 1], seq_lens=[400, 5], codec=codec)


@pytest.mark.parametrize("shape", [(8, 2, 32, 128), (4, 4, 16, 96)])
def test_int4_cache_of_several_groups_and_a_padded_head_dim_matches_torch_backend(shape):
    # Eight and six scale groups a row; head_dim 96 (rotated in three blocks of 32) pads to 128
    # lanes, whose masked bytes must read as zeros.
    _backends_agree(shape, query_lens=[1, 9, 1], seq_lens=[40, 9, 3], codec=INT4)


def test_bf16_inputs_close_to_fp32_reference():
    shape = (9, 3, 16, 64)
    query_lens, seq_lens = [1, 20, 9], [30, 45, 9]
    k_cache, v_cache = _caches(shape, torch.bfloat16)
    tables = _block_tables(seq_lens, 16)
    q = _queries(sum(query_lens), 9, 64, torch.bfloat16)
    locs, lens = _query_start_loc(query_lens), _int32(seq_lens)
    want = paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, locs, lens, 0.125)
    got = _served(q, k_cache, v_cache, tables, query_lens, seq_lens, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)

    decode_q = q[torch.tensor([0, 20, 29], device=DEVICE)]
    got = triton_paged_decode_attention(decode_q, k_cache, v_cache, tables, lens, 0.125)
    want = paged_decode_attention(decode_q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_selector_torch_by_name():
    assert isinstance(select_attention_backend("torch", DEVICE), TorchPagedAttention)


def test_selector_auto_on_cpu_is_torch():
    assert isinstance(select_attention_backend("auto", "cpu"), TorchPagedAttention)


def test_selector_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_attention_backend("triton", "cpu")


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter is only in use without a GPU")
def test_selector_triton_on_cpu_with_the_interpreter():
    backend = select_attention_backend("triton", "cpu")
    assert isinstance(backend, TritonPagedAttention)
    assert backend.name == "triton"


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
def test_selector_auto_on_cuda_is_triton():
    assert isinstance(select_attention_backend("auto", "cuda"), TritonPagedAttention)


def test_selector_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown"):
        select_attention_backend("flash", "cpu")  # type: ignore[arg-type]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter is only in use without a GPU")
def test_selector_hands_the_kv_codec_to_the_backend():
    assert select_attention_backend("triton", "cpu", INT8).codec is INT8
    assert select_attention_backend("torch", "cpu", FP8_E4M3).codec is FP8_E4M3
    assert select_attention_backend("auto", "cpu").codec is DENSE


def test_triton_reads_fp8_only_where_triton_has_fp8_e4m3():
    assert "8.9" in triton_kv_unsupported_reason(FP8_E4M3, (8, 0))
    assert triton_kv_unsupported_reason(FP8_E4M3, (8, 9)) is None
    assert triton_kv_unsupported_reason(FP8_E4M3, None) is None  # the interpreter, or a ROCm GPU
    assert triton_kv_unsupported_reason(INT8, (7, 0)) is None
    assert triton_kv_unsupported_reason(DENSE, (7, 0)) is None


def test_triton_with_fp8_on_a_gpu_without_it_is_refused_naming_the_flag(monkeypatch):
    from engine.attention import selector

    monkeypatch.setattr(selector, "_nvidia_capability", lambda device: (8, 0))
    expected = (r"^kv_cache_dtype: fp8_e4m3 has no kernel for attention backend 'triton' on cuda:0 "
                r"\(.*8\.0; supported there: auto, int8, or attention backend torch\)$")
    with pytest.raises(ValueError, match=expected):
        select_attention_backend("triton", "cuda:0", FP8_E4M3)


def test_triton_unsupported_reason():
    assert "TRITON_INTERPRET" in triton_unsupported_reason("cpu", {})
    assert triton_unsupported_reason("cpu", {"TRITON_INTERPRET": "0"}) is not None
    assert triton_unsupported_reason("cpu", {"TRITON_INTERPRET": "1"}) is None
    assert triton_unsupported_reason("cuda:0", {}) is None
    assert triton_unsupported_reason("mps", {}) is not None
