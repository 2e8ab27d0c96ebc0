"""Each weight product's plan: which kernel computes an input of how many rows, over which copy of
the weight. Resolved once at load from the engine's formats (engine.model.weight_formats), held by
the product, logged at start-up as a table (`plan_table`); at run time a product only looks its
input's row count up in it.

Every row threshold of the products lives here. They are where the kernels cross over on the CPUs
measured (`python -m bench weight_formats`; docs/benchmarks.md, "Decisions settled by experiments"):

- Integer groups (`plan_quantized`): few rows are bound by the weight's bytes, so the kernels' product
  over the packed groups (qmatmul) serves them; from a few rows on a product is bound by arithmetic,
  and a GEMM over a copy of the dequantized weight wins: the int8 GEMM over the values as bytes with
  int8 activations (`--activation-quantization`), else in bf16 the kernels' bf16 GEMM over a bf16 copy
  packed as pairs (where it runs without AMX; the vdpbf16ps one only up to the rows it beats oneDNN
  at) and oneDNN's GEMM over a bf16 copy, in fp32 with `--cpu-weights fp16` fbgemm's fp16 product over
  an fp16 copy (on one thread; the kernels' `fp16_pieces` spreads a copy's pieces over torch's
  threads), else from a prompt chunk's rows on torch's GEMM over the weight dequantized per call.
- Float weights (`plan_dense`): fbgemm's fp16 product ("fp16") or oneDNN's packed fp32 product
  ("fp32") beat `F.linear` at decode sizes, not at prompt sizes; fbgemm runs on one thread, so with
  several torch threads only the smallest inputs take it.

A request's tokens thus depend on the rows of its step's batch where a plan has several bands, as
they already do on whether its prompt was computed in a chunk; `--dtype float32 --cpu-weights fp32`
computes every row count with the same weight values.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from engine.config import CpuWeights
from engine.model.kernels.packing import packable_int8
from engine.model.quantized import QuantizedWeight

# Integer-group products: inputs of fewer rows than these take the packed-group kernel (qmatmul).
DENSE_MIN_ROWS = 64  # then torch's GEMM over the weight dequantized per call
FP16_MIN_ROWS = 6  # fp32 with the fp16 copy: then fbgemm's fp16 product (one thread measured)
BF16_MIN_ROWS = 4  # bf16: then a bf16 GEMM over the bf16 copy
INT8_MIN_ROWS = 2  # int8 activations: then the int8 GEMM (one row is bound by bytes, where qmatmul reads fewer)
DPBF16_MAX_ROWS = 128  # bf16: up to this many rows the kernels' vdpbf16ps GEMM beats oneDNN's
# fp16 copies (of integer groups, and of float weights on one thread): inputs of fewer rows take
# fbgemm's product, larger ones torch's fp32 GEMM.
FP16_MAX_ROWS = 4096
FP16_MAX_ROWS_THREADED = 16  # float weights, several threads: fbgemm still runs on one
PACKED_MAX_ROWS = 64  # float weights held for oneDNN: from this many rows up, F.linear wins

# oneDNN's bf16 path refuses CPUs without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, such as the AVX2 AMD
# EPYC: there a bf16 copy stays a plain tensor for F.linear.
ONEDNN_BF16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

Kernel = Literal[
    "qmatmul",  # the kernels' product over the packed groups (qmatmul.cpp)
    "int8_gemm",  # the kernels' GEMM with int8-quantized activations (int8_gemm.cpp)
    "fp16_pieces",  # fbgemm's fp16 product over the fp16 copy's pieces, on torch's threads (fp16_pieces.cpp)
    "bf16_gemm_vdpbf16ps",  # the kernels' bf16 GEMM over the pairs (bf16_gemm.cpp), on vdpbf16ps
    "bf16_gemm_fma",  # the same over fp32 FMAs
    "onednn_bf16",  # oneDNN's bf16 GEMM over its packed copy
    "linear",  # F.linear over a kept copy (or the float weight itself)
    "linear_dequantized",  # F.linear over the weight dequantized per call: no copy kept
    "fbgemm_fp16",  # fbgemm's fp16 product over a float weight packed once
    "onednn_fp32",  # oneDNN's fp32 product over a float weight packed once
    "triton_grouped",  # on CUDA, every held expert's product in one Triton launch (engine.model.triton_moe)
]


@dataclass(frozen=True)
class Band:
    """Inputs of `first` rows and more (up to the next band's first) go through `kernel` over `operand`."""

    first: int
    kernel: Kernel
    operand: str  # the weight's form that kernel reads, as the start-up table names it


@dataclass(frozen=True)
class ProductPlan:
    """One product's bands, in order of rows: the first serves 0 rows and up."""

    bands: tuple[Band, ...]
    int8_parts: int = 0  # the int8 parts per activation its int8_gemm band quantizes to

    def __post_init__(self) -> None:
        firsts = [band.first for band in self.bands]
        if not firsts or firsts[0] > 1 or firsts != sorted(set(firsts)):
            raise ValueError(f"a plan's bands must start at 1 row and ascend: {firsts}")

    @property
    def ends(self) -> tuple[int, ...]:
        """Each band's end: the fewest rows it does not serve (the last: no limit)."""
        return (*(band.first for band in self.bands[1:]), sys.maxsize)

    def band(self, rows: int) -> Band:
        """The band an input of `rows` rows goes through."""
        return next(band for band, end in zip(self.bands, self.ends, strict=True) if rows < end)

    def kernels(self) -> set[Kernel]:
        """Every kernel this plan runs: the copies of the weight it needs are those."""
        return {band.kernel for band in self.bands}

    def rows(self, index: int) -> str:
        """Band `index`'s rows for the table: "1-3", "4+"."""
        first, end = self.bands[index].first, self.ends[index]
        return f"{first}+" if end == sys.maxsize else f"{first}" if end == first + 1 else f"{first}-{end - 1}"


def groups(weight: QuantizedWeight) -> str:
    """A weight's integer groups for the table: "4-bit groups of 32 +offset"."""
    return (f"{weight.bits}-bit groups of {weight.group_size}{' +offset' if weight.offset is not None else ''}"
            f"{' act-order' if weight.perm is not None else ''}")


def plan_quantized(weight: QuantizedWeight, dtype: torch.dtype, fp16_copy: bool = False, int8_parts: int = 0,
                   bf16_instruction: str | None = None, onednn_bf16: bool = ONEDNN_BF16) -> ProductPlan:
    """The plan of a product over `weight`'s integer groups for inputs in `dtype`: with `fp16_copy`
    (`--cpu-weights fp16`) fp32 inputs of a few rows and more take fbgemm's product over an fp16 copy;
    with `int8_parts` (`--activation-quantization`) such inputs, where the weight's groups fit, are
    quantized for the int8 GEMM; bf16 inputs take the kernels' bf16 GEMM on `bf16_instruction`
    ("vdpbf16ps" or "fma": the one engine.model.kernels.bf16_choice measured faster; None where this
    build has none) and oneDNN's GEMM (`onednn_bf16`) or F.linear over a bf16 copy for the rows it
    leaves."""
    packed = Band(1, "qmatmul", f"{groups(weight)}, packed")
    if int8_parts and packable_int8(weight):
        values = "nibbles" if weight.bits <= 4 else "bytes"
        return ProductPlan((packed, Band(INT8_MIN_ROWS, "int8_gemm", f"values as {values}, int8 activations "
                                                                       f"in {int8_parts} part(s)")), int8_parts)
    if dtype == torch.bfloat16:
        bands = [packed]
        if bf16_instruction is not None and weight.shape[1] % 2 == 0:
            bands.append(Band(BF16_MIN_ROWS, f"bf16_gemm_{bf16_instruction}", "bf16 copy as pairs"))  # type: ignore[arg-type]
            if bf16_instruction == "fma":  # it beats oneDNN at prompt sizes too
                return ProductPlan(tuple(bands))
        first = BF16_MIN_ROWS if len(bands) == 1 else DPBF16_MAX_ROWS + 1
        bands.append(Band(first, "onednn_bf16", "bf16 copy, oneDNN-packed") if onednn_bf16
                     else Band(first, "linear", "bf16 copy"))
        return ProductPlan(tuple(bands))
    if fp16_copy and dtype == torch.float32:
        return ProductPlan((packed, Band(FP16_MIN_ROWS, "fp16_pieces", "fp16 copy in pieces"),
                            Band(FP16_MAX_ROWS, "linear_dequantized", "dequantized per call")))
    return ProductPlan((packed, Band(DENSE_MIN_ROWS, "linear_dequantized", "dequantized per call")))


def plan_dense(weight: torch.Tensor, cpu_weights: CpuWeights) -> ProductPlan:
    """The plan of a product over a float weight held as `cpu_weights` says, where that applies (fp32
    on CPU, with the kernel built into torch), for torch's thread count at load (the engine sets it
    before loading): fbgemm's fp16 product or oneDNN's packed fp32 product for small inputs, F.linear
    over the (for "fp16": rounded) weight for the rest."""
    dtype = str(weight.dtype).removeprefix("torch.")
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        if cpu_weights == "fp16" and has_fp16_product():
            limit = FP16_MAX_ROWS if torch.get_num_threads() == 1 else FP16_MAX_ROWS_THREADED
            return ProductPlan((Band(1, "fbgemm_fp16", "fp16, fbgemm-packed"),
                                Band(limit, "linear", "float32 rounded to fp16")))
        if cpu_weights == "fp32" and torch.backends.mkldnn.is_available():
            return ProductPlan((Band(1, "onednn_fp32", "float32, oneDNN-packed"),
                                Band(PACKED_MAX_ROWS, "linear", "float32")))
    return ProductPlan((Band(1, "linear", dtype),))


def has_fp16_product() -> bool:
    """Whether this torch was built with fbgemm's fp16-weight product."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.aten, "fbgemm_linear_fp16_weight_fp32_activation")


def plan_table(plans: Sequence[tuple[str, ProductPlan]], stacked_rows: int = 0) -> str:
    """The start-up table: each layer kind's distinct plans (how many layers take each), band by band;
    with `stacked_rows`, the decode steps of up to that many rows that run every layer as one call."""
    counts = Counter(plans)
    rows = [("layer kind", "layers", "rows", "kernel", "operand")]
    for (kind, plan), count in counts.items():
        rows += [(kind, str(count), plan.rows(index), band.kernel, band.operand)
                 for index, band in enumerate(plan.bands)]
    if stacked_rows:
        rows.append(("all (decode)", "all", f"1-{stacked_rows}" if stacked_rows > 1 else "1", "decode_stack",
                     "the qmatmul operands"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)
