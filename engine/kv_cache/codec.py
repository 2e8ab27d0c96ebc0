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

"int4" rotates each row by H, the normalized Walsh-Hadamard matrix of size head_dim (of the largest
power of two dividing it, repeated along the diagonal), then stores 4-bit codes two to a byte
(element 2i in the low nibble) and, for every group of INT4_GROUP consecutive elements, a float16
scale and minimum, (max - min) / 15 and min of the group, after the row's codes:

    page [block_size, num_kv_heads, head_dim / 2 + 4 * head_dim / 16] uint8

Sixteen levels cannot follow a row whose channels differ in size: keys carry outlier channels (on
the shipped model a key channel's largest |value| is 6 to 26 times a row's median), which set their
group's step and round the group's other elements to a few codes. H is orthogonal and symmetric, so
it is its own inverse and keeps dot products (Hq . Hk = q . k): rotated, every element is a signed
mix of all the channels and the outliers' size spreads over the row (QuaRot, SpinQuant), so each
group's range is closer to its elements' typical size. The rotation is per row, so a page stays a
pure function of its tokens. Reading undoes it: the torch backend decodes and multiplies by H; the
Triton kernel attends with Hq over the rotated keys and rotates the weighted sum of rotated values
back (engine.attention.triton_paged).

Measured on the shipped model (perplexity of the fidelity suite's 8 windows of 512 tokens, chunks
of 128, fp32 weights, against fp32 KV): without rotation, symmetric codes (-7..7) and a float16
scale per 32 (llama.cpp's q4_0, 36 bytes a row at head_dim 64) +20.4%, asymmetric +7.8%; rotated,
symmetric per 32 +8.1%, per 16 +6.9%, asymmetric per 32 (40 bytes) +5.6% (its keys alone +4.4%, its
values alone +0.5%), asymmetric per 16 (48 bytes, 6 bits an element) +3.5%, the only one within the
fidelity bound of +5% (the others were simulated, quantizing and restoring K and V in front of an
fp32 cache with the same arithmetic; the last is this codec). That is this format: 0.375x bf16's
bytes, against int8's 0.53x. Scales are per row and group, never per block, for the same reason as
the 1-byte formats' (a page a pure function of its tokens).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.dtypes import TORCH_DTYPES
from engine.kv_cache.page_copy import copy_rows, gather_blocks

SCALE_BYTES = 4  # one float32 per row
INT4_GROUP = 16  # elements of a rotated row sharing one int4 scale and minimum (see the module docstring)
# vLLM's spelling for "fp8" when no format is named.
_ALIASES = {"fp8": "fp8_e4m3"}


class KVCodec(Protocol):
    """Writes a step's K (or V) rows into cache slots and reads whole blocks back for attention."""

    scaled: ClassVar[bool]  # pages hold codes with their scales (else the values themselves)
    packed: ClassVar[bool]  # 4-bit codes, two a byte, a scale per group of elements (else per row)

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
        head_dim] (head_dim / 2 bytes if packed), and the scales: [num_blocks, block_size,
        num_kv_heads, 1] float32, or if packed float16 (scale, minimum) pairs [num_blocks,
        block_size, num_kv_heads, groups, 2]; None if dense."""
        ...

    def kernel_basis(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., head_dim] in the basis the kernel operands hold K and V in, and back (the
        change of basis is its own inverse): a kernel attends with kernel_basis(q) and returns
        kernel_basis of what it computed. x itself unless the codec rotates rows."""
        ...


