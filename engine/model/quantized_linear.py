"""The matrix-product and embedding kinds over a QuantizedWeight (weight-only: activations stay in their dtype).

`QuantizedLinear` packs the weight once at load for the CPU kernels (engine/model/kernels): 4-bit
values two to a byte in spans of 64 that unpack without byte shuffles, 8-bit values as int8, fp32 scales and
offsets per group. Each weight the kernel multiplies is fl(scale·q), the first rounding of
QuantizedWeight.dequantize(); the offset enters as offset·Σx over the group. So for formats
without an offset (Q8_0, round-to-nearest int8) the products use exactly the dequantized weights;
with an offset (Q4_1) they use the exact value scale·q + offset, of which the dequantized weight
is the fp32 rounding (GGUF's fp16 d makes d·q exact in fp32). Signed 4-bit and unsigned 8-bit
values are shifted into the stored range and the shift folded into the offset (one more rounding
of the offset there).

From `DENSE_MIN_ROWS` rows up (prefill chunks) the kernel's product loses to a GEMM. There the
weight is dequantized (bit for bit QuantizedWeight.dequantize() for the formats above) and goes
through F.linear, with no dense copy kept between calls; or, with `fp16_copy` (what
`--cpu-weights fp16` asks for), through fbgemm's fp16-weight product over a copy of the dequantized
weight rounded to fp16 (each weight moved by at most 2⁻¹¹ of itself), below
engine.model.linear.FP16_MAX_ROWS rows. One
thread on an AMD EPYC (AVX2), 256 rows, the gate/up weight 3072x576: 12.4 ms against 1.4 + 17.9 ms
dequantized; prompts 1.06-1.29x faster (docs/benchmarks.md, "Prompts under gguf").

From `FP16_MIN_ROWS` rows, decode batches included, the copy serves too: from a few rows a product
is bound by arithmetic, not by weight bytes, and the kernel, which converts every weight to fp32
once per block of rows, computes 25-45 GFLOP/s where fbgemm computes 70-85 (one thread, AMD EPYC:
the 120 layer products of a step, over weights that stream from memory, 4 rows 27 against 29 ms,
6 rows 56-71 against 36-40 ms, 32 rows 205-249 against 102-106 ms; the LM head's Q8_0 blocks, 6 rows
11.2 against 9.0 ms, 32 rows 47.5 against 30.1 ms).

torch runs fbgemm's product on one thread, so the copy is packed in pieces of rows that the
kernels' `fp16_pieces` op spreads over torch's threads: one piece per thread, or pieces of
`FP16_PIECE_ROWS` for a weight of more than twice that (the LM head: fbgemm over all its 49,152
rows at once took 42 ms at 32 rows, one thread, against 27 ms in pieces). Two threads, gate/up:
32 rows 0.87 ms against the kernel's 2.44, 256 rows 8.6 ms against F.linear's 10.2.

A request's tokens then depend on whether its step's batch reached `FP16_MIN_ROWS`, as they
already did on whether its prompt was computed in a chunk; `--dtype float32` (no copy) computes
every row the same way. The copy is packed on its first use, so a worker that never computes such
an input never holds it.

With bf16 activations (`--dtype auto` on a CPU with native bf16) inputs of `BF16_MIN_ROWS` rows
and more, prompts and decode batches alike, go through a bf16 GEMM over one kept copy of the
dequantized weight rounded to bf16, made when a bf16 model loads (weight_formats;
`make_bf16_copy`): about three times the model's 4-bit bytes in memory, for products that no
longer dequantize per call. The copy is packed for oneDNN (as vLLM's CPU build packs its weights;
plain F.linear re-lays the weight out on every call), whose GEMM runs on AMX tiles where the CPU
has them. On AVX512-BF16 without AMX the weight is also packed as pairs for the kernels' own GEMMs
(bf16_gemm.cpp), which prefetch the weight ahead of the rows; at start-up the engine times the one
on vdpbf16ps against the one on fp32 FMAs and keeps the faster (engine.model.kernels.bf16_choice).
An AMD EPYC Zen 5 runs vdpbf16ps at about 430 GFLOP/s a thread and fp32 FMAs at 230, so there
vdpbf16ps is the one kept (the timing itself has not run on it); it serves inputs of up to 128 rows
(decode batches), on one thread the model's products with weights streaming from memory (`python -m
bench bf16_products`): 4 rows 10.6 ms against oneDNN's 16.6, 32 rows 24.5 against 34.1, 128 rows 86.8 against 90.2, 256
rows 192 against 174 and 2,048 rows 1.58 s against 1.42 (prompts stay on oneDNN). One thread of an
Intel Xeon with AVX512-BF16 and no AMX keeps the FMAs, which then serve every row count, so no
oneDNN copy is made (figures in docs/benchmarks.md). Their fp32 output (the LM head's logits) is the
accumulators', not a bf16 rounding widened. One thread of an Intel Xeon with AMX, the
120 layer products of a step: 1 row 8.8 ms through the kernel against 21.2 through the copy, 3 rows
19.3 against 22.2, 4 rows 22.9 against 21.3, 8 rows 43.0 against 21.9; packing took the gate/up
product at 32 rows from 0.35 to 0.23 ms and at 512 rows from 1.6 to 1.4 ms.

With `int8_parts` (`--activation-quantization int8|int16`, the default in bf16 on a CPU with
AVX512-VNNI and no AMX) inputs of 2 rows and more (int8_activations.MIN_ROWS) instead quantize to int8
blocks and go through the kernels' int8 GEMM over a copy of the values (bytes, or nibbles for 4-bit
values; engine.model.int8_activations); no bf16 copy is made then.

`QuantizedEmbedding` dequantizes just the rows a step looks up, with dequantize()'s arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model import int8_activations, linear
from engine.model.int8_activations import Int8Product
from engine.model.kernels import Kernels, kernels, pack_bf16_pairs
from engine.model.quantized import QuantizedWeight

DENSE_MIN_ROWS = 64  # from this many rows up, dequantize + torch's GEMM beats the kernel
FP16_MIN_ROWS = 6  # one thread: from this many rows up, fbgemm's fp16 product beats the kernel
BF16_MIN_ROWS = 4  # bf16 activations: from this many rows up, torch's bf16 GEMM over the bf16 copy beats the kernel
FP16_PIECE_ROWS = 2048  # a weight of more than twice this many rows has its fp16 copy in pieces of this many
KERNEL_CHUNK = 32  # the kernels unpack 32 weights at a time: group sizes must be multiples of it
# The bf16 copy is packed for oneDNN where its bf16 path runs: it refuses CPUs without AVX-512
# (BW/VL/DQ) or AVX-NE-CONVERT, such as the AVX2 AMD EPYC, where the copy stays a plain tensor.
_ONEDNN = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
BLOCK_ROWS = 8  # rows interleaved in the kernels' layout
SPAN = 64  # 4-bit weights per span: 8 words of 8 nibbles


def has_kernel(weight: QuantizedWeight) -> bool:
    """Whether the CPU kernels take this weight's layout (groups of a multiple of 32 weights)."""
    return weight.group_size % KERNEL_CHUNK == 0


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernels' layout (engine/model/kernels/qmatmul_core.h): rows in
    blocks of 8, the last padded; within a block, 8-bit values chunk by chunk of 32 weights, 4-bit
    ones span by span of 64 (`_spans`)."""

    packed: torch.Tensor  # uint8 [blocks, K*4] (4-bit: two to a byte) or int8 [blocks, K*8] (8-bit)
    scale: torch.Tensor  # float32 [blocks, groups, 8]
    offset: torch.Tensor | None  # float32 [blocks, groups, 8]
    bits: int
    group_size: int
    rows: int
    perm: torch.Tensor | None  # [K]: x's columns in q's order, for act-order weights

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> PackedWeight:
        """Pack once at load; ValueError for a layout the kernels do not take."""
        if not has_kernel(weight):
            raise ValueError(f"group_size: the CPU kernels need a multiple of {KERNEL_CHUNK}, got {weight.group_size}")
        rows, cols = weight.shape
        scale = weight.scale.float()
        offset = None if weight.offset is None else weight.offset.float()
        q = weight.q
        if weight.bits == 4:
            if q.dtype == torch.int8:  # -8..7 stored as 0..15: w = scale·(q' - 8)
                q, offset = (q + 8).to(torch.uint8), _shifted(offset, scale, -8.0)
            packed = _spans(q)
        else:
            if q.dtype == torch.uint8:  # 0..255 stored as -128..127: w = scale·(q' + 128)
                q, offset = (q.to(torch.int16) - 128).to(torch.int8), _shifted(offset, scale, 128.0)
            packed = _blocked(q.view(rows, -1, KERNEL_CHUNK)).reshape(-1, cols * 8)
        return cls(packed, _blocked(scale),
                   None if offset is None else _blocked(offset), weight.bits, weight.group_size, rows,
                   None if weight.perm is None else weight.perm.long())

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K]."""
        return (self.rows, self.packed.shape[1] // self.bits)


def _spans(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [rows, K] (0..15) in the kernels' layout (qmatmul_core.h): per block of 8 rows,
    span by span of 64 weights (a last one of 32 where K is an odd number of chunks), each row's
    span as little-endian words whose nibble s of word l is weight 8s + l; [blocks, K * 4] bytes."""
    rows, cols = q.shape
    full = cols // SPAN * SPAN

    def words(part: torch.Tensor, nibbles: int) -> torch.Tensor:
        # byte b of word l holds nibbles 2b (low) and 2b + 1 (high): weights 16b + l and 16b + 8 + l.
        pairs = part.reshape(rows, -1, nibbles // 2, 2, 8)
        data = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)  # [rows, spans, byte b, word l]
        return _blocked(data.transpose(2, 3).reshape(rows, -1, 8 * nibbles // 2))

    parts = [words(q[:, :full], 8)]
    if full < cols:
        parts.append(words(q[:, full:], 4))
    blocks = parts[0].shape[0]
    return torch.cat([part.reshape(blocks, -1) for part in parts], dim=1).contiguous()


def _blocked(per_row: torch.Tensor) -> torch.Tensor:
    """[rows, a, (b)] -> [blocks, a, 8, (b)]: rows padded to a multiple of 8, each block's rows
    interleaved along the second dimension."""
    rows = per_row.shape[0]
    padded = -rows % BLOCK_ROWS
    if padded:
        per_row = torch.cat([per_row, per_row.new_zeros(padded, *per_row.shape[1:])])
    blocks = per_row.view(-1, BLOCK_ROWS, *per_row.shape[1:])
    return blocks.transpose(1, 2).contiguous()


def _shifted(offset: torch.Tensor | None, scale: torch.Tensor, shift: float) -> torch.Tensor:
    return scale * shift if offset is None else offset + scale * shift


class QuantizedLinear:
    """y = x·Wᵀ (+ b) over a packed QuantizedWeight: the kernel for small inputs, GEMM for large."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, ops: Kernels | None = None,
                 fp16_copy: bool = False, int8_parts: int = 0) -> None:
        """`int8_parts` 1 or 2: inputs of int8_activations.MIN_ROWS rows and more are quantized to that many int8
        parts per activation and multiplied through the kernels' int8 GEMM (engine.model.int8_activations),
        in any dtype; ValueError where this build has no such GEMM or the weight's groups do not fit it."""
        self.source = weight
        self.weight = PackedWeight.pack(weight)
        self.bias = bias
        self.fp16_copy = fp16_copy
        self.bias32 = None if bias is None else bias.float().contiguous()  # the kernels' bias
        self._ops = kernels() if ops is None else ops
        self.int8 = Int8Product(weight, self.bias32, self._ops, int8_parts) if int8_parts else None
        self._fp16: list[torch.Tensor] | None = None  # fbgemm-packed pieces of the fp16 copy, made on first use
        self._fp16_rows: list[int] = []
        self._bf16: torch.Tensor | None = None  # the dequantized weight in bf16 (packed), made by make_bf16_copy
        self._bf16_bias: torch.Tensor | None = None  # the bias in bf16, made with it
        self._pairs: torch.Tensor | None = None  # the bf16 copy packed as pairs for the kernels' GEMM
        self._bf16_gemm = None  # that GEMM, where make_bf16_copy made the pairs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, x.dtype)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """y in fp32: below the kernel's row limit its own fp32 output, not rounded to x's dtype (an LM
        head's logits: in bf16, 8 bits, the best two tied exactly at 5 of 32 greedy steps of the shipped
        model, and greedy then picks by index); otherwise the product's output widened."""
        return self._product(x, torch.float32)

    def _product(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        w = self.weight
        if w.perm is not None:
            x = x.index_select(1, w.perm)
        rows = x.shape[0]
        if rows < self.kernel_rows(x.dtype):
            return self._ops.matmul(x.float().contiguous(), w, self.bias32).to(out)
        if self.int8 is not None:
            return self.int8(x, out == torch.float32).to(out)
        if self.fp16_copy and x.dtype == torch.float32 and rows < linear.FP16_MAX_ROWS:
            y = self._fp16_product(x.contiguous())
        elif x.dtype == torch.bfloat16:
            y = self._bf16_product(x, out)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype), self.bias)
        return y.to(out)

    def kernel_rows(self, dtype: torch.dtype) -> int:
        """Inputs in `dtype` of fewer rows than this go through the kernel; larger ones through
        the int8 GEMM, the fp16 copy, the bf16 copy or a GEMM."""
        if self.int8 is not None:
            return int8_activations.MIN_ROWS
        if dtype == torch.bfloat16:
            return BF16_MIN_ROWS
        return FP16_MIN_ROWS if self.fp16_copy and dtype == torch.float32 else DENSE_MIN_ROWS

    @property
    def ops(self) -> Kernels:
        """The kernels' build this product runs on."""
        return self._ops

    @property
    def holds_fp16_copy(self) -> bool:
        """Whether the fp16 copy has been packed."""
        return self._fp16 is not None

    @property
    def holds_bf16_copy(self) -> bool:
        """Whether the bf16 copy has been made."""
        return self._bf16 is not None or self._pairs is not None

    def make_bf16_copy(self) -> None:
        """Make the bf16 copies that inputs of BF16_MIN_ROWS rows and more go through (once): the pairs
        of the kernels' bf16 GEMM where it runs, and oneDNN's (or a plain) copy for the row counts it
        leaves to torch."""
        if not self.holds_bf16_copy:
            dense = self.dequantize().to(torch.bfloat16)
            gemm = self._ops.bf16_products
            if gemm is not None and dense.shape[1] % 2 == 0:
                self._pairs, self._bf16_gemm = pack_bf16_pairs(dense), gemm
            if self._bf16_gemm is None or self._bf16_gemm.max_rows is not None:
                self._bf16 = torch.ops.mkldnn._reorder_linear_weight(dense) if _ONEDNN else dense
                self._bf16_bias = None if self.bias is None else self.bias.to(torch.bfloat16)

    def _bf16_product(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        self.make_bf16_copy()
        if self._bf16_gemm is not None and self._bf16_gemm.serves(x.shape[0]):
            return self._bf16_gemm.op(x.contiguous(), self._pairs, self.weight.rows, self.bias32,
                                      out == torch.float32)
        if _ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._bf16, self._bf16_bias, "none", [], "")
        return F.linear(x, self._bf16, self._bf16_bias)

    def _fp16_product(self, x: torch.Tensor) -> torch.Tensor:
        if self._fp16 is None:
            dense = self.dequantize()
            pieces = _pieces(dense.shape[0], torch.get_num_threads())
            # packing rounds each weight to the nearest fp16
            self._fp16 = [torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(dense[first : first + rows].contiguous())
                          for first, rows in pieces]
            self._fp16_rows = [rows for _, rows in pieces]
        return self._ops.fp16_pieces(x, self._fp16, self.bias32, self._fp16_rows)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K], columns in q's order (act-order weights: not input-feature order)."""
        return self._ops.dequantize(self.weight)


def _pieces(rows: int, threads: int) -> list[tuple[int, int]]:
    """(first row, rows) of each piece of an fp16 copy: one per thread (rows in multiples of 8), or
    pieces of FP16_PIECE_ROWS for a weight of more than twice that."""
    if rows > 2 * FP16_PIECE_ROWS:
        size = FP16_PIECE_ROWS
    else:
        per_thread = -(-rows // max(threads, 1))
        size = -(-per_thread // BLOCK_ROWS) * BLOCK_ROWS
    return [(first, min(size, rows - first)) for first in range(0, rows, size)]


class QuantizedEmbedding:
    """Row lookup in a QuantizedWeight [vocab, hidden], dequantizing only the rows asked for."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        if weight.perm is not None:
            raise ValueError("perm: an embedding's columns are not permuted")
        self.weight = weight
        self.dtype = dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows, cols = ids.shape[0], w.shape[1]
        values = w.q[ids].view(rows, cols // w.group_size, w.group_size).float() * w.scale[ids].unsqueeze(-1)
        if w.offset is not None:
            values = values + w.offset[ids].unsqueeze(-1)
        return values.view(rows, cols).to(self.dtype)


class DenseEmbedding:
    """Row lookup in a float weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
