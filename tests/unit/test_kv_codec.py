"""engine.kv_cache.codec: the quantized page format, its error against the formats' own steps, and
what a page costs in bytes."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache.cache_engine import CacheEngine, bytes_per_block
from engine.kv_cache.codec import FP8_E4M3, INT4, INT8, KV_FORMATS, kv_format

SCALED = [FP8_E4M3, INT8]
# The shipped model's KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64).
SMOLLM = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64)


def _rows(seed: int = 0) -> torch.Tensor:
    """K-like rows [tokens, heads, head_dim]: unit-normal values with a few outlier channels."""
    x = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(seed))
    x[..., :2] *= 20
    return x


@pytest.mark.parametrize("codec", SCALED, ids=lambda c: c.name)
def test_a_row_is_its_codes_then_its_float32_scale(codec) -> None:
    x = _rows()
    rows = codec.encode(x)
    assert rows.shape == (64, 3, 68) and rows.dtype == torch.uint8
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / codec.max_code)
    codes = rows[..., :64].view(codec.code_dtype).float()
    assert codes.abs().amax() == codec.max_code  # every row's largest value maps to the largest code
    assert torch.equal(codec.decode(rows, torch.float32), codes * scale)


def test_int8_error_is_at_most_half_a_step() -> None:
    x = _rows()
    step = x.abs().amax(-1, keepdim=True) / 127
    error = (INT8.decode(INT8.encode(x), torch.float32) - x).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all()


def test_fp8_error_is_at_most_half_a_step_of_e4m3() -> None:
    # e4m3 keeps 3 mantissa bits: a scaled value in [2^e, 2^(e+1)) is off by at most 2^(e-4);
    # below 2^-6 the subnormal step is 2^-9.
    x = _rows()
    scale = x.abs().amax(-1, keepdim=True) / 448
    scaled = x / scale
    exponent = torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6)))
    half_step = 2.0 ** (exponent - 4) * scale
    error = (FP8_E4M3.decode(FP8_E4M3.encode(x), torch.float32) - x).abs()
    assert (error <= half_step * (1 + 1e-5)).all()


def _hadamard(n: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix of size n (a power of two): entry (i, j) is the sign
    (-1)^popcount(i & j), over sqrt(n)."""
    index = torch.arange(n)
    bits = index[:, None] & index[None, :]
    parity = sum((bits >> b) & 1 for b in range(n.bit_length()))
    return (1 - 2 * (parity % 2)).float() / n**0.5


def test_an_int4_row_is_its_rotated_codes_then_a_float16_scale_and_minimum_per_group_of_16() -> None:
    x = _rows()
    rows = INT4.encode(x)
    assert rows.shape == (64, 3, 48) and rows.dtype == torch.uint8  # 32 code bytes, 4 groups' 2 + 2 bytes
    rotated = (x @ _hadamard(64)).unflatten(-1, (4, 16))
    pairs = rows[..., 32:].contiguous().view(torch.float16).unflatten(-1, (4, 2)).float()
    scale, low = pairs[..., 0], pairs[..., 1]
    assert torch.equal(low, rotated.amin(-1).half().float())
    assert torch.equal(scale, ((rotated.amax(-1) - low) / 15).half().float())
    low_codes, high_codes = (rows[..., :32] & 15).int(), (rows[..., :32] >> 4).int()  # elements 2i and 2i + 1
    codes = torch.stack((low_codes, high_codes), dim=-1).flatten(-2).unflatten(-1, (4, 16))
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()  # each group spans all 16 levels
    want = (codes * scale[..., None] + low[..., None]).flatten(-2) @ _hadamard(64)
    torch.testing.assert_close(INT4.decode(rows, torch.float32), want)


def test_int4_error_is_at_most_half_its_own_groups_step_in_the_rotated_basis() -> None:
    # The rotation spreads the outlier channels (0 and 1) over every element of the row, and, being
    # orthogonal, keeps the error's length: a row's error is at most the length of its half steps.
    x = _rows()
    rotated = (x @ _hadamard(64)).unflatten(-1, (4, 16))
    step = ((rotated.amax(-1, keepdim=True) - rotated.amin(-1, keepdim=True)) / 15).expand_as(rotated)
    decoded = INT4.decode(INT4.encode(x), torch.float32)
    error = (decoded @ _hadamard(64)).unflatten(-1, (4, 16)) - rotated
    assert (error.abs() <= step / 2 * (1 + 1e-2)).all()
    half_steps = (step / 2).flatten(-2).norm(dim=-1)
    assert ((decoded - x).norm(dim=-1) <= half_steps * (1 + 1e-2)).all()


