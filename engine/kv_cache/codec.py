"""How the paged KV cache stores keys and values: the KV format chosen once at load from
`--kv-cache-dtype`, and its codec, which the attention backends call to write and read pages.

"auto" stores them as the model computes them. "fp8_e4m3" (alias "fp8", as in vLLM) and "int8"
store 1-byte codes, and every (token, KV head) row of head_dim codes is followed, inside the same
page, by its own float32 scale:

    page [block_size, num_kv_heads, head_dim + 4] uint8; row = head_dim codes | float32 scale

x = code * scale, with scale = max|row| / 448 (fp8 e4m3's largest finite value) or / 127 (int8,
symmetric, round to nearest). A scale per token and KV head is the finest "per block and head"
granularity: it slices with its head (a tensor-parallel layout splits pages by head, codes and
scales together), and it is computed from the row alone when the token is written. One scale per
block and head would have to be chosen before the block's later tokens exist: either clip them or
requantize the block's earlier tokens (a second rounding, and pages that depend on how the prompt
was chunked). Per-token rows cost 4 bytes in head_dim + 4 (6% at head_dim 64) and keep a page a
pure function of its tokens' K and V, so chunked prefill, prefix-cache hits and pages shipped to a
decode worker hold the same bytes. Scales inside the page mean that whatever moves pages (block
copies, both transfer backends, their checksums) moves the scales with them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.dtypes import TORCH_DTYPES
from engine.kv_cache.page_copy import copy_rows, gather_blocks

SCALE_BYTES = 4  # one float32 per row
# vLLM's spelling for "fp8" when no format is named.
_ALIASES = {"fp8": "fp8_e4m3"}


class KVCodec(Protocol):
    """Writes a step's K (or V) rows into cache slots and reads whole blocks back for attention."""

    scaled: ClassVar[bool]  # pages hold codes with per-row scales (else the values themselves)

    def row_width(self, head_dim: int) -> int:
        """Elements of one (token, KV head) row of a page."""
        ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., head_dim] as a page stores them, [..., row_width(head_dim)]."""
        ...

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store a step's k and v [T, num_kv_heads, head_dim] at the flat slots `slot_mapping` [T]."""
        ...

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values of the given blocks, [block_ids.numel(), block_size, num_kv_heads, head_dim],
        in `dtype` for a scaled cache (a dense one returns its own dtype)."""
        ...

    def kernel_operands(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a kernel reads: the values or codes [num_blocks, block_size, num_kv_heads,
        head_dim], and the scales [num_blocks, block_size, num_kv_heads, 1] float32 (None if dense)."""
        ...


