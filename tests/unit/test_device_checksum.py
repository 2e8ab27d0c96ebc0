"""The device-side KV checksum (kvtransfer.device_checksum): a reduction over the pages' bytes on
their own device, for NCCL pairs. On CPU tensors here; on CUDA too where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.device_checksum import device_checksum, torch_device_checksum


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


def _formula(data: bytes) -> int:
    s1 = sum(b + 1 for b in data) % 2**32
    s2 = sum((b + 1) * (i % 65521 + 1) for i, b in enumerate(data)) % 2**31
    return (s2 << 32) | s1


@pytest.mark.parametrize("size", [1, 65520, 65521, 65522, 3 * 65521 + 17])
def test_it_is_the_module_formula_across_whole_and_partial_rows(size):
    pages = _pages(3, blocks=1, block_bytes=size)
    assert device_checksum([pages[:size // 2], pages[size // 2:]]) == _formula(bytes(pages.tolist()))


def test_bytes_of_255_in_every_place_do_not_overflow():
    pages = torch.full((5 * 65521 + 3,), 255, dtype=torch.uint8)
    assert device_checksum([pages]) == _formula(bytes(pages.tolist()))


def test_no_bytes_at_all_give_zero():
    assert device_checksum([]) == device_checksum([torch.empty(0, dtype=torch.uint8)]) == 0


def test_only_flat_uint8_pages_are_taken():
    with pytest.raises(ValueError, match="flat uint8"):
        device_checksum([torch.zeros(4, dtype=torch.float32)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_it_equals_the_cpu_result():
    pages = _pages(4)
    assert device_checksum([pages.cuda()]) == device_checksum([pages])


@pytest.mark.parametrize("sizes", [[1], [1000, 17], [65521 * 2 + 5], [300_000, 4096, 3]])
def test_the_triton_kernels_equal_the_torch_reduction(sizes):
    # On a CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
    from kvtransfer.device_checksum_kernel import triton_device_checksum

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pages = [_pages(size, blocks=1, block_bytes=size).to(device) for size in sizes]
    assert int(triton_device_checksum(pages, 65521)) == int(torch_device_checksum(pages)) == \
        _formula(b"".join(bytes(p.tolist()) for p in pages))