@dataclass(frozen=True)
class DenseKV:
    """Pages hold the values themselves, in the cache's dtype."""

    scaled: ClassVar[bool] = False
    packed: ClassVar[bool] = False

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

    def kernel_basis(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.kernel_basis`: x itself."""
        return x


class _EncodedRows(ABC):
    """Writing and reading for codecs whose pages hold encoded rows: `encode` and `decode` say how."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.encode`."""

    @abstractmethod
    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows [..., row_width] uint8 -> values [..., head_dim] in `dtype`."""

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """See `KVCodec.write`: each row's scales are computed here, from the row alone. K and V are
        encoded together: a decode step's rows are few, and each op's fixed cost is what counts."""
        rows = self.encode(torch.stack((k, v)))
        for cache, encoded in ((k_cache, rows[0]), (v_cache, rows[1])):
            copy_rows(cache.view(-1, *encoded.shape[1:]), slot_mapping, encoded)

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """See `KVCodec.read`."""
        return self.decode(gather_blocks(cache, block_ids), dtype)


@dataclass(frozen=True)
class ScaledKV(_EncodedRows):
    """Pages hold 1-byte codes, each row followed by its float32 scale (see the module docstring)."""

    name: str
    code_dtype: torch.dtype
    max_code: float
    rounds: bool  # integer codes round explicitly; the fp8 cast rounds to nearest by itself
    # Widen codes on CPU by looking their byte up in a table of the 256 values: torch converts fp8
    # one element at a time there, slower than the look-up (int8 converts vectorised).
    table_on_cpu: bool
    scaled: ClassVar[bool] = True
    packed: ClassVar[bool] = False

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

    def kernel_operands(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See `KVCodec.kernel_operands`: views into the cache, no copy."""
        return self._split(cache)

    def kernel_basis(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.kernel_basis`: x itself."""
        return x

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = rows.shape[-1] - SCALE_BYTES
        return rows[..., :head_dim].view(self.code_dtype), rows[..., head_dim:].view(torch.float32)


@dataclass(frozen=True)
class Int4KV(_EncodedRows):
    """Pages hold a rotated row's 4-bit codes two a byte, then a float16 scale and minimum per group
    of `group_size` elements (see the module docstring)."""

    name: str = "int4"
    group_size: int = INT4_GROUP
    max_code: ClassVar[int] = 15  # asymmetric: codes 0..15 from the group's minimum up
    scaled: ClassVar[bool] = True
    packed: ClassVar[bool] = True

    def row_width(self, head_dim: int) -> int:
        """See `KVCodec.row_width`: head_dim / 2 code bytes, 4 bytes per group's scale and minimum."""
        if head_dim % self.group_size:
            raise ValueError(f"kv_cache_dtype: {self.name} needs a head_dim divisible by its scale group of "
                             f"{self.group_size} elements, the model's head_dim is {head_dim}")
        return head_dim // 2 + head_dim // self.group_size * 4

    def kernel_basis(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.kernel_basis`: x rotated (the rotation is its own inverse), in x's dtype."""
        return (x.float() @ _rotation(x.shape[-1], x.device)).to(x.dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """See `KVCodec.encode`: [..., row_width] uint8, the rotated row's packed codes, then each
        group's float16 (scale, minimum)."""
        groups = (x.float() @ _rotation(x.shape[-1], x.device)).unflatten(-1, (-1, self.group_size))
        # Both rounded to float16 first, so the codes are those of the scale and minimum stored. A
        # constant group (or one narrower than float16's normal range) gets its smallest normal
        # scale: finite, and its codes ~0 above a minimum that is then the group's value.
        half = torch.finfo(torch.float16)
        low = groups.amin(-1, keepdim=True).clamp_(half.min, half.max).half()
        width = groups.amax(-1, keepdim=True) - low.float()
        scale = width.div_(self.max_code).clamp_(half.tiny, half.max).half()
        # The clamp catches a float16 rounding of the minimum or scale that puts an end of the group
        # a fraction of a step outside 0..15.
        codes = ((groups - low.float()) / scale.float()).round_().clamp_(0, self.max_code).flatten(-2)
        nibbles = codes.to(torch.uint8)
        packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        pairs = torch.cat((scale, low), dim=-1)  # [..., groups, 2]
        return torch.cat((packed, pairs.flatten(-2).view(torch.uint8)), dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows [..., row_width] uint8 -> values [..., head_dim] in `dtype`: each byte's two codes
        looked up in a table of the 256 bytes' pairs (one gather), times their group's scale plus its
        minimum, rotated back."""
        packed, pairs = self.kernel_operands(rows)
        codes = _nibble_pairs(packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
        groups = codes.view(*packed.shape[:-1], pairs.shape[-2], self.group_size)
        pairs = pairs.float()
        rotated = groups.mul_(pairs[..., :1]).add_(pairs[..., 1:]).flatten(-2)
        return (rotated @ _rotation(rotated.shape[-1], rotated.device)).to(dtype)

    def kernel_operands(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See `KVCodec.kernel_operands`: views into the cache, no copy; the scales are float16
        (scale, minimum) pairs, [..., groups, 2]."""
        # A row is head_dim / 2 code bytes and 4 * head_dim / group_size bytes of pairs.
        code_bytes = cache.shape[-1] * self.group_size // (self.group_size + 8)
        return cache[..., :code_bytes], cache[..., code_bytes:].view(torch.float16).unflatten(-1, (-1, 2))


@functools.cache
def _nibble_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the int4 codes (low nibble, high nibble) each byte holds."""
    byte = torch.arange(256, dtype=torch.int32)
    return torch.stack((byte & 15, byte >> 4), dim=-1).float().to(device)


@functools.cache
def _rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """[head_dim, head_dim] float32: the normalized Walsh-Hadamard matrix of the largest power of two
    dividing head_dim (at most head_dim), repeated along the diagonal. Symmetric and orthogonal, so
    it is its own inverse and keeps dot products: q . k = (q H) . (k H)."""
    size = head_dim & -head_dim  # the largest power of two dividing head_dim
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < size:  # Sylvester's construction: [[H, H], [H, -H]]
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)))
    return torch.block_diag(*[hadamard / size**0.5] * (head_dim // size)).to(device)


@functools.cache
def _byte_values(code_dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes read as `code_dtype`, on CPU."""
    return torch.arange(256, dtype=torch.uint8).view(code_dtype).float()


DENSE = DenseKV()
FP8_E4M3 = ScaledKV("fp8_e4m3", torch.float8_e4m3fn, max_code=448.0, rounds=False, table_on_cpu=True)
INT8 = ScaledKV("int8", torch.int8, max_code=127.0, rounds=True, table_on_cpu=False)
INT4 = Int4KV()


@dataclass(frozen=True)
class KVFormat:
    """What a page holds: `name` is what KV layouts carry (a model dtype's name, "fp8_e4m3", "int8"
    or "int4"), `storage_dtype` the cache tensor's element type, `codec` how to write and read it."""

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


_SCALED: dict[str, KVCodec] = {codec.name: codec for codec in (FP8_E4M3, INT8, INT4)}
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
