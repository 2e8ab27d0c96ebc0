"""Torch paged attention: the reference the Triton kernels are tested against, and the CPU path."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.attention.windowed import windowed_attention
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.codec import DENSE, KVCodec
from engine.kv_cache.window import KVWindow

# (q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale) -> out: stores a decode
# batch's K/V and attends, over dense pages (engine.model.kernels' decode_attention).
DenseDecode = Callable[..., torch.Tensor]
# (q [T, H, D], k [S, KVH, D], v [S, KVH, D], scale) -> out [T, H, D]: causal attention of a prompt
# chunk's bf16 queries (the last T of S positions) over bf16 keys and values, head_dim a multiple of 64
# (engine.model.kernels' prefill_attention).
DensePrefill = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
KERNEL_PAGES = (torch.float32, torch.bfloat16)  # the page dtypes DenseDecode reads
# Queries of at most this many rows per sequence (a speculative verification: up to 16 drafts and
# the token before them) attend through DenseDecode, each row as a decode row over its own prefix:
# it reads the pages in place, where the prompt path first gathers the whole context per layer,
# which for a few rows costs more than the attention itself (docs/benchmarks.md, "Decisions settled
# by experiments").
SHORT_QUERY = 17
# A prompt chunk of at least this many queries after cached positions attends in two flash passes
# (prefix, then causal over itself) instead of one masked pass that computes the masked pairs too:
# it pays once the chunk is a good part of its context (a split prefill's later slices).
SPLIT_QUERY = 256


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, codec: KVCodec = DENSE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The first seq_len cached rows of one sequence, read through `codec` (scaled ones decode to
    `dtype`): [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = blocks_for(seq_len, block_size)
    rows = codec.read(cache, block_table[:num_blocks], dtype)
    return rows.reshape(num_blocks * block_size, *rows.shape[2:])[:seq_len]


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    codec: KVCodec = DENSE,
) -> torch.Tensor:
    """One query token per sequence against its whole paged context, batched with padding."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    max_len = int(seq_lens.max())
    max_blocks = blocks_for(max_len, block_size)
    table = block_tables[:, :max_blocks]
    rows = (batch, max_blocks * block_size, num_kv_heads, head_dim)
    keys = codec.read(k_cache, table, q.dtype).view(rows).transpose(1, 2)
    values = codec.read(v_cache, table, q.dtype).view(rows).transpose(1, 2)
    positions = torch.arange(max_blocks * block_size, device=q.device)
    visible = (positions[None, :] < seq_lens[:, None].to(positions.device))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :].to(keys.dtype), keys, values, attn_mask=visible, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[:, :, 0, :].to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    codec: KVCodec = DENSE,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        out[starts[i] : starts[i + 1]] = causal_over_context(
            q[starts[i] : starts[i + 1]], k_cache, v_cache, block_tables[i], seq_len, scale, codec
        )
    return out


def causal_over_context(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
    scale: float, codec: KVCodec, dense_prefill: DensePrefill | None = None,
) -> torch.Tensor:
    """One sequence's queries (the last len(q) of its `seq_len` positions) over its whole context:
    the CPU kernels' prefill op for bf16 where given, else SDPA's flash passes, causal over a whole
    prompt and split at the prefix for a long later chunk, so masked pairs are skipped."""
    query_len, num_heads, head_dim = q.shape
    if dense_prefill is not None and q.dtype == torch.bfloat16 and head_dim % 64 == 0:
        keys = gather_context(k_cache, block_table, seq_len, codec, q.dtype)
        values = gather_context(v_cache, block_table, seq_len, codec, q.dtype)
        return dense_prefill(q, keys, values, scale)
    # [1, heads, len, head_dim]: given 3-d tensors, CPU SDPA takes its unfused path, several times
    # slower than its flash kernel on long prompts.
    keys = gather_context(k_cache, block_table, seq_len, codec, q.dtype).transpose(0, 1)[None]
    values = gather_context(v_cache, block_table, seq_len, codec, q.dtype).transpose(0, 1)[None]
    queries = q.transpose(0, 1)[None].to(keys.dtype)
    gqa = num_heads != keys.shape[1]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.device.type == "cpu" and query_len >= SPLIT_QUERY:
        out = _prefix_then_causal(queries, keys, values, seq_len - query_len, scale)
    else:
        # The queries are the last query_len positions, so query j sees keys 0..seq_len-query_len+j.
        offset = seq_len - query_len
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1).to(q.dtype)