def test_int4_rotation_is_its_own_inverse_and_keeps_dot_products() -> None:
    q, k = _rows(1), _rows(2)
    assert torch.allclose(INT4.kernel_basis(INT4.kernel_basis(q)), q, atol=1e-4)
    want = (q * k).sum(-1)
    assert torch.allclose((INT4.kernel_basis(q) * INT4.kernel_basis(k)).sum(-1), want, atol=1e-3 * want.abs().max())


@pytest.mark.parametrize("codec", [*SCALED, INT4], ids=lambda c: c.name)
def test_a_zero_row_decodes_to_zeros(codec) -> None:
    assert torch.equal(codec.decode(codec.encode(torch.zeros(2, 3, 64)), torch.float32), torch.zeros(2, 3, 64))


@pytest.mark.parametrize("codec", [*SCALED, INT4], ids=lambda c: c.name)
def test_later_tokens_of_a_partly_filled_block_leave_the_earlier_rows_alone(codec) -> None:
    # Scales are per token and head: a later, much larger token neither clips nor requantizes the
    # rows already in its block, so a page is the same whatever chunks wrote it.
    width = codec.row_width(64)
    cache, values = torch.zeros(2, 16, 3, width, dtype=torch.uint8), torch.zeros(2, 16, 3, width, dtype=torch.uint8)
    first, later = _rows(1)[:5], 100 * _rows(2)[:3]
    codec.write(cache, values, torch.arange(16, 21), first, -first)
    before = cache[1, :5].clone()
    codec.write(cache, values, torch.arange(21, 24), later, -later)
    assert torch.equal(cache[1, :5], before)
    assert torch.equal(cache[1, 5:8], codec.encode(later)) and torch.equal(values[1, 5:8], codec.encode(-later))
    read = codec.read(cache, torch.tensor([1]), torch.float32)[0]
    torch.testing.assert_close(read[5:8], codec.decode(codec.encode(later), torch.float32))


def test_kv_cache_dtype_names_a_format() -> None:
    assert kv_format("auto", "bfloat16") is KV_FORMATS["bfloat16"]
    assert kv_format("fp8", "float32") is kv_format("fp8_e4m3", "bfloat16") is KV_FORMATS["fp8_e4m3"]
    assert kv_format("int8", "float32").codec is INT8
    assert kv_format("int4", "bfloat16").codec is INT4
    supported = r"\(supported: auto, fp8, fp8_e4m3, int8, int4\)"
    with pytest.raises(ValueError, match=rf"^kv_cache_dtype: unknown format 'fp4' {supported}"):
        kv_format("fp4", "float32")


def test_a_head_dim_the_scales_cannot_follow_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: int8 needs a head_dim divisible by 4"):
        KV_FORMATS["int8"].page_shape(16, 3, 62)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: int4 needs a head_dim divisible by its scale group of 16 "
                                         r"elements, the model's head_dim is 72$"):
        KV_FORMATS["int4"].page_shape(16, 3, 72)


def test_a_quantized_block_costs_one_byte_an_element_plus_its_scales() -> None:
    per_block = {name: bytes_per_block(SMOLLM, 16, KV_FORMATS[name]) for name in ("float32", "bfloat16", "int8")}
    rows = 2 * 30 * 16 * 3  # K and V rows of one block across the layers
    assert per_block == {"float32": rows * 64 * 4, "bfloat16": rows * 64 * 2, "int8": rows * (64 + 4)}
    assert bytes_per_block(SMOLLM, 16, KV_FORMATS["fp8_e4m3"]) == per_block["int8"]
    assert bytes_per_block(SMOLLM, 16, KV_FORMATS["int4"]) == rows * (32 + 4 * 4)  # 6 bits an element
    # So a budget holds 128/68 = 1.88x the blocks of a bf16 cache, 3.76x those of an fp32 one.
    budget = 512 * 1024 * 1024
    assert budget // per_block["int8"] == 2741 and budget // per_block["bfloat16"] == 1456


def test_a_quantized_cache_takes_only_its_own_pages() -> None:
    cache = CacheEngine(SMOLLM, 4, 16, KV_FORMATS["int8"], torch.device("cpu"))
    assert cache.kv_caches[0][0].shape == (4, 16, 3, 68) and cache.kv_caches[0][0].dtype == torch.uint8
    pages = INT8.encode(_rows()[:32].view(2, 16, 3, 64))
    cache.scatter_blocks(3, [2, 0], pages, pages)
    assert torch.equal(cache.gather_blocks(3, [2, 0])[1], pages)
    with pytest.raises(ValueError, match="uint8 pages"):
        cache.scatter_blocks(3, [1], torch.zeros(1, 16, 3, 68), torch.zeros(1, 16, 3, 68))
