"""The CPU kernels of engine/model/kernels against the dequantized weight's product, on random
QuantizedWeights of the shipped model's shapes, for every build this CPU runs (the scalar one always)."""

from __future__ import annotations

import pytest
import torch
from environment import missing, needs

from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable
from engine.model.kernels.packing import PackedWeight
from engine.model.product_plan import (
    BF16_MIN_ROWS,
    DENSE_MIN_ROWS,
    FP16_MAX_ROWS,
    FP16_MIN_ROWS,
    ONEDNN_BF16,
    has_fp16_product,
    plan_quantized,
)
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import FP16_PIECE_ROWS, QuantizedLinear
from engine.model.weight_formats import WeightFormat

VARIANTS = [variant.name for variant in runnable(cpu_flags())]
# (output, input) features of SmolLM2-135M's products: fused qkv, o, fused gate/up, down.
# The model's shapes, and one whose K ends in a 32-weight span with rows that pad their block of 8.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (13, 96)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 32, DENSE_MIN_ROWS - 1]
# fp32 accumulation: each of a kernel's 8 lanes sums K/8 products (at most 192 here), each sum
# rounding by at most 2^-24 of the running magnitude, bounded by Σ|w·x|: 3e-5 of it is above
# that worst case and far below what a misplaced weight or group moves (Σ|w·x| / K and more).
RELATIVE_TOLERANCE = 3e-5

# name -> (bits, signed q, offset, group size): GGUF's Q4_1, Q4_0, Q8_0, RTN int8 (a group per row),
# and the unsigned 8-bit and 64-group forms GPTQ checkpoints take.
FORMATS = {
    "q4_offset": (4, False, True, 32),
    "q4_signed": (4, True, False, 32),
    "q8_signed": (8, True, False, 32),
    "q8_per_row": (8, True, False, None),
    "q8_offset": (8, False, True, 64),
    "q4_group64_offset": (4, False, True, 64),
}


