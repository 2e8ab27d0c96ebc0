"""A test hook: faults injected into KV transfers on the sending side, so that tests can prove each
one is caught (checksums, end-marker accounting, deadlines). Never set it in production.

`TANDEM_TEST_KV_FAULT_FILE` names a file holding one word, `stall`, `drop` or `corrupt`, or nothing.
Every transfer a sender starts reads the file once; while it holds a word, that transfer's first
page message is hit:

- drop: that message is not sent (the rest of the transfer is): the receiver finds pages missing
  when the end marker arrives;
- corrupt: one bit of its bytes flips after the checksum was computed: the receiver's check fails
  (with checksums agreed off, kvtransfer.descriptor.checksum_agreed, nothing catches it);
- stall: neither it nor any later page or the end marker of that transfer is sent; only the
  deadlines end it (the sender's own abort, when its deadline passes, still goes out).

A file rather than a fixed word, so that one test process can suffer each fault in turn. With the
variable unset nothing is read and senders behave exactly as without the hook.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "TANDEM_TEST_KV_FAULT_FILE"


class Fault(Enum):
    """What the hook does to a transfer's first page message."""

    STALL = "stall"
    DROP = "drop"
    CORRUPT = "corrupt"


def fault_file(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The hook's file, or None when the hook is off."""
    path = environ.get(ENV_VAR)
    return Path(path) if path else None


def read_fault(path: Path | None) -> Fault | None:
    """The fault the file asks for now (None: off, missing or empty); ValueError for another word."""
    if path is None:
        return None
    try:
        word = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not word:
        return None
    try:
        return Fault(word)
    except ValueError:
        raise ValueError(f"{ENV_VAR}: {path} holds {word!r}, not one of stall, drop, corrupt") from None


class TransferFault:
    """The hook's verdicts for one transfer's messages, asked in the order they are queued."""

    def __init__(self, fault: Fault | None, transfer_id: int) -> None:
        self.fault = fault
        self._transfer_id = transfer_id
        self._hit = False
        self._stalled = False

    def page_fault(self) -> Fault | None:
        """What happens to the next page message: None (it leaves as it is), DROP or STALL (it
        does not leave), CORRUPT (a bit of it flips after its checksum)."""
        if self._stalled:
            return Fault.STALL
        if self.fault is None or self._hit:
            return None
        self._hit = True
        self._stalled = self.fault is Fault.STALL
        log.warning("test hook %s: %s of transfer %d's first pages", ENV_VAR, self.fault.value, self._transfer_id)
        return self.fault

    @property
    def end_allowed(self) -> bool:
        """Whether the end marker may leave (not once the transfer stalled)."""
        return not self._stalled


def flip_bit(data: bytearray | torch.Tensor) -> None:
    """Corrupt `data` (bytes, or a uint8 tensor on any device) in place: its first byte's lowest bit flips."""
    data[0] ^= 1
