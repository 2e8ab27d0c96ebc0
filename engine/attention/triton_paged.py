"""Triton attention over the paged KV cache: one causal kernel for prefill, decode and mixed batches.

Each program owns one KV head of one sequence and a tile of that sequence's query tokens, and
treats every (query token, query head of the group) pair as a row: under GQA the heads that share
a KV head share its K/V loads. Keys are visited in tiles of `_KV_TILE` positions with an online
softmax; each position finds its cache slot through the block table, so any block size works.
Decode batches with few programs also split each context across programs (flash-decoding) and
merge the partial results in a second kernel.

A quantized cache (engine.kv_cache.codec) is read as it is stored: 1-byte codes and one float32
scale per (token, KV head) row. The scales never multiply the codes: a key's scale multiplies its
column of scores, a value's scale its column of probabilities, so each costs one product per key.
An int4 cache's scales belong to groups of a row's elements, not to whole rows, so there the tile
is widened in registers instead: each byte's two nibbles times their group's float16 scale plus its
minimum. Its rows are stored rotated (an orthogonal H, its own inverse): the kernel attends with Hq,
since Hq . Hk = q . k, and the weighted sum of rotated values it returns is rotated back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.codec import DENSE, KVCodec
from engine.kv_cache.window import KVWindow

_LOG2E = 1.4426950408889634
_KV_TILE = 64  # keys per inner-loop step
_PREFILL_ROWS = 64  # (query token, head) rows per prefill program
_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on a GPU
_TARGET_PROGRAMS = 128  # roughly one wave of programs on a large GPU
_MIN_KEYS_PER_SPLIT = 256  # below this a split's launch and merge cost more than it saves
_MAX_SPLITS = 32
_FULL = 2**31 - 1  # the window of full attention: every earlier position


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window, sinks,  # a query sees the last `window` positions and the first `sinks` (engine.kv_cache.window)
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh,  # the scales' strides (unused unless SCALED)
    stride_vsb, stride_vst, stride_vsh,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
    PACKED: tl.constexpr, SCALE_GROUP: tl.constexpr,  # int4: scales per group of SCALE_GROUP elements
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (q_idx < query_len) & (head_in_group < GROUP)
    # The queries are the last query_len positions of the context.
    q_pos = seq_len - query_len + q_idx

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if not SCALED:
        # Round like the reference (which casts queries to the cache dtype); a quantized cache is
        # decoded to the queries' dtype instead.
        q = q.to(k_cache_ptr.dtype.element_ty)
    q = q.to(tl.float32)

    # Causality: nothing past this tile's last query is visible to any of its rows.
    kv_end = tl.minimum(seq_len, seq_len - query_len + (q_tile + 1) * BLOCK_Q)
    # Nothing before this tile's first query's window (but the sinks) is visible to any of its rows:
    # those blocks may be freed and hold anything, so they are never loaded, not just masked.
    kv_start = seq_len - query_len + q_tile * BLOCK_Q - window + 1
    num_tiles = tl.cdiv(kv_end, KV_TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(num_tiles, first_tile + tiles_per_split)

    row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(first_tile, last_tile):
        kv_pos = tile * KV_TILE + tl.arange(0, KV_TILE)
        kv_valid = (kv_pos < kv_end) & ((kv_pos >= kv_start) | (kv_pos < sinks))
        block_id = tl.load(block_tables_ptr + seq * stride_bt + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)
        slot = block_id.to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
        k = _load_tile(k_cache_ptr, k_scale_ptr, slot, in_block, kv_head, dims, kv_mask,
                       stride_kb, stride_kt, stride_kh, stride_ksb, stride_kst, stride_ksh, PACKED, SCALE_GROUP)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SCALED and not PACKED:
            k_scale_offsets = slot * stride_ksb + in_block * stride_kst + kv_head * stride_ksh
            scores = scores * tl.load(k_scale_ptr + k_scale_offsets, mask=kv_valid, other=0.0)[None, :]
        in_window = (kv_pos[None, :] > q_pos[:, None] - window) | (kv_pos[None, :] < sinks)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & in_window & kv_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 to avoid inf - inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = _load_tile(v_cache_ptr, v_scale_ptr, slot, in_block, kv_head, dims, kv_mask,
                       stride_vb, stride_vt, stride_vh, stride_vsb, stride_vst, stride_vsh, PACKED, SCALE_GROUP)
        weights = probs
        if SCALED and not PACKED:
            v_scale_offsets = slot * stride_vsb + in_block * stride_vst + kv_head * stride_vsh
            weights = probs * tl.load(v_scale_ptr + v_scale_offsets, mask=kv_valid, other=0.0)[None, :]
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=DOT_PRECISION)
        row_max = new_max

    # A split that got no keys has row_sum 0: it stores zeros and a log-sum-exp of -inf.
    safe_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    out = acc / safe_sum[:, None]
    out_offsets = (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + out_offsets + split * stride_os, out, mask=out_mask)
        lse = row_max + tl.log2(safe_sum)
        lse_offsets = (q_start + q_idx) * stride_lt + head * stride_lh + split
        tl.store(lse_ptr + lse_offsets, lse, mask=row_valid)


@triton.jit
def _load_tile(
    cache_ptr, scale_ptr, slot, in_block, kv_head, dims, mask,
    stride_b, stride_t, stride_h, stride_sb, stride_st, stride_sh, PACKED: tl.constexpr, SCALE_GROUP: tl.constexpr,
):
    """A tile of K (or V) rows as float32 [KV_TILE, HEAD_DIM_PAD]: the values or 1-byte codes as
    stored, or (PACKED, int4) element d as the low (even d) or high (odd d) nibble of byte d // 2,
    times the float16 scale of group d // SCALE_GROUP plus its minimum (masked lanes read 0)."""
    row = slot[:, None] * stride_b + in_block[:, None] * stride_t + kv_head * stride_h
    if PACKED:
        packed = tl.load(cache_ptr + row + (dims // 2)[None, :], mask=mask, other=0).to(tl.int32)
        codes = (packed >> ((dims % 2) * 4)[None, :]) & 15
        # Each group's float16 (scale, minimum) pair, contiguous after the codes.
        pair = scale_ptr + slot[:, None] * stride_sb + in_block[:, None] * stride_st + kv_head * stride_sh
        pair += (dims // SCALE_GROUP * 2)[None, :]
        scales = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
        minima = tl.load(pair + 1, mask=mask, other=0.0).to(tl.float32)
        tile = codes.to(tl.float32) * scales + minima
    else:
        tile = tl.load(cache_ptr + row + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    return tile


@triton.jit
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    lse = tl.load(lse_ptr + token * stride_lt + head * stride_lh + splits)
    # Every context holds at least one key, so some split has a finite log-sum-exp.
    weights = tl.exp2(lse - tl.max(lse, 0))
    partial_offsets = token * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :]
    partial = tl.load(partial_ptr + partial_offsets, mask=dim_valid[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partial, 0) / tl.sum(weights, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def num_kv_splits(num_programs: int, max_seq_len: int) -> int:
    """How many programs share one decode context: enough to fill the GPU, never tiny slices.

    Always a power of two, which bounds the number of compiled kernel variants.
    """
    by_occupancy = max(1, _TARGET_PROGRAMS // num_programs)
    by_length = triton.cdiv(max_seq_len, _MIN_KEYS_PER_SPLIT)
    splits = min(by_occupancy, by_length, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    codec: KVCodec,
    window: KVWindow | None = None,
) -> torch.Tensor:
    """Launch the kernel(s); the host-side maxima size the grid without a device sync."""
    q = codec.kernel_basis(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    k_cache, k_scales, k_scale_strides = _kernel_operands(codec, k_cache)
    v_cache, v_scales, v_scale_strides = _kernel_operands(codec, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if max_query_len == 1:
        group_pad, block_q = max(triton.next_power_of_2(group), _MIN_DOT_ROWS), 1
        num_splits = num_kv_splits(batch * num_kv_heads, max_seq_len)
    else:
        group_pad = triton.next_power_of_2(group)
        block_q = max(1, _PREFILL_ROWS // group_pad)
        num_splits = 1

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits == 1:
        partial, lse = out, out  # lse is never touched without splits
        partial_split_stride, lse_strides = 0, (0, 0)
    else:
        partial = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_split_stride, lse_strides = partial.stride(2), (lse.stride(0), lse.stride(1))

    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)
    grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scales, v_scales, partial, lse,
        block_tables, query_start_loc, seq_lens,
        scale * _LOG2E,
        _FULL if window is None else window.size, 0 if window is None else window.sink_tokens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *k_scale_strides, *v_scale_strides,
        partial.stride(0), partial.stride(1), partial_split_stride,
        *lse_strides,
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        KV_TILE=_KV_TILE, NUM_SPLITS=num_splits,
        # Codes are exact in tf32; what decides is the dtype the values are computed in.
        DOT_PRECISION="ieee" if (q.dtype if codec.scaled else k_cache.dtype) == torch.float32 else "tf32",
        SCALED=codec.scaled,
        PACKED=codec.packed,
        SCALE_GROUP=head_dim // k_scales.shape[-2] if codec.packed else 1,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial, lse, out,
            partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        )
    return codec.kernel_basis(out)


def _kernel_operands(codec: KVCodec, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Values or codes, scales and the scales' block, token and head strides; a dense cache has no
    scales, which the kernel then never reads: the cache itself stands in, with zero strides."""
    values, scales = codec.kernel_operands(cache)
    if scales is None:
        return values, values, (0, 0, 0)
    return values, scales, scales.stride()[:3]


def triton_paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    codec: KVCodec = DENSE,
    window: KVWindow | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.paged_decode_attention` (reads the longest context back to the host)."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _paged_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, 1, int(seq_lens.max()), codec, window
    )


class TritonPagedAttention:
    """The Triton backend: one kernel launch per layer for decode, prefill or a mix of both; pages
    are written through `codec` and read by the kernel as stored; with a `window`, each query
    attends through it."""

    name = "triton"

    def __init__(self, codec: KVCodec = DENSE, window: KVWindow | None = None) -> None:
        self.codec = codec
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward`; the batch maxima come from the metadata's host copies."""
        self.codec.write(k_cache, v_cache, meta.slot_mapping, k, v)
        return _paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            meta.max_query_len, meta.max_seq_len, self.codec, self.window,
        )