def random_weight(rows: int, cols: int, fmt: str, seed: int = 0, perm: bool = False) -> QuantizedWeight:
    bits, signed, offset, group = FORMATS[fmt]
    group = cols if group is None else group
    gen = torch.Generator().manual_seed(seed)
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    q = torch.randint(low, high, (rows, cols), generator=gen).to(torch.int8 if signed else torch.uint8)
    groups = (rows, cols // group)
    scale = torch.rand(groups, generator=gen) * 0.02 + 1e-3
    return QuantizedWeight(
        q=q, scale=scale, offset=(torch.randn(groups, generator=gen) * 0.05) if offset else None,
        bits=bits, group_size=group, perm=torch.randperm(cols, generator=gen) if perm else None)


def exact_weight(weight: QuantizedWeight) -> torch.Tensor:
    """scale·q + offset in float64 (the real value each format stands for), feature order."""
    rows, cols = weight.shape
    values = weight.q.double().view(rows, -1, weight.group_size) * weight.scale.double().unsqueeze(-1)
    if weight.offset is not None:
        values = values + weight.offset.double().unsqueeze(-1)
    values = values.view(rows, cols)
    # Column k of q is feature perm[k], so feature j is column argsort(perm)[j].
    return values if weight.perm is None else values[:, torch.argsort(weight.perm)]


def assert_product_close(y: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight,
                         exact: torch.Tensor | None = None, tolerance: float = RELATIVE_TOLERANCE) -> None:
    exact = exact_weight(weight) if exact is None else exact
    reference = x.double() @ exact.T
    bound = x.double().abs() @ exact.abs().T
    error = (y.double() - reference).abs()
    assert (error <= tolerance * bound).all(), float((error / bound).max())


def _shapes_for(fmt: str) -> list[tuple[int, int]]:
    """SHAPES whose K the format's group size divides."""
    group = FORMATS[fmt][3]
    return [shape for shape in SHAPES if group is None or shape[1] % group == 0]


def _rows(count: int, cols: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, cols, generator=torch.Generator().manual_seed(seed))


def _product(weight: QuantizedWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
             fp16_copy: bool = False, onednn_bf16: bool = ONEDNN_BF16) -> QuantizedLinear:
    """The product as a model in `dtype` plans it on this CPU's best kernels."""
    chosen = kernels().bf16_products if dtype == torch.bfloat16 else None
    plan = plan_quantized(weight, dtype, fp16_copy, 0, None if chosen is None else chosen.instruction, onednn_bf16)
    return QuantizedLinear(weight, plan, bias)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kernel_matches_the_dequantized_product_at_every_decode_batch_size(variant, fmt):
    ops = kernels(variant)
    for shape in _shapes_for(fmt):
        weight = random_weight(*shape, fmt)
        packed = PackedWeight.pack(weight)
        x = _rows(max(ROWS), shape[1])
        full = ops.matmul(x, packed)
        assert_product_close(full, x, weight)
        for rows in ROWS:
            # A row's result is the same computation whatever the batch around it.
            part = ops.matmul(x[:rows].contiguous(), packed)
            assert torch.equal(part, full[:rows]), (shape, rows)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantize_reproduces_the_representation_bit_for_bit(variant):
    ops = kernels(variant)
    for fmt in ("q4_offset", "q8_signed", "q8_per_row", "q4_group64_offset"):
        for shape in [(576, 1536), (13, 96)]:
            if shape in _shapes_for(fmt):
                packed = PackedWeight.pack(weight := random_weight(*shape, fmt))
                assert torch.equal(ops.dequantize(packed), weight.dequantize()), (fmt, shape)


def test_results_do_not_depend_on_the_thread_count():
    weight = random_weight(3072, 576, "q4_offset")
    product = _product(weight)
    x = _rows(9, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(x)
        torch.set_num_threads(2)
        two = product(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("rows", [1, DENSE_MIN_ROWS - 1, DENSE_MIN_ROWS, 200])
def test_quantized_linear_serves_small_and_large_inputs_with_bias_and_act_order(rows):
    weight = random_weight(960, 576, "q4_group64_offset", perm=True)
    bias = torch.randn(960)
    product = _product(weight, bias)
    x = _rows(rows, 576)
    assert_product_close(product(x) - bias, x, weight)


@needs(has_fp16_product(), "torch built with fbgemm")
@pytest.mark.parametrize("rows", [1, FP16_MIN_ROWS - 1, FP16_MIN_ROWS, DENSE_MIN_ROWS, FP16_MAX_ROWS - 1,
                                  FP16_MAX_ROWS])
def test_products_of_a_few_rows_and_more_take_an_fp16_copy_below_its_row_limit(monkeypatch, rows):
    # Under gguf on an AVX2 CPU a prompt's products ran 1.4-2x slower through dequantize + fp32 GEMM
    # than through fbgemm's fp16 product, and a decode batch of 32 rows 2x slower through the
    # kernel: the copy holds the dequantized weights rounded to fp16, and only the inputs that
    # product wins take it.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    weight, bias = random_weight(960, 576, "q4_offset"), torch.randn(960)
    product = _product(weight, bias, fp16_copy=True)
    x = _rows(rows, 576)
    y = product(x) - bias
    takes_copy = FP16_MIN_ROWS <= rows < FP16_MAX_ROWS
    want = "fp16_pieces" if takes_copy else "qmatmul" if rows < FP16_MIN_ROWS else "linear_dequantized"
    assert product.plan.band(rows).kernel == want
    rounded = product.dequantize().half().double()
    assert not torch.equal(rounded, exact_weight(weight))
    assert_product_close(y, x, weight, rounded if takes_copy else None)


@pytest.mark.parametrize("packed", [True, False], ids=["onednn-packed", "plain"])
@pytest.mark.parametrize("rows", [1, BF16_MIN_ROWS - 1, BF16_MIN_ROWS, 32, DENSE_MIN_ROWS, 200])
def test_bf16_inputs_of_a_few_rows_and_more_go_through_one_kept_bf16_copy(rows, packed):
    # On an Intel Xeon with AMX a decode batch of 32 rows took 5.5 ms through the kernel for the
    # gate/up weight and 0.33 ms through torch's bf16 GEMM over the dequantized weight in bf16.
    # oneDNN's bf16 path refuses CPUs without AVX-512 (an AVX2 AMD EPYC): there the copy is plain.
    if packed and not ONEDNN_BF16:
        missing("oneDNN's bf16 path (a CPU with AVX-512)")
    weight, bias = random_weight(960, 576, "q4_offset"), torch.randn(960, generator=torch.Generator().manual_seed(1))
    product = _product(weight, bias, torch.bfloat16, onednn_bf16=packed)
    assert product._bf16 is not None or product._pairs is not None  # made with the product, before any call
    x = _rows(rows, 576).bfloat16()
    y = product(x)
    takes_copy = rows >= BF16_MIN_ROWS
    kernel = product.plan.band(rows).kernel
    assert y.dtype == torch.bfloat16 and (kernel != "qmatmul") == takes_copy
    if takes_copy:
        w16 = product.dequantize().bfloat16()
        if kernel.startswith("bf16_gemm"):
            # The kernels' GEMM adds the fp32 bias to its fp32 sums: only the output's one rounding
            # to bf16 (2^-8 relative) separates it from exact arithmetic on the bf16 weight.
            want = (x.double() @ w16.double().T + bias.double()).bfloat16()
        else:
            # oneDNN's packed GEMM (or F.linear) accumulates in fp32 with the bias in bf16; the
            # output's one rounding to bf16 bounds the difference from F.linear.
            want = torch.nn.functional.linear(x, w16, bias.bfloat16())
        # Both far below a wrong weight or row (10% and more).
        torch.testing.assert_close(y, want, rtol=8e-3, atol=1e-2)
        assert kernel == ("onednn_bf16" if packed else "linear") or kernel.startswith("bf16_gemm")
    else:  # the kernel: fp32 inside, the output rounded to bf16 once
        want = _product(weight, bias)(x.float())
        assert torch.equal(y, want.bfloat16())


def test_a_bf16_model_makes_its_bf16_copies_at_load_and_an_fp32_one_none():
    # Made on first use, the LM head's copy took 0.4 s of the first step that finished 4 or more
    # sequences (AMD EPYC Zen 5, one thread).
    weight = random_weight(960, 576, "q4_offset")
    bf16 = WeightFormat("gguf", torch.bfloat16)._quantized("o", weight)
    assert "bf16 copy" in bf16.plan.band(BF16_MIN_ROWS).operand
    assert bf16._bf16 is not None or bf16._pairs is not None
    fp32 = WeightFormat("gguf", torch.float32)._quantized("o", weight)
    assert fp32._bf16 is None and fp32._pairs is None
    assert all("bf16" not in band.operand for band in fp32.plan.bands)


def test_an_lm_heads_fp32_output_skips_the_rounding_to_bf16():
    # Rounded to bf16 the shipped model's best two logits tied exactly at 5 of 32 greedy steps.
    weight = random_weight(960, 576, "q8_signed")
    product = _product(weight, dtype=torch.bfloat16)
    few, many = _rows(BF16_MIN_ROWS - 1, 576).bfloat16(), _rows(BF16_MIN_ROWS, 576).bfloat16()
    logits = product.fp32(few)
    assert logits.dtype == torch.float32 and torch.equal(logits, _product(weight)(few.float()))
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bf16
    # Many rows: the GEMM's fp32 output, which the bf16 output is the rounding of (oneDNN's GEMM
    # outputs bf16 only: its fp32 output is that widened; the kernels' GEMM keeps its accumulators).
    assert torch.equal(product.fp32(many).bfloat16(), product(many))


@needs(has_fp16_product(), "torch built with fbgemm")
def test_a_weight_of_many_rows_takes_its_fp16_copy_in_pieces(monkeypatch):
    # fbgemm over the LM head's 49,152 rows at once ran 1.5x slower than in pieces of 2,048.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    rows = 2 * FP16_PIECE_ROWS + 40
    weight, bias = random_weight(rows, 64, "q8_signed"), torch.randn(rows)
    product = _product(weight, bias, fp16_copy=True)
    x = _rows(FP16_MIN_ROWS, 64)
    y = product(x) - bias
    assert product.plan.band(FP16_MIN_ROWS).kernel == "fp16_pieces" and len(product._fp16) == 3
    assert_product_close(y, x, weight, product.dequantize().half().double())


@needs(has_fp16_product(), "torch built with fbgemm")
def test_with_several_threads_the_fp16_copy_is_in_one_piece_per_thread_and_computes_the_same(monkeypatch):
    # torch runs fbgemm's product on one thread: the kernels' op spreads a weight's pieces over threads.
    weight, bias = random_weight(960, 576, "q4_offset"), torch.randn(960)
    x = _rows(FP16_MIN_ROWS + 3, 576)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            product = _product(weight, bias, fp16_copy=True)
            results.append(product(x))
            assert product._fp16_rows == ([960] if count == 1 else [480, 480])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    assert_product_close(results[1] - bias, x, weight, product.dequantize().half().double())


@pytest.mark.parametrize(("cpu_weights", "fp16_copy"), [("fp16", has_fp16_product()), ("fp32", False),
                                                         ("plain", False)])
def test_the_weight_format_gives_quantized_products_the_fp16_copy_only_for_fp16_cpu_weights(cpu_weights,
                                                                                              fp16_copy):
    product = WeightFormat("int8", torch.float32, "cpu", cpu_weights).product("o", [("w", torch.randn(64, 96))])
    assert isinstance(product, QuantizedLinear)
    assert ("fp16_pieces" in product.plan.kernels()) == fp16_copy == bool(product._fp16)


def test_the_lm_head_shape_and_bfloat16_activations():
    weight = random_weight(49152, 576, "q8_signed")
    exact = exact_weight(weight)
    product = _product(weight)
    x = _rows(3, 576)
    assert_product_close(product(x), x, weight, exact)
    y = product(x.bfloat16())
    assert y.dtype == torch.bfloat16
    # bf16 activations and output: within bf16's rounding (2^-8, twice) of the product of the bf16 inputs.
    assert_product_close(y, x.bfloat16(), weight, exact, tolerance=2**-7)


def test_a_group_the_kernels_cannot_take_is_refused():
    weight = QuantizedWeight(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 3), None, bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"^group_size:"):
        PackedWeight.pack(weight)


@needs(has_fp16_product(), "torch built with fbgemm")
def test_the_fp16_pieces_run_on_several_threads_under_inference_mode():
    # The engine steps under torch.inference_mode(); the op's worker threads must run in it too.
    weight = random_weight(960, 576, "q4_offset")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        product = _product(weight, fp16_copy=True)
        x = _rows(FP16_MIN_ROWS, 576)
        with torch.inference_mode():
            y = product(x)
    finally:
        torch.set_num_threads(threads)
    assert_product_close(y, x, weight, product.dequantize().half().double())
