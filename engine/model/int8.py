"""Round-to-nearest int8 of a float weight, one scale per output channel (`--quantization int8`)."""

from __future__ import annotations

import torch

from engine.model.quantized import QuantizedWeight


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """q = round(w / s) with s = max|w_n| / 127 per row n, so q spans -127..127 (a row of zeros
    keeps s = 1). Each weight moves by at most s/2, i.e. max|w_n| / 254."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q=q, scale=scale, offset=None, bits=8, group_size=w.shape[1])
