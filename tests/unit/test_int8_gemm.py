"""The product of integer-group weights with int8-quantized activations (engine/model/kernels/int8_gemm.cpp,
engine.model.int8_activations): its packing, its arithmetic against a float64 emulation of the formula
in the kernel's header, batch invariance, refusals, and where QuantizedLinear uses it. The op exists only
in the build for CPUs with AVX512-BF16 and VNNI; elsewhere the tests that call it skip, naming the flags
(no emulator runs VNNI here: the arithmetic is checked where the instruction is)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from environment import needs

from engine.model.int8_activations import Int8Product
from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable
from engine.model.kernels.packing import pack_int8_blocks
from engine.model.product_plan import INT8_MIN_ROWS, plan_quantized
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import QuantizedLinear
from tests.unit.test_quantized_kernels import FORMATS, random_weight

WITH_OP = [v.name for v in runnable(cpu_flags()) if v.name == "avx512bf16"]
needs_op = needs(bool(WITH_OP), "a build with int8_gemm (a CPU with avx512_bf16 and avx512_vnni)")
# fp32 epilogue: per block one rounding of the scale product, the conversion (exact below 2^24) and the
# FMA into the running sum; over at most 48 blocks that stays far below 1e-5 of Σ|terms|, while one
# activation off by a quantization step moves an output by about d·amax/127, 1e-3 of it and more.
RELATIVE_TOLERANCE = 1e-5


def _op():
    """The build's op itself, which also runs where the CPU has AMX (the engine does not use it there)."""
    return kernels(WITH_OP[0])._ops.int8_gemm


