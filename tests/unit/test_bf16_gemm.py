"""The CPU kernels' bf16 GEMM over a weight packed as pairs (engine/model/kernels/bf16_gemm.cpp):
its layout, its products against fp32 arithmetic on the same bf16 values, its refusals, and where
QuantizedLinear uses it. The op exists only in the build for CPUs with AVX512-BF16; elsewhere the
tests that call it skip, naming the flag."""

from __future__ import annotations

import pytest
import torch

import engine.model.kernels as kernel_module
from engine.model.kernels import kernels
from engine.model.kernels.bf16_choice import Bf16Gemm, choose_bf16_gemm
from engine.model.kernels.build import cpu_flags, runnable
from engine.model.kernels.packing import pack_bf16_pairs
from engine.model.product_plan import BF16_MIN_ROWS, DPBF16_MAX_ROWS, plan_quantized
from engine.model.quantized_linear import QuantizedLinear
from tests.unit.test_quantized_kernels import random_weight

WITH_OP = [v.name for v in runnable(cpu_flags()) if v.name == "avx512bf16"]
needs_op = pytest.mark.skipif(not WITH_OP, reason="the bf16_gemm op is built only for a CPU with avx512_bf16")
serves_op = pytest.mark.skipif(not WITH_OP or "amx_bf16" in cpu_flags(),
                               reason="bf16 products take the op only on AVX512-BF16 without AMX")


def _op():
    """The build's op itself, which also runs where the CPU has AMX (the engine does not use it there)."""
    return kernels(WITH_OP[0])._ops.bf16_gemm


def _operands(seed: int, rows: int, cols: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).bfloat16()
    w = torch.randn(cols, depth, generator=gen).bfloat16()
    return x, w, torch.randn(cols, generator=gen)


def test_packing_puts_sixteen_rows_of_a_panel_side_by_side_as_pairs_of_k():
    w = torch.arange(18 * 4, dtype=torch.float32).view(18, 4).bfloat16()
    packed = pack_bf16_pairs(w)
    assert packed.shape == (2, 2, 16, 2)
    # packed[panel][pair][lane] = (W[16·panel + lane][2·pair], W[16·panel + lane][2·pair + 1])
    assert packed[0, 1, 5].tolist() == [22.0, 23.0]  # row 5, k = 2, 3
    assert packed[1, 0, 1].tolist() == [68.0, 69.0]  # row 17, k = 0, 1
    assert not packed[1, :, 2:].any()  # the last panel's rows beyond 18 are zeros
    with pytest.raises(ValueError, match="K must be even"):
        pack_bf16_pairs(torch.zeros(16, 3, dtype=torch.bfloat16))


@needs_op
@pytest.mark.parametrize(("rows", "cols", "depth"), [
    (1, 20, 6),  # one row, one short panel
    (7, 50, 64),  # a short row tile; a group of panels short of three, the last panel partly used
    (9, 96, 576),  # a full tile and a one-row tile
    (33, 960, 576),  # a decode batch: the shipped model's qkv product
    (130, 576, 1536),  # past one tile row count, the down product's depth
    (200, 40, 1536),  # rows in two blocks (168 rows of bf16 x at this depth), the last block partial
])
def test_the_product_is_fp32_arithmetic_on_the_bf16_values(rows, cols, depth):
    op = _op()
    x, w, bias = _operands(rows + cols, rows, cols, depth)
    want = x.double() @ w.double().T + bias.double()
    got = op(x, pack_bf16_pairs(w), cols, bias, True)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    # Products of bf16 values are exact in fp32; only fp32 accumulation (|sum| < 200 over at most
    # 1,536 terms: under 2e-3) separates the result from exact arithmetic. A wrong pair, row or
    # panel moves an output by about 1 and more.
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-3)
    rounded = op(x, pack_bf16_pairs(w), cols, None, False)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, op(x, pack_bf16_pairs(w), cols, None, True).bfloat16())  # one rounding, to nearest even


@needs_op
def test_the_product_refuses_what_it_cannot_compute():
    op = _op()
    x, w, bias = _operands(0, 4, 32, 8)
    packed = pack_bf16_pairs(w)
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        op(x.float(), packed, 32, None, True)
    with pytest.raises(RuntimeError, match="K must be even"):
        op(torch.zeros(4, 7, dtype=torch.bfloat16), packed, 32, None, True)
    with pytest.raises(RuntimeError, match="packed must be"):
        op(x, packed[:, :2], 32, None, True)
    with pytest.raises(RuntimeError, match="does not match 2 panels"):
        op(x, packed, 40, None, True)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(x, packed, 32, bias[:16], True)


