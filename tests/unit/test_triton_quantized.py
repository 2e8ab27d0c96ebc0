"""The Triton product over a QuantizedWeight equals x·Wᵀ on the dequantized weight (Triton's
interpreter without a GPU; shapes kept small for it, with edges that are not tile multiples)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.model.quantized import QuantizedWeight
from engine.model.triton_quantized import TritonQuantizedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(bits: int, signed: bool, group_size: int, rows: int = 70, cols: int = 96,
            act_order: bool = False) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    if signed:
        q = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 2**bits, (rows, cols), generator=gen, dtype=torch.uint8)
    groups = (rows, cols // group_size)
    scale = torch.rand(groups, generator=gen) / 16 + 0.01
    offset = None if signed else -8 * scale * torch.rand(groups, generator=gen)
    perm = torch.randperm(cols, generator=gen) if act_order else None
    return QuantizedWeight(q, scale, offset, bits, group_size, perm)


@pytest.mark.parametrize(("bits", "signed", "group_size", "act_order"), [
    (4, False, 32, False),  # GGUF Q4_1 blocks
    (4, False, 16, True),  # GPTQ act-order
    (8, True, 32, False),  # GGUF Q8_0 blocks
    (8, True, 96, False),  # round-to-nearest int8, one scale per row
])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_the_product_equals_the_dequantized_weights_product(bits, signed, group_size, act_order, rows):
    weight = _weight(bits, signed, group_size, act_order=act_order)
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = TritonQuantizedWeight.pack(_on(weight))(x.to(DEVICE)).cpu()
    expected = x @ weight.dequantize().t()
    # fp32 accumulation in another order: agreement to a few ulps of the sums' size.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_four_bit_values_are_packed_two_to_a_byte_low_nibble_first():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = TritonQuantizedWeight.pack(QuantizedWeight(q, torch.ones(1, 1), None, 4, 4))
    assert packed.q.tolist() == [[0x21, 0x0F]]
    with pytest.raises(ValueError, match=r"^q: 4-bit weights need an even number"):
        TritonQuantizedWeight.pack(QuantizedWeight(q[:, :3], torch.ones(1, 1), None, 4, 3))


def _on(weight: QuantizedWeight) -> QuantizedWeight:
    def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(DEVICE)
    return QuantizedWeight(weight.q.to(DEVICE), weight.scale.to(DEVICE), move(weight.offset), weight.bits,
                           weight.group_size, move(weight.perm))