def emulate(x: torch.Tensor, weight: QuantizedWeight, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The header's formula in float64 on the same int8 parts of x: y, and Σ|terms| that errors are relative to."""
    rows, cols = weight.shape
    blocks = x.float().view(x.shape[0], cols // 32, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as one IEEE division, as the kernel divides (torch's scalar division may round differently).
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    t = blocks * inverse
    xq = torch.round(t)
    scale = top.squeeze(-1) / 127
    if parts == 2:
        xq = 128 * xq + torch.round((t - xq) * 128)
        scale = top.squeeze(-1) / (127 * 128)
    xq = xq.double()
    repeat = weight.group_size // 32
    d = weight.scale.double().repeat_interleave(repeat, 1)  # [N, blocks]
    q = weight.q.double().view(rows, cols // 32, 32)
    terms = torch.einsum("mbk,nbk->mnb", xq, q) * scale.double()[:, None, :] * d[None]
    if weight.offset is not None:  # the offset times the quantized block's sum, in fp32 as the kernel rounds it
        quantized_sum = (scale * xq.sum(-1).float()).double()
        terms = torch.cat([terms, quantized_sum[:, None, :] * weight.offset.double().repeat_interleave(
            repeat, 1)[None]], dim=-1)
    return terms.sum(-1), terms.abs().sum(-1)


def _call(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None, fp32_out: bool = True,
          parts: int = 1):
    b = pack_int8_blocks(weight)
    return _op()(x, parts, b.u, b.d, b.m, b.zero, b.rows, bias, fp32_out)


def test_packing_puts_sixteen_outputs_side_by_side_four_inputs_at_a_time():
    q = torch.arange(18 * 64, dtype=torch.int32).remainder(251).to(torch.uint8).view(18, 64)
    weight = QuantizedWeight(q=q, scale=torch.rand(18, 1), offset=torch.rand(18, 1), bits=8, group_size=64)
    packed = pack_int8_blocks(weight)
    assert packed.u.shape == (2, 16, 16, 4) and packed.d.shape == packed.m.shape == (2, 2, 16)
    # u[panel][k // 4][lane][k % 4] = q[16·panel + lane][k]
    assert packed.u[0, 3, 5].tolist() == q[5, 12:16].tolist()
    assert packed.u[1, 15, 1].tolist() == q[17, 60:64].tolist()
    assert not packed.u[1, :, 2:].any() and not packed.d[1, :, 2:].any()  # padding outputs are zeros
    # a group of 64 is two blocks
    assert packed.d[1, 1, 1] == weight.scale[17, 0] and packed.m[0, 1, 4] == weight.offset[4, 0]
    signed = QuantizedWeight(q=torch.tensor([[-128, -1, 0, 127] * 8], dtype=torch.int8), scale=torch.ones(1, 1),
                             offset=None, bits=8, group_size=32)
    shifted = pack_int8_blocks(signed)
    assert shifted.zero == 128 and shifted.m is None and shifted.u[0, 0, 0].tolist() == [0, 127, 128, 255]
    with pytest.raises(ValueError, match="group size 16 is not a multiple of 32"):
        pack_int8_blocks(QuantizedWeight(q=q[:, :32], scale=torch.ones(18, 2), offset=None, bits=8, group_size=16))


def test_four_bit_values_pack_as_nibbles_two_rows_of_a_block_a_byte():
    q = torch.arange(18 * 64, dtype=torch.int32).remainder(13).to(torch.uint8).view(18, 64)
    weight = QuantizedWeight(q=q, scale=torch.rand(18, 1), offset=torch.rand(18, 1), bits=4, group_size=64)
    packed, wide = pack_int8_blocks(weight), pack_int8_blocks(dataclasses.replace(weight, bits=8))
    assert packed.nibbles and not wide.nibbles and packed.u.shape == (2, 8, 16, 4)
    # Block b's rows 4b + h hold the byte layout's rows 8b + h (low) and 8b + h + 4 (high).
    for b, h in ((0, 0), (0, 3), (1, 2)):
        assert torch.equal(packed.u[:, 4 * b + h] & 15, wide.u[:, 8 * b + h])
        assert torch.equal(packed.u[:, 4 * b + h] >> 4, wide.u[:, 8 * b + h + 4])
    signed = QuantizedWeight(q=torch.tensor([[-8, -1, 0, 7] * 8], dtype=torch.int8), scale=torch.ones(1, 1),
                             offset=None, bits=4, group_size=32)
    shifted = pack_int8_blocks(signed)
    assert shifted.zero == 8 and shifted.u[0, 0, 0].tolist() == [0 | 0 << 4, 7 | 7 << 4, 8 | 8 << 4, 15 | 15 << 4]


@needs_op
def test_nibbles_and_bytes_give_the_same_bits():
    weight = random_weight(40, 576, "q4_offset", seed=3)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    packed, wide = pack_int8_blocks(weight), pack_int8_blocks(dataclasses.replace(weight, bits=8))
    assert packed.nibbles
    for parts in (1, 2):
        results = [_op()(x, parts, b.u, b.d, b.m, b.zero, b.rows, None, True) for b in (packed, wide)]
        assert torch.equal(*results)


@needs_op
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(("rows", "cols", "depth"), [
    (1, 20, 64),  # one row, one short panel
    (7, 50, 128),  # a short row tile; the last panel partly used
    (13, 96, 576),  # two full tiles and a one-row tile
    (32, 960, 576),  # a decode batch: the shipped model's qkv product
    (5, 40, 1536),  # the down product's depth
    (1000, 48, 576),  # rows in two blocks of x (906 quantized rows at this depth)
])
def test_the_product_is_the_formula_on_int8_blocks_of_x(fmt, rows, cols, depth, parts):
    weight = random_weight(cols, depth, fmt, seed=rows)
    x = torch.randn(rows, depth, generator=torch.Generator().manual_seed(cols)).bfloat16()
    x[0, :32] = 0  # an all-zero block quantizes to zeros, not NaN
    want, magnitude = emulate(x, weight, parts)
    got = _call(weight, x, parts=parts)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert ((got.double() - want).abs() <= RELATIVE_TOLERANCE * magnitude + 1e-30).all()


@needs_op
def test_fp32_input_bias_and_bf16_output():
    weight = random_weight(40, 96, "q4_offset")
    x, bias = torch.randn(9, 96), torch.randn(40)
    want, magnitude = emulate(x, weight)
    y = _call(weight, x, bias, fp32_out=False)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (_call(weight, x) + bias).bfloat16(), rtol=0, atol=0)  # one rounding of fp32
    assert ((_call(weight, x).double() - want).abs() <= RELATIVE_TOLERANCE * magnitude).all()


@needs_op
def test_a_rows_result_does_not_depend_on_the_batch_it_came_in():
    weight = random_weight(576, 576, "q4_offset")
    x = torch.randn(37, 576).bfloat16()
    batch = _call(weight, x)
    for row in (0, 5, 6, 36):
        assert torch.equal(_call(weight, x[row : row + 1]), batch[row : row + 1])


@needs_op
def test_bad_operands_are_refused_with_the_reason():
    weight = random_weight(16, 64, "q4_offset")
    b = pack_int8_blocks(weight)
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 32"):
        _op()(torch.zeros(2, 48), 1, b.u, b.d, b.m, 0, 16, None, True)
    with pytest.raises(RuntimeError, match=r"n=17 does not match 1 panels of 16"):
        _op()(torch.zeros(2, 64), 1, b.u, b.d, b.m, 0, 17, None, True)
    with pytest.raises(RuntimeError, match="zero must be 0, 8 or 128"):
        _op()(torch.zeros(2, 64), 1, b.u, b.d, b.m, 1, 16, None, True)
    with pytest.raises(RuntimeError, match="parts must be 1 or 2"):
        _op()(torch.zeros(2, 64), 3, b.u, b.d, b.m, 0, 16, None, True)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32 or bf16"):
        _op()(torch.zeros(2, 64, dtype=torch.float16), 1, b.u, b.d, b.m, 0, 16, None, True)


def test_int8_activations_are_refused_where_the_build_has_no_int8_gemm():
    scalar = kernels("scalar")
    with pytest.raises(ValueError, match="the scalar kernels have no int8 GEMM"):
        Int8Product(random_weight(16, 64, "q4_offset"), None, scalar)


@needs_op
@pytest.mark.skipif("amx_bf16" in cpu_flags(), reason="where the CPU has AMX the engine keeps bf16 products")
def test_quantized_linear_takes_the_int8_gemm_from_the_row_count_the_kernel_stops_at():
    weight = random_weight(96, 576, "q4_offset")
    product = QuantizedLinear(weight, plan_quantized(weight, torch.bfloat16, int8_parts=1))
    plain = QuantizedLinear(weight, plan_quantized(weight, torch.float32))
    assert product.int8 is not None and product.plan.ends[0] == INT8_MIN_ROWS
    few, many = torch.randn(INT8_MIN_ROWS - 1, 576).bfloat16(), torch.randn(INT8_MIN_ROWS, 576).bfloat16()
    assert torch.equal(product(few), plain(few))  # the exact kernel below the limit
    assert torch.equal(product.fp32(many), _call(weight, many))
    assert product(many).dtype == torch.bfloat16 and product._bf16 is None and product._pairs is None
