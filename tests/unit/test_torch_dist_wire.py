"""The torch_dist wire format: headers listing page runs and their checksum, and the sender's coalescing of
queued pages."""

from __future__ import annotations

import google_crc32c
import pytest
import torch

from kvtransfer.device_checksum import device_checksum
from kvtransfer.torch_dist import MAX_RUNS, Header, Kind, PageRun, checksum_name, pages_header, payload_checksum
from kvtransfer.torch_dist_sender import _Message


def test_header_round_trips_its_page_runs() -> None:
    runs = (PageRun(0, 0, 3, 1536), PageRun(1, 0, 3, 1536), PageRun(29, 2, 1, 512))
    header = Header(Kind.PAGES, 7, runs)
    sent = header.tensor()
    assert sent.shape == (Header.SIZE,)
    parsed = Header.parse(sent)
    assert parsed == header
    assert parsed.nbytes == 2 * (1536 + 1536 + 512)


def test_header_without_runs_round_trips() -> None:
    assert Header.parse(Header(Kind.END, 3).tensor()) == Header(Kind.END, 3)


def test_header_refuses_garbage_and_too_many_runs() -> None:
    with pytest.raises(ValueError, match="not a KV message header"):
        Header.parse(torch.zeros(Header.SIZE, dtype=torch.int64))
    bad_count = Header(Kind.PAGES, 1).tensor()
    bad_count[3] = MAX_RUNS + 1
    with pytest.raises(ValueError, match="not a KV message header"):
        Header.parse(bad_count)
    with pytest.raises(ValueError, match="at most"):
        Header(Kind.PAGES, 1, (PageRun(0, 0, 1, 8),) * (MAX_RUNS + 1))


def _pages(sender: object, layer: int) -> _Message:
    k, v = torch.full((1, 4), float(layer)), torch.full((1, 4), -float(layer))
    return _Message(sender, Header(Kind.PAGES, 1, (PageRun(layer, 0, 1, 16),)), ((k, v),))  # type: ignore[arg-type]


def test_pages_of_one_transfer_coalesce_in_order_up_to_the_limit() -> None:
    sender = object()
    message = _pages(sender, 0)
    for layer in range(1, MAX_RUNS):
        assert message.joins(_pages(sender, layer))
        message = message.join(_pages(sender, layer))
    assert [run.layer for run in message.header.runs] == list(range(MAX_RUNS))
    assert [int(k[0, 0]) for k, _ in message.pages] == list(range(MAX_RUNS))
    assert not message.joins(_pages(sender, MAX_RUNS))


def test_other_transfers_and_end_markers_do_not_coalesce() -> None:
    sender = object()
    assert not _pages(sender, 0).joins(_pages(object(), 1))
    end = _Message(sender, Header(Kind.END, 1))  # type: ignore[arg-type]
    assert not _pages(sender, 0).joins(end)
    assert not end.joins(_pages(sender, 0))


def test_header_carries_the_payload_checksum_and_its_absence() -> None:
    payload = [torch.arange(16, dtype=torch.uint8), torch.full((8,), 3, dtype=torch.uint8)]
    checksum = payload_checksum(payload)
    assert checksum == google_crc32c.value(bytes(range(16)) + bytes([3] * 8))
    checked = Header(Kind.PAGES, 5, (PageRun(0, 0, 1, 16),), checksum)
    assert Header.parse(checked.tensor()) == checked
    unchecked = Header(Kind.PAGES, 5, (PageRun(0, 0, 1, 16),))  # both ends --kv-checksum off
    assert Header.parse(unchecked.tensor()).checksum is None
    largest = Header(Kind.PAGES, 5, (PageRun(0, 0, 1, 16),), 2**63 - 1)  # the device sums' range
    assert Header.parse(largest.tensor()) == largest
    assert checksum_name(torch.device("cpu")) == "CRC32C"


def test_a_pages_header_carries_the_checksum_only_when_the_pair_agreed() -> None:
    payload = [torch.arange(16, dtype=torch.uint8)]
    pages = Header(Kind.PAGES, 5, (PageRun(0, 0, 1, 16),))
    cpu = torch.device("cpu")
    assert Header.parse(pages_header(pages, payload, cpu, True)).checksum == payload_checksum(payload)
    assert Header.parse(pages_header(pages, payload, cpu, False)).checksum is None
    assert Header.parse(pages_header(Header(Kind.END, 5), [], cpu, True)).checksum is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run on the device machine)")
def test_pages_on_a_gpu_carry_the_device_sums_computed_there() -> None:
    payload = [torch.arange(256, dtype=torch.uint8), torch.full((100,), 7, dtype=torch.uint8)]
    on_gpu = [tensor.cuda() for tensor in payload]
    checksum = payload_checksum(on_gpu)
    assert checksum == device_checksum(payload) != payload_checksum(payload)
    assert checksum_name(on_gpu[0].device) == "device checksum"
    header = pages_header(Header(Kind.PAGES, 5, (PageRun(0, 0, 1, 178),)), on_gpu, on_gpu[0].device, True)
    assert header.is_cuda and Header.parse(header).checksum == checksum
    on_gpu[1][99] ^= 1
    assert payload_checksum(on_gpu) != checksum


def test_payload_checksum_changes_with_any_flipped_bit() -> None:
    payload = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
    clean = payload_checksum(payload)
    payload[1][63] ^= 0x80
    assert payload_checksum(payload) != clean

