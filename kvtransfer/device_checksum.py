"""A checksum of KV pages computed where they are (what NCCL pairs carry, whose pages stay on the
GPU: kvtransfer.torch_dist.payload_checksum): a reduction over their bytes on the tensors' own
device, so no page is copied to the host.

CRC32C (what gloo and gRPC pages carry) is a serial table walk, fast on a CPU and with no torch
kernel on a GPU; copying every page to the host to compute it would cost a device-to-host copy of
the whole transfer. This one is Fletcher-like, made of two sums that a GPU reduces in one pass over
the bytes b[0..n) of the pages, one after another:

    s1 = sum(b[i] + 1)             mod 2**32
    s2 = sum((b[i] + 1) * w(i))    mod 2**31,  w(i) = i mod 65521 + 1

Any flipped bit changes s1; a swap of two unequal bytes, or of whole pages, changes s2 (their weights
differ unless they lie a multiple of 65521 bytes apart). It detects corruption, not tampering, like
CRC32C.

Computed without a modulo per byte (64-bit division is slow on a GPU): the bytes, joined and padded
with zeros to whole rows of 65521, are summed down each column, so the weights apply to one row of
column sums; the "+ 1" terms depend only on n. That is one copy of the pages and one reduction over
them, a few kernels whatever the size (on a GPU, two Triton kernels instead: the torch form's dozen
launches cost more than the reduction at a layer's size). The result stays on the device (`device_checksum_tensor`): a
sender writes it into the message's header there and never waits for the GPU; a receiver reads 8
bytes of it once the pages are in.
"""

from __future__ import annotations

import torch

_WEIGHT_MODULUS = 65521  # the largest prime below 2**16, Adler's


def device_checksum_tensor(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The checksum of the bytes of flat uint8 tensors, one after the other, all on one device: a
    0-dim int64 tensor there, non-negative, not yet read. Nothing waits for the device, so a sender
    can put it into a message header on the GPU and enqueue the send behind it. On CUDA it runs as
    Triton kernels (kvtransfer.device_checksum_kernel); elsewhere as the torch reduction below."""
    for tensor in tensors:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError(f"expected flat uint8 tensors, got {tensor.dtype} of shape {list(tensor.shape)}")
    n = sum(tensor.numel() for tensor in tensors)
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else None)
    if tensors[0].is_cuda:
        from kvtransfer.device_checksum_kernel import triton_device_checksum  # Triton only where a GPU is

        return triton_device_checksum(tensors, _WEIGHT_MODULUS)
    return torch_device_checksum(tensors)


def torch_device_checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`device_checksum_tensor` as torch operations on any device (the reference the Triton kernels
    are tested against); at least one byte."""
    n = sum(tensor.numel() for tensor in tensors)
    rows = -(-n // _WEIGHT_MODULUS)
    joined = torch.empty(rows * _WEIGHT_MODULUS, dtype=torch.uint8, device=tensors[0].device)
    torch.cat(tensors, out=joined[:n])
    joined[n:].zero_()
    # Column sums stay below 255 * rows; the weighted sum below 255 * 65521 * n: int64 holds both
    # for any message under 500 GB.
    columns = joined.view(rows, _WEIGHT_MODULUS).sum(0, dtype=torch.int64)
    weights = torch.arange(1, _WEIGHT_MODULUS + 1, dtype=torch.int64, device=columns.device)
    whole_rows, rest = divmod(n, _WEIGHT_MODULUS)
    weight_sum = whole_rows * _WEIGHT_MODULUS * (_WEIGHT_MODULUS + 1) // 2 + rest * (rest + 1) // 2
    s1 = (columns.sum() + n).remainder_(1 << 32)
    s2 = ((columns * weights).sum() + weight_sum % (1 << 31)).remainder_(1 << 31)
    return s2.mul_(1 << 32).add_(s1)


def device_checksum(tensors: list[torch.Tensor]) -> int:
    """`device_checksum_tensor`'s value: one read of 8 bytes from the device, a non-negative int
    below 2**63 (it fits the torch_dist header's checksum field)."""
    return int(device_checksum_tensor(tensors).item())
