"""The device-side KV checksum (kvtransfer.device_checksum): a reduction over the pages' bytes on
their own device, for NCCL pairs. On CPU tensors here; on CUDA too where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import device_checksum as module
from kvtransfer.device_checksum import device_checksum


def _pages(seed: int = 0, blocks: int = 4, block_bytes: int = 3072) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks * block_bytes,), dtype=torch.uint8, generator=generator)


def test_it_is_the_checksum_of_the_bytes_however_they_are_split():
    pages = _pages()
    whole = device_checksum([pages])
    assert device_checksum([pages[:1000], pages[1000:5000], pages[5000:]]) == whole
    assert 0 <= whole < 2**63


def test_every_flipped_bit_changes_it():
    pages = _pages(1, blocks=1, block_bytes=256)
    whole = device_checksum([pages])
    for index in range(pages.numel()):
        for bit in range(8):
            flipped = pages.clone()
            flipped[index] ^= 1 << bit
            assert device_checksum([flipped]) != whole, (index, bit)


def test_swapped_pages_change_it():
    pages = _pages(2).view(4, -1)
    swapped = pages[[1, 0, 2, 3]].reshape(-1)
    assert device_checksum([swapped]) != device_checksum([pages.reshape(-1)])


def test_chunked_reduction_equals_the_whole(monkeypatch):
    pages = _pages(3)
    whole = device_checksum([pages])
    monkeypatch.setattr(module, "CHUNK", 1000)
    assert device_checksum([pages]) == whole


def test_only_flat_uint8_pages_are_taken():
    with pytest.raises(ValueError, match="flat uint8"):
        device_checksum([torch.zeros(4, dtype=torch.float32)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_it_equals_the_cpu_result():
    pages = _pages(4)
    assert device_checksum([pages.cuda()]) == device_checksum([pages])
