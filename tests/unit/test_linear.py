"""engine.model.linear: pre-packed oneDNN weights for decode-sized inputs, torch's GEMM for prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import linear as linear_module
from engine.model.linear import PACKED_MAX_ROWS, Linear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(1)), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS - 1, PACKED_MAX_ROWS, 300])
def test_packed_weight_serves_small_inputs_and_gemm_the_large(monkeypatch, rows):
    # The packed oneDNN product measured 7-8% slower than F.linear from 64 rows up, so prefill
    # chunks must not take it; decode batches must (1.4-2x faster there).
    plain_calls: list[int] = []
    plain = F.linear

    def recording(x, *args, **kwargs):
        plain_calls.append(x.shape[0])
        return plain(x, *args, **kwargs)

    monkeypatch.setattr(linear_module.F, "linear", recording)
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    product = Linear(weight, bias)
    assert product.pack()
    x = torch.randn(rows, 64)
    torch.testing.assert_close(product(x), x @ weight.T + bias, atol=1e-4, rtol=1e-4)
    assert plain_calls == ([] if rows < PACKED_MAX_ROWS else [rows])
