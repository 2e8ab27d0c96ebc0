"""The KV transfer test hook (kvtransfer.faults): which fault a file asks for, and what it does to
one transfer's messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtransfer.faults import ENV_VAR, Fault, TransferFault, fault_file, flip_bit, read_fault


def test_the_hook_is_off_unless_the_variable_names_a_file_with_a_word(tmp_path: Path) -> None:
    assert fault_file({}) is None
    assert read_fault(None) is None
    path = fault_file({ENV_VAR: str(tmp_path / "fault")})
    assert path == tmp_path / "fault"
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
