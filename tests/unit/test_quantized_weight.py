"""The one quantized-weight representation: its dequantization worked out by hand, and its checks."""

from __future__ import annotations

import pytest
import torch

from engine.model.quantized import QuantizedWeight


def test_unsigned_groups_with_an_offset_dequantize_group_by_group():
    q = torch.tensor([[0, 1, 2, 3], [15, 15, 0, 0]], dtype=torch.uint8)
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    offset = torch.tensor([[-1.0, 0.0], [-8.0, 3.0]])
    weight = QuantizedWeight(q, scale, offset, bits=4, group_size=2).dequantize()
    assert weight.tolist() == [[-1.0, -0.5, 4.0, 6.0], [7.0, 7.0, 3.0, 3.0]]


def test_signed_groups_have_no_offset_and_act_order_puts_columns_back_in_feature_order():
    q = torch.tensor([[-2, 3, 1, -1]], dtype=torch.int8)
    weight = QuantizedWeight(q, torch.tensor([[0.5, 4.0]]), None, bits=8, group_size=2,
                             perm=torch.tensor([2, 0, 3, 1])).dequantize()
    # Column k of q is feature perm[k]: features 2 and 0 form the first group.
    assert weight.tolist() == [[1.5, -4.0, -1.0, 4.0]]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"bits": 3}, "bits"),
    ({"group_size": 3}, "group_size"),
    ({"scale": torch.ones(2, 1)}, "scale"),
    ({"q": torch.zeros(2, 4, dtype=torch.int32)}, "q"),
    ({"perm": torch.arange(3)}, "perm"),
])
def test_an_inconsistent_weight_is_refused_naming_the_field(kwargs, field):
    args = {"q": torch.zeros(2, 4, dtype=torch.uint8), "scale": torch.ones(2, 2), "offset": None, "bits": 4,
            "group_size": 2} | kwargs
    with pytest.raises(ValueError, match=f"^{field}:"):
        QuantizedWeight(**args)
