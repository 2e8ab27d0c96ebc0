"""GPTQ and AWQ words unpacked by hand from the formats' published layouts, so neither the loader
nor the tests' packer (harness/quant_checkpoints.py) checks only itself.

The layouts (engine/model/gptq_awq.py's docstring): GPTQ (AutoGPTQ / GPTQModel) packs 32 // bits
values per int32, value i at bits [i * bits, (i + 1) * bits); `qweight` [K * bits / 32, N] along the
input features, `qzeros` [K / group, N * bits / 32] along the output features; checkpoint_format
"gptq" stores zero - 1, "gptq_v2" the zero. AWQ (AutoAWQ GEMM) packs 4-bit values along the output
features with feature ORDER[i] of each eight at bits [4i, 4i + 4), ORDER = 0 2 4 6 1 3 5 7, for
`qweight` [K, N / 8] and `qzeros` [K / group, N / 8], zeros stored as they are. Every format:
w[n, k] = scale[g, n] * (q[k, n] - zero[g, n]). Decimal words are the int32 reading of the hex.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.gptq_awq import unpack_awq, unpack_gptq
from engine.model.quant_config import CheckpointQuantization

P = "model.layers.0.mlp.up_proj"


def words(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def gptq(bits: int = 4, group_size: int = 8, zero_offset: int = 1, desc_act: bool = False,
         sym: bool = False) -> CheckpointQuantization:
    return CheckpointQuantization("gptq", bits, group_size, zero_offset, desc_act=desc_act, sym=sym)


# K = 8 input features, N = 8 output features, one group of 8. qweight is one row of 8 words, one
# per output feature n, holding q[0..7, n] from the lowest nibble up:
#   n=0 0x76543210 = 1985229328: q = 0 1 2 3 4 5 6 7
#   n=1 0xFEDCBA98 = -19088744 (sign bit set): q = 8 9 10 11 12 13 14 15
#   n=2 0x0000000F = 15: q[0] = 15, the rest 0
#   n=3 0xF0000000 = -268435456: q[7] = 15, the rest 0
#   n=4..7 0x88888888 = -2004318072: every q = 8
# qzeros is one word, 0x76543210: the stored zero of output feature n is n.
QWEIGHT = words([1985229328, -19088744, 15, -268435456, -2004318072, -2004318072, -2004318072, -2004318072])
QZEROS = words([1985229328])
SCALES = torch.tensor([[1.0, 0.5, 0.25, 0.125, 1.0, 2.0, 4.0, 0.0625]], dtype=torch.float16)


def test_gptq_words_hold_the_input_features_lowest_bits_first_and_the_first_format_adds_one_to_zeros():
    weight = unpack_gptq(P, {"qweight": QWEIGHT, "qzeros": QZEROS, "scales": SCALES}, gptq())
    assert weight.q[:, 0].tolist() == [0, 8, 15, 0, 8, 8, 8, 8]
    assert weight.q[1].tolist() == list(range(8, 16)) and weight.q[3].tolist() == [0] * 7 + [15]
    # zero = stored + 1 = n + 1; w[n, k] = scale[n] * (q[k, n] - (n + 1)):
    assert weight.dequantize().tolist() == [
        [-1, 0, 1, 2, 3, 4, 5, 6],  # 1 * (k - 1)
        [3, 3.5, 4, 4.5, 5, 5.5, 6, 6.5],  # 0.5 * (8 + k - 2)
        [3] + [-0.75] * 7,  # 0.25 * (15 - 3), then 0.25 * (0 - 3)
        [-0.5] * 7 + [1.375],  # 0.125 * (0 - 4), then 0.125 * (15 - 4)
        [3] * 8,  # 1 * (8 - 5)
        [4] * 8,  # 2 * (8 - 6)
        [4] * 8,  # 4 * (8 - 7)
        [0] * 8,  # (8 - 8) / 16
    ]


def test_gptq_v2_stores_the_zero_point_itself():
    weight = unpack_gptq(P, {"qweight": QWEIGHT, "qzeros": QZEROS, "scales": SCALES}, gptq(zero_offset=0))
    # offset = -scale * zero with zero = n.
    assert weight.offset.flatten().tolist() == [0, -0.5, -0.5, -0.375, -4, -10, -24, -0.4375]
    assert weight.dequantize()[0].tolist() == list(range(8))


def test_symmetric_gptq_zeros_are_the_middle_and_a_mislabelled_format_is_refused():
    # Symmetric 4-bit GPTQ's zero is 8, stored in the first format as 7: the familiar 0x77777777.
    eights = {"qweight": words([-2004318072] * 8), "scales": SCALES}
    weight = unpack_gptq(P, eights | {"qzeros": words([2004318071])}, gptq(sym=True))
    assert weight.offset.flatten().tolist() == (-8 * SCALES.float()).flatten().tolist()
    assert not weight.dequantize().any()  # q = 8 = zero everywhere
    # 0x88888888 is how gptq_v2 stores a zero of 8; read as the first format it would be 9.
    assert unpack_gptq(P, eights | {"qzeros": words([-2004318072])}, gptq(sym=True, zero_offset=0)).offset.any()
    with pytest.raises(ValueError, match=rf"^{P}.qzeros: quantization_config.sym is true.*checkpoint_format"):
        unpack_gptq(P, eights | {"qzeros": words([-2004318072])}, gptq(sym=True))


def test_act_order_g_idx_sorts_the_input_features_by_group():
    # K = 16 in groups of 8. Every output feature has the same words: row 0 = 0x76543210 (features
    # 0-7), row 1 = 0xFEDCBA98 (features 8-15), so q[k, n] = k. g_idx puts even features in group 1,
    # odd ones in group 0. Group 0: stored zero 0x00000000 -> 1, scale 1; group 1: 0x77777777 -> 8,
    # scale 0.5.
    packed = {
        "qweight": words([1985229328] * 8, [-19088744] * 8),
        "qzeros": words([0], [2004318071]),
        "scales": torch.tensor([[1.0] * 8, [0.5] * 8], dtype=torch.float16),
        "g_idx": torch.tensor([1, 0] * 8, dtype=torch.int32),
    }
    weight = unpack_gptq(P, packed, gptq(desc_act=True))
    # Columns: group 0 (odd features, ascending), then group 1 (even ones).
    assert weight.perm.tolist() == [1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14]
    assert weight.q[5].tolist() == weight.perm.tolist()
    assert weight.scale[5].tolist() == [1.0, 0.5] and weight.offset[5].tolist() == [-1.0, -4.0]
    # Odd k: 1 * (k - 1); even k: 0.5 * (k - 8).
    assert weight.dequantize()[5].tolist() == [-4, 0, -3, 2, -2, 4, -1, 6, 0, 8, 1, 10, 2, 12, 3, 14]


def test_eight_bit_gptq_packs_four_bytes_a_word_and_group_size_minus_one_is_one_group_per_row():
    # K = 4, N = 4. qweight words: n=0 0x03020100 = 50462976 (q = 0 1 2 3), n=1 0xFF800100 = -8388352
    # (q = 0 1 128 255), n=2,3 0 (q = 0). qzeros: 0x7F7F7F7F = 2139062143, symmetric 8-bit's stored
    # zero 127 -> 128 for all four output features.
    packed = {"qweight": words([50462976, -8388352, 0, 0]), "qzeros": words([2139062143]),
              "scales": torch.tensor([[1.0, 0.5, 2.0, 1.0]], dtype=torch.float16)}
    weight = unpack_gptq(P, packed, gptq(bits=8, group_size=-1, sym=True))
    assert (weight.bits, weight.group_size) == (8, 4)
    assert weight.dequantize().tolist() == [
        [-128, -127, -126, -125],
        [-64, -63.5, 0, 63.5],  # 0.5 * (0 1 128 255 - 128)
        [-256] * 4,
        [-128] * 4,
    ]


def test_awq_words_interleave_the_output_features():
    # K = 2, N = 8, one group of 2. Row 0's word 0x76543210 holds value i at position i, i.e. for
    # output feature ORDER[i]: features 0..7 get 0 4 1 5 2 6 3 7. Row 1's 0xFEDCBA98 adds 8 to each.
    # qzeros 0x00000010 = 16: position 1 holds 1, i.e. the zero of feature ORDER[1] = 2; others 0.
    # Scales 1, but 0.5 for feature 7.
    packed = {"qweight": words([1985229328], [-19088744]), "qzeros": words([16]),
              "scales": torch.tensor([[1.0] * 7 + [0.5]], dtype=torch.float16)}
    weight = unpack_awq(P, packed, CheckpointQuantization("awq", 4, 2, 0))
    assert weight.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert weight.dequantize().tolist() == [[0, 8], [4, 12], [0, 8], [5, 13], [2, 10], [6, 14], [3, 11], [3.5, 7.5]]


@pytest.mark.parametrize(("change", "spec", "message"), [
    ({"qzeros": None}, gptq(), rf"^{P}.qzeros: missing"),
    ({"scales": torch.ones(1, 4, dtype=torch.float16)}, gptq(), rf"^{P}.scales: expected \[1, 8\], got \[1, 4\]"),
    ({"qweight": QWEIGHT.float()}, gptq(), rf"^{P}.qweight: expected int32 words"),
    ({}, gptq(group_size=3), rf"^{P}.qweight: 8 input features are not whole groups of 3"),
    ({}, gptq(desc_act=True), rf"^{P}.g_idx: missing \(quantization_config.desc_act is true\)"),
    ({"g_idx": torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.int32)}, gptq(group_size=4, desc_act=True),
     rf"^{P}.g_idx: group 0 has 3 input features, not group_size 4"),
    ({"g_idx": torch.tensor([1, 0] * 4, dtype=torch.int32)}, gptq(group_size=4),
     rf"^{P}.g_idx: reorders the input features, but quantization_config.desc_act is false"),
])
def test_an_inconsistent_gptq_layer_is_refused_naming_the_tensor(change, spec, message):
    packed = {"qweight": QWEIGHT, "qzeros": QZEROS, "scales": SCALES}
    if spec.group_size == 4:
        packed |= {"qzeros": words([1985229328], [1985229328]), "scales": SCALES.repeat(2, 1)}
    packed = {key: value for key, value in (packed | change).items() if value is not None}
    with pytest.raises(ValueError, match=message):
        unpack_gptq(P, packed, spec)
