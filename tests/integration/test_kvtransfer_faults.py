"""Faults injected (tests/kv_faults.py) into a real sender process, over each
backend: a corrupted page is caught by its checksum, a dropped one at the end marker, a stalled
transfer by the receiver's deadline; each fails only its own transfer, and the next transfer on the
same connection arrives bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtransfer_harness import BACKENDS, Child, FakeCache, Receivers, hooked_side, layout_of

from kvtransfer import TransferError

NUM_BLOCKS = 4


side = pytest.fixture(hooked_side, scope="module", params=BACKENDS, name="side")


def _transfer(receivers: Receivers, child: Child, seed: int, timeout: float = 30.0):
    """One whole transfer sent by the child; (its target, the child's wait reply, its completion)."""
    layout = layout_of("float32")
    cache = FakeCache(layout)
    receiver = receivers.get(timeout=timeout)
    target = receivers.expect(cache, layout, num_blocks=NUM_BLOCKS, receiver=receiver)
    assert child.open(target) == ("ok", 0)
    for layer in range(layout.num_layers):
        assert child("send", target.transfer_id, seed, layer) == ("ok", 0)
    assert child("finish", target.transfer_id) == ("ok", 0)
    waited = child("wait", target.transfer_id, 2 * timeout)
    return target, cache, waited, receiver.completion(target.transfer_id)


@pytest.mark.parametrize(("fault", "caught_by"), [
    ("corrupt", "CRC32C"),
    ("drop", "missing"),
    ("stall", "not complete within"),
])
def test_fault_fails_its_transfer_and_the_next_one_arrives(
    side: tuple[Receivers, Child, Path], fault: str, caught_by: str
) -> None:
    receivers, child, fault_file = side
    # A short deadline for the stall (its receiver, and the sender's wait, give up after it).
    timeout = 2.0 if fault == "stall" else 30.0
    fault_file.write_text(fault)
    try:
        _, _, waited, completion = _transfer(receivers, child, seed=11, timeout=timeout)
    finally:
        fault_file.write_text("")
    with pytest.raises(TransferError, match=caught_by):
        completion.result(30)
    if fault == "stall":  # the sender gave up by its own deadline too
        assert waited[0] == "error" and "not delivered within" in waited[1], waited
    target, cache, waited, completion = _transfer(receivers, child, seed=12, timeout=timeout)
    assert waited[0] == "ok", waited
    assert completion.result(30) == waited[1]
    cache.assert_holds(target, seed=12)
