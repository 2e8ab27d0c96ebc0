"""A checksum of KV pages computed where they are (the design for NCCL pairs, whose pages stay on
the GPU): a reduction over their bytes on the tensors' own device, so no page is copied to the host.

CRC32C (what gloo and gRPC pages carry) is a serial table walk, fast on a CPU and with no torch
kernel on a GPU; copying every page to the host to compute it would cost a device-to-host copy of
the whole transfer. This one is Fletcher-like, made of two sums that a GPU reduces in one pass over
the bytes b[0..n) of the pages, one after another:

    s1 = sum(b[i] + 1)             mod 2**32
    s2 = sum((b[i] + 1) * w(i))    mod 2**31,  w(i) = i mod 65521 + 1

Any flipped bit changes s1; a swap of two unequal bytes, or of whole pages, changes s2 (their weights
differ unless they lie a multiple of 65521 bytes apart). The sums are taken in int64 over chunks of at
most CHUNK bytes (no overflow: 256 * 65521 * CHUNK < 2**63), so the scratch memory is bounded. Only
the two results reach the host: 16 bytes, one synchronisation per message. It detects corruption,
not tampering, like CRC32C.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 24  # bytes reduced at a time; the int64 scratch is 8x this
_WEIGHT_MODULUS = 65521  # the largest prime below 2**16, Adler's


def device_checksum(tensors: list[torch.Tensor]) -> int:
    """The checksum of the bytes of flat uint8 tensors, one after the other, computed on their
    device; a non-negative int below 2**63 (it fits the torch_dist header's checksum field)."""
    s1 = s2 = None
    offset = 0
    for tensor in tensors:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError(f"expected flat uint8 tensors, got {tensor.dtype} of shape {list(tensor.shape)}")
        for start in range(0, tensor.numel(), CHUNK):
            part = tensor[start:start + CHUNK].to(torch.int64) + 1
            weights = torch.arange(offset, offset + part.numel(), device=part.device, dtype=torch.int64)
            weights = weights.remainder_(_WEIGHT_MODULUS).add_(1)
            p1, p2 = part.sum(), (part * weights).sum()
            s1 = p1 if s1 is None else (s1 + p1).remainder_(1 << 32)
            s2 = p2 if s2 is None else (s2 + p2).remainder_(1 << 31)
            offset += part.numel()
    if s1 is None or s2 is None:
        return 0
    # One transfer of both sums to the host (a single synchronisation).
    low, high = torch.stack([s1.remainder(1 << 32), s2.remainder(1 << 31)]).tolist()
    return (high << 32) | low