def test_no_gemm_op_where_the_cpu_has_amx_or_the_build_lacks_it(monkeypatch):
    for variant in runnable(cpu_flags()):
        if variant.name != "avx512bf16":
            assert kernels(variant.name).bf16_gemm is None
    if WITH_OP:
        monkeypatch.setattr(kernel_module, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
        assert kernels(WITH_OP[0]).bf16_gemm is not None
        monkeypatch.setattr(kernel_module, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
        assert kernels(WITH_OP[0]).bf16_gemm is None  # oneDNN's GEMM runs on AMX tiles


def _product_on(instruction: str, seed: int,
                monkeypatch: pytest.MonkeyPatch) -> tuple[QuantizedLinear, torch.Tensor, torch.Generator]:
    """A 4-bit product planned for bf16 on the kernels' GEMM of `instruction`, its copies made; with its
    bias and the generator to draw inputs from. The start-up timing's choice is pinned to `instruction`:
    left to the timing, a loaded machine picks either GEMM, and the product refuses a plan made for the
    other (regression: this test failed on an AMD EPYC Zen 4 whose timing chose vdpbf16ps)."""
    ops = kernels(WITH_OP[0])
    chosen = Bf16Gemm(ops.bf16_gemm if instruction == "vdpbf16ps" else ops.bf16_gemm_fma, instruction, (0.0, 0.0))
    monkeypatch.setattr(type(ops), "bf16_products", property(lambda self: chosen))
    gen = torch.Generator().manual_seed(seed)
    weight, bias = random_weight(960, 576, "q4_offset"), torch.randn(960, generator=gen)
    plan = plan_quantized(weight, torch.bfloat16, bf16_instruction=instruction)
    return QuantizedLinear(weight, plan, bias, ops), bias, gen


@serves_op
def test_with_vdpbf16ps_decode_batches_take_the_op_and_prompts_onednns_gemm(monkeypatch):
    product, bias, gen = _product_on("vdpbf16ps", 3, monkeypatch)
    assert product._pairs is not None and product._bf16 is not None
    assert product.plan.band(DPBF16_MAX_ROWS + 1).kernel == "onednn_bf16"
    for rows in (BF16_MIN_ROWS, 32, DPBF16_MAX_ROWS):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        assert torch.equal(product(x), product.ops.bf16_gemm(x, product._pairs, 960, product.bias32, False))
    x = torch.randn(DPBF16_MAX_ROWS + 1, 576, generator=gen).bfloat16()
    onednn = torch.nn.functional.linear(x, product.dequantize().bfloat16(), bias.bfloat16())
    # Past the limit the rows go through the oneDNN-packed copy: its output, not the op's.
    assert not torch.equal(product(x), product.ops.bf16_gemm(x, product._pairs, 960, product.bias32, False))
    torch.testing.assert_close(product(x), onednn, rtol=8e-3, atol=1e-2)


@serves_op
def test_with_fma_every_row_count_takes_the_op_and_no_onednn_copy_is_made(monkeypatch):
    product, _, gen = _product_on("fma", 4, monkeypatch)
    assert product._pairs is not None and product._bf16 is None
    assert [band.kernel for band in product.plan.bands] == ["qmatmul", "bf16_gemm_fma"]
    for rows in (BF16_MIN_ROWS, 32, DPBF16_MAX_ROWS + 1, 700):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        assert torch.equal(product(x), product.ops.bf16_gemm_fma(x, product._pairs, 960, product.bias32, False))


@needs_op
@pytest.mark.parametrize(("rows", "depth", "cols"), [(1, 2, 1), (7, 64, 33), (13, 576, 200), (32, 1536, 64),
                                                     (200, 1536, 40)])  # 200 rows: three blocks of fp32 x
def test_the_fma_gemm_computes_the_same_products_in_k_order(rows, depth, cols):
    # Each output is fl(... fma(x1, w1, fma(x0, w0, 0)) ...) in K order: the float64 sum of the same
    # exact products differs by K roundings of the running sum at most, 2e-3 relative here, where a
    # wrong half of a pair (the even and odd weights swapped) moves it by the size of the products.
    x, w, bias = _operands(rows * depth + cols, rows, cols, depth)
    fma = kernels(WITH_OP[0])._ops.bf16_gemm_fma  # the build's op, which runs on AMX CPUs too
    y = fma(x, pack_bf16_pairs(w), cols, bias, True)
    exact = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(y.double(), exact, rtol=2e-3, atol=2e-3)
    swapped = w.view(cols, depth // 2, 2).flip(-1).reshape(cols, depth)
    if depth > 2:
        assert not torch.allclose(fma(x, pack_bf16_pairs(swapped), cols, bias, True).double(), exact, rtol=2e-3,
                                  atol=2e-3)
    # bf16 out: the fp32 result rounded once; a row alone gives the bits it gives in its batch.
    assert torch.equal(fma(x, pack_bf16_pairs(w), cols, bias, False), y.bfloat16())
    assert torch.equal(fma(x[-1:].contiguous(), pack_bf16_pairs(w), cols, bias, True), y[-1:])


def test_the_faster_gemm_is_chosen_and_only_the_vdpbf16ps_one_is_capped():
    def slow(x, packed, n, bias, fp32_out):
        sum(range(20000))  # a few hundred microseconds of Python: far slower than the other
        return fast(x, packed, n, bias, fp32_out)

    def fast(x, packed, n, bias, fp32_out):
        return torch.zeros(x.shape[0], n)

    assert choose_bf16_gemm(slow, fast, pack_bf16_pairs).instruction == "fma"
    chosen = choose_bf16_gemm(fast, slow, pack_bf16_pairs)
    assert (chosen.instruction, chosen.op) == ("vdpbf16ps", fast)
    # The plan caps the vdpbf16ps GEMM at the rows it beats oneDNN's at; the FMA one serves every row count.
    weight = random_weight(64, 64, "q4_offset")
    capped = plan_quantized(weight, torch.bfloat16, bf16_instruction="vdpbf16ps")
    assert capped.band(DPBF16_MAX_ROWS).kernel == "bf16_gemm_vdpbf16ps"
    assert capped.band(DPBF16_MAX_ROWS + 1).kernel != "bf16_gemm_vdpbf16ps"
    assert plan_quantized(weight, torch.bfloat16, bf16_instruction="fma").band(10**6).kernel == "bf16_gemm_fma"