def _prefix_then_causal(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int,
                        scale: float) -> torch.Tensor:
    """Queries that are the last of a context after `offset` earlier positions, as two passes of
    CPU flash attention joined by their log-sum-exps: over the prefix (no mask) and over their own
    positions (causal). A mask over the whole context makes SDPA compute every masked pair too."""
    repeat = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    prefix, prefix_lse = flash(queries, keys[:, :, :offset], values[:, :, :offset], 0.0, False, scale=scale)
    own, own_lse = flash(queries, keys[:, :, offset:], values[:, :, offset:], 0.0, True, scale=scale)
    lse = torch.logaddexp(prefix_lse, own_lse)
    return (prefix * torch.exp(prefix_lse - lse).unsqueeze(-1).to(prefix.dtype)
            + own * torch.exp(own_lse - lse).unsqueeze(-1).to(own.dtype))


class TorchPagedAttention:
    """The torch backend: batched decode rows, a per-sequence loop for prefill rows; pages are
    written and read through `codec` (scaled ones are decoded to the queries' dtype as they are read).

    Given `dense_decode` (the CPU kernels' op, for a dense cache), a batch of short queries (decode
    rows, speculative verifications: SHORT_QUERY) over fp32 or bf16 pages is that one op, which
    reads the pages in place, instead of a gather, a mask and SDPA per layer (over bf16 pages it
    computes in fp32 and rounds its output to bf16 once). Given
    `dense_prefill`, a bf16 prompt chunk over a dense cache attends through it instead of SDPA.
    Given a `window`, every sequence attends through it (engine.attention.windowed), without the ops.
    """

    name = "torch"

    def __init__(self, codec: KVCodec = DENSE, dense_decode: DenseDecode | None = None,
                 dense_prefill: DensePrefill | None = None, window: KVWindow | None = None) -> None:
        self.codec = codec
        self.window = window
        self.dense_decode = dense_decode if codec is DENSE and window is None else None
        self.dense_prefill = dense_prefill if codec is DENSE and window is None else None

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
        """See `AttentionBackend.forward`."""
        if (self.dense_decode is not None and meta.max_query_len <= SHORT_QUERY and k_cache.dtype in KERNEL_PAGES
                and q.shape[-1] % 8 == 0):  # the op steps 8 dimensions
            # It stores every row's K/V before any row attends, so a row may see the rows before it.
            # It computes in fp32 and rounds this step's rows to the pages' dtype, as codec.write does.
            block_tables, seq_lens = meta.per_query_row
            out = self.dense_decode(q.float(), k.float(), v.float(), k_cache, v_cache, meta.slot_mapping,
                                    block_tables, seq_lens, scale)
            return out.to(q.dtype)
        self.codec.write(k_cache, v_cache, meta.slot_mapping, k, v)
        if self.window is not None:
            return windowed_attention(q, k_cache, v_cache, meta, scale, self.codec, self.window)
        if meta.max_query_len == 1:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, self.codec)
        return self._mixed(q, k_cache, v_cache, meta, scale)

    def _mixed(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # Decode rows are batched together; prefill chunks go one sequence at a time.
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        decode_rows = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
        if decode_rows:
            token_rows = torch.tensor([starts[i] for i in decode_rows], device=q.device)
            seq_rows = torch.tensor(decode_rows, device=q.device)
            out[token_rows] = paged_decode_attention(
                q[token_rows], k_cache, v_cache, meta.block_tables[seq_rows], meta.seq_lens[seq_rows], scale,
                self.codec,
            )
        for i, query_len in enumerate(meta.query_lens_list):
            if query_len > 1:
                out[starts[i] : starts[i + 1]] = causal_over_context(
                    q[starts[i] : starts[i + 1]], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_list[i],
                    scale, self.codec, self.dense_prefill,
                )
        return out