@dataclass(frozen=True)
class DenseKV:
    """Pages hold the values themselves, in the cache's dtype."""

    scaled: ClassVar[bool] = False

    def row_width(self, head_dim: int) -> int:
        """See `KVCodec.row_width`."""
        return head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.encode`: the values themselves."""
        return x

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """See `KVCodec.write`."""
        for cache, x in ((k_cache, k), (v_cache, v)):
            cache.view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, x.to(cache.dtype))

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """See `KVCodec.read`."""
        return gather_blocks(cache, block_ids)

    def kernel_operands(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See `KVCodec.kernel_operands`."""
        return cache, None


@dataclass(frozen=True)
class ScaledKV:
    """Pages hold 1-byte codes, each row followed by its float32 scale (see the module docstring)."""

    name: str
    code_dtype: torch.dtype
    max_code: float
    rounds: bool  # integer codes round explicitly; the fp8 cast rounds to nearest by itself
    # Widen codes on CPU by looking their byte up in a table of the 256 values: torch converts fp8
    # one element at a time there, slower than the look-up (int8 converts vectorised).
    table_on_cpu: bool
    scaled: ClassVar[bool] = True

    def row_width(self, head_dim: int) -> int:
        """See `KVCodec.row_width`."""
        if head_dim % SCALE_BYTES:
            raise ValueError(f"kv_cache_dtype: {self.name} needs a head_dim divisible by {SCALE_BYTES} "
                             f"(each row's float32 scale follows its codes), got {head_dim}")
        return head_dim + SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.encode`: [..., head_dim + 4] uint8, the codes, then the row's scale."""
        x = x.float()
        # A row of zeros gets the smallest normal scale rather than 0, so that x / scale stays finite.
        scale = x.abs().amax(-1, keepdim=True).div_(self.max_code).clamp_(min=torch.finfo(torch.float32).tiny)
        # No clamp: |x / scale| exceeds max_code by a float32 rounding at most, which rounds back to it.
        scaled = x / scale
        codes = (scaled.round_() if self.rounds else scaled).to(self.code_dtype)
        return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows [..., head_dim + 4] uint8 -> values [..., head_dim] in `dtype`."""
        codes, scale = self._split(rows)
        if not self.code_dtype.is_floating_point:
            values = codes * scale  # integer codes widen and scale in one pass
        elif self.table_on_cpu and codes.device.type == "cpu":
            index = codes.view(torch.uint8).to(torch.int32).reshape(-1)
            values = _byte_values(self.code_dtype).index_select(0, index).view(codes.shape).mul_(scale)
        else:
            values = codes.float().mul_(scale)
        return values.to(dtype)

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """See `KVCodec.write`: each row's scale is computed here, from the row alone. K and V are
        encoded together: a decode step's rows are few, and each op's fixed cost is what counts."""
        rows = self.encode(torch.stack((k, v)))
        for cache, encoded in ((k_cache, rows[0]), (v_cache, rows[1])):
            copy_rows(cache.view(-1, *encoded.shape[1:]), slot_mapping, encoded)

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """See `KVCodec.read`."""
        return self.decode(gather_blocks(cache, block_ids), dtype)

    def kernel_operands(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See `KVCodec.kernel_operands`: views into the cache, no copy."""
        return self._split(cache)

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = rows.shape[-1] - SCALE_BYTES
        return rows[..., :head_dim].view(self.code_dtype), rows[..., head_dim:].view(torch.float32)


@functools.cache
def _byte_values(code_dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes read as `code_dtype`, on CPU."""
    return torch.arange(256, dtype=torch.uint8).view(code_dtype).float()


DENSE = DenseKV()
FP8_E4M3 = ScaledKV("fp8_e4m3", torch.float8_e4m3fn, max_code=448.0, rounds=False, table_on_cpu=True)
INT8 = ScaledKV("int8", torch.int8, max_code=127.0, rounds=True, table_on_cpu=False)


@dataclass(frozen=True)
class KVFormat:
    """What a page holds: `name` is what KV layouts carry (a model dtype's name, "fp8_e4m3" or
    "int8"), `storage_dtype` the cache tensor's element type, `codec` how to write and read it."""

    name: str
    storage_dtype: torch.dtype
    codec: KVCodec

    def page_shape(self, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V)."""
        return (block_size, num_kv_heads, self.codec.row_width(head_dim))

    def page_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one block of one layer's K (or V), scales included."""
        rows, heads, width = self.page_shape(block_size, num_kv_heads, head_dim)
        return rows * heads * width * self.storage_dtype.itemsize


_SCALED = {codec.name: codec for codec in (FP8_E4M3, INT8)}
KV_FORMATS: dict[str, KVFormat] = {
    **{name: KVFormat(name, dtype, DENSE) for name, dtype in TORCH_DTYPES.items()},
    **{name: KVFormat(name, torch.uint8, codec) for name, codec in _SCALED.items()},
}


def kv_format(kv_cache_dtype: str, model_dtype: str) -> KVFormat:
    """The format `--kv-cache-dtype` names for a model computing in `model_dtype` ("auto": that
    dtype); ValueError naming the field for an unknown one."""
    if kv_cache_dtype == "auto":
        return KV_FORMATS[model_dtype]
    codec = _SCALED.get(_ALIASES.get(kv_cache_dtype, kv_cache_dtype))
    if codec is None:
        raise ValueError(f"kv_cache_dtype: unknown format {kv_cache_dtype!r} "
                         f"(supported: auto, {', '.join([*_ALIASES, *_SCALED])})")
    return KV_FORMATS[codec.name]
