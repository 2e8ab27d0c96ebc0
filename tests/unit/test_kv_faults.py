"""The KV fault injection of the tests (tests/kv_faults.py): which fault a file asks for, what it does
to one transfer's messages, and where a corruption lands (after the checksum, on the wire)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_fault_worker import wrapper
from kv_faults import Corruptions, Fault, FaultySender, TransferFault, _CorruptingPush, flip_bit, read_fault
from tandem.v1 import kvtransfer_pb2


def test_a_file_asks_for_a_fault_with_one_word(tmp_path: Path) -> None:
    path = tmp_path / "fault"
    assert read_fault(path) is None  # no such file yet
    path.write_text("\n")
    assert read_fault(path) is None
    for fault in Fault:
        path.write_text(f"{fault.value}\n")
        assert read_fault(path) is fault
    path.write_text("explode")
    with pytest.raises(ValueError, match="explode"):
        read_fault(path)


def _verdicts(fault: Fault | None, pages: int = 3) -> tuple[list[Fault | None], bool]:
    plan = TransferFault(fault, transfer_id=1)
    return [plan.page_fault() for _ in range(pages)], plan.end_allowed


def test_each_fault_hits_the_first_page_message_only() -> None:
    assert _verdicts(None) == ([None, None, None], True)
    assert _verdicts(Fault.DROP) == ([Fault.DROP, None, None], True)
    assert _verdicts(Fault.CORRUPT) == ([Fault.CORRUPT, None, None], True)


def test_a_stall_holds_back_every_later_page_and_the_end_marker() -> None:
    assert _verdicts(Fault.STALL) == ([Fault.STALL] * 3, False)


def test_flip_bit_changes_one_bit_of_bytes_and_tensors() -> None:
    data = bytearray(b"\x10\x20")
    flip_bit(data)
    assert data == bytearray(b"\x11\x20")
    tensor = torch.tensor([7, 9], dtype=torch.uint8)
    flip_bit(tensor)
    assert tensor.tolist() == [6, 9]


class _Recording:
    """A KVSender that records what reaches it."""

    checksum = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def send(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.calls.append(("send", layer))

    def finish(self) -> None:
        self.calls.append(("finish",))

    def wait(self, timeout: float) -> int:
        return 0

    def abort(self) -> None:
        self.calls.append(("abort",))


def _through(fault: Fault | None) -> tuple[list[tuple], Corruptions]:
    inner, corruptions = _Recording(), Corruptions()
    sender = FaultySender(inner, TransferFault(fault, 7), 7, corruptions)
    page = torch.zeros(1, 2)
    for layer in range(3):
        sender.send(layer, 0, page, page)
    sender.finish()
    return inner.calls, corruptions


def test_the_sender_wrapper_drops_stalls_or_marks_the_first_pages() -> None:
    everything = [("send", 0), ("send", 1), ("send", 2), ("finish",)]
    assert _through(None)[0] == everything
    assert _through(Fault.DROP)[0] == everything[1:]
    assert _through(Fault.STALL)[0] == []
    calls, corruptions = _through(Fault.CORRUPT)
    assert calls == everything  # the pages go as they are; the transport flips the marked bit
    assert corruptions.take(7) and not corruptions.take(7)


def test_the_grpc_wire_flips_the_first_piece_with_data_of_a_marked_transfer_once() -> None:
    corruptions = Corruptions()
    corruptions.mark(7)
    chunks = [kvtransfer_pb2.KVChunk(transfer_id=8, data=b"\x10"), kvtransfer_pb2.KVChunk(transfer_id=7, data=b""),
              kvtransfer_pb2.KVChunk(transfer_id=7, data=b"\x10", crc32c=5),
              kvtransfer_pb2.KVChunk(transfer_id=7, data=b"\x10")]
    sent = list(_CorruptingPush(corruptions)._pieces(iter(chunks)))
    assert [chunk.data for chunk in sent] == [b"\x10", b"", b"\x11", b"\x10"]
    assert sent[2].crc32c == 5  # the checksum of the bytes before the flip


def test_the_worker_wrapper_runs_the_cli_under_the_faults(tmp_path: Path) -> None:
    prefix = wrapper(tmp_path / "fault")
    assert prefix[1:] == ["-m", "tests.kv_fault_worker", str(tmp_path / "fault")]
