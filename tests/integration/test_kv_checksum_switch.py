"""The KV checksum switch (`--kv-checksum`) over each backend, between real processes (see
kvtransfer_harness): pages carry a CRC32C unless both the receiver and the sender are off; with one
side on a corrupted page is still caught; a receiver that requires checksums refuses pages that come
without one, failing only that transfer."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch
from kvtransfer_harness import BACKENDS, PEER, Child, FakeCache, GrpcServer, Receivers, hooked_side, layout_of, pages
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from kvtransfer import KVSenderPool, TransferError, TransferTarget
from kvtransfer.torch_dist import Header, Kind, PageRun, join, raw_bytes
from kvtransfer.torch_dist_receiver import TorchDistReceiver

NUM_BLOCKS = 4
SETTINGS = [(True, True), (True, False), (False, True), (False, False)]  # (receiver, sender) --kv-checksum on


side = pytest.fixture(hooked_side, scope="module", params=BACKENDS, name="side")


def _transfer(side: tuple[Receivers, Child, Path], receiver_checksum: bool, sender_checksum: bool, seed: int,
              fault: str = ""):
    """One whole transfer between a receiver and a sender of those settings; (its target, cache,
    whether its pages carried a CRC32C, the sender's wait reply, the completion)."""
    receivers, child, fault_file = side
    layout = layout_of("float32")
    cache = FakeCache(layout)
    receiver = receivers.get(checksum=receiver_checksum)
    # The receiver pairs per peer: the child's two pools (one per setting) are two prefill workers.
    peer = f"prefill-checksum-{'on' if sender_checksum else 'off'}:50061"
    target = receivers.expect(cache, layout, num_blocks=NUM_BLOCKS, receiver=receiver, peer=peer)
    fault_file.write_text(fault)
    try:
        assert child.open(target, checksum=sender_checksum) == ("ok", 0)
    finally:
        fault_file.write_text("")
    status, checked = child("checked", target.transfer_id)
    assert status == "ok", checked
    for layer in range(layout.num_layers):
        assert child("send", target.transfer_id, seed, layer) == ("ok", 0)
    assert child("finish", target.transfer_id) == ("ok", 0)
    waited = child("wait", target.transfer_id, 30.0)
    return target, cache, bool(checked), waited, receiver.completion(target.transfer_id)


@pytest.mark.parametrize(("receiver", "sender"), SETTINGS)
def test_pages_carry_a_checksum_unless_both_sides_are_off(
    side: tuple[Receivers, Child, Path], receiver: bool, sender: bool
) -> None:
    target, cache, checked, waited, completion = _transfer(side, receiver, sender, seed=21)
    assert checked == (receiver or sender)
    assert waited[0] == "ok", waited
    assert completion.result(30) == waited[1]
    cache.assert_holds(target, seed=21)


@pytest.mark.parametrize(("receiver", "sender"), [(True, False), (False, True)])
def test_with_one_side_on_a_corrupted_page_is_still_caught(
    side: tuple[Receivers, Child, Path], receiver: bool, sender: bool
) -> None:
    _, _, checked, _, completion = _transfer(side, receiver, sender, seed=22, fault="corrupt")
    assert checked
    with pytest.raises(TransferError, match="CRC32C mismatch"):
        completion.result(30)
    target, cache, _, waited, completion = _transfer(side, receiver, sender, seed=23)
    assert completion.result(30) == waited[1]
    cache.assert_holds(target, seed=23)


def test_with_both_sides_off_nothing_computes_or_checks_a_crc(side: tuple[Receivers, Child, Path]) -> None:
    # What the switch trades away: the test hook's flipped bit (after the point where a CRC would
    # be computed) reaches the cache. A CRC sent by the sender would be checked by any receiver.
    target, cache, checked, waited, completion = _transfer(side, False, False, seed=24, fault="corrupt")
    assert not checked
    assert completion.result(30) == waited[1]
    assert _differing_bytes(cache, target, seed=24) == 1


def _differing_bytes(cache: FakeCache, target: TransferTarget, seed: int) -> int:
    index = torch.tensor(target.block_ids)
    differing = 0
    for layer in range(target.layout.num_layers):
        k, v = pages(target.layout, len(target.block_ids), seed, layer)
        for held, sent in ((cache.k[layer, index], k), (cache.v[layer, index], v)):
            differing += int((held.view(torch.uint8) != sent.view(torch.uint8)).sum())
    return differing


def test_a_grpc_receiver_that_requires_checksums_refuses_a_piece_without_one() -> None:
    server = GrpcServer(layout_of("float32"), timeout=30.0, checksum=True)
    try:
        layout = layout_of("float32")
        server.receiver.expect(PEER, 98, [0], 0, layout, FakeCache(layout).write)
        data = bytes(layout.block_bytes)
        unchecked = kvtransfer_pb2.KVChunk(transfer_id=98, layer=0, first_block=0, num_blocks=1, kv=0, offset=0,
                                           total_bytes=len(data), data=data)
        with grpc.insecure_channel(f"127.0.0.1:{server.receiver.port}") as channel, \
                pytest.raises(grpc.RpcError) as refused:
            kvtransfer_pb2_grpc.KVTransferStub(channel).Push(iter([unchecked]), timeout=20)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(TransferError, match="without CRC32C"):
            server.receiver.completion(98).result(20)
        assert server.receiver.pending.expected(98) is None  # the transfer let its blocks go
    finally:
        server.receiver.close()
        server.stop()


def test_a_torch_dist_receiver_that_requires_checksums_refuses_unchecked_pages() -> None:
    layout = layout_of("float32")
    receiver = TorchDistReceiver("127.0.0.1", timeout=10.0, checksum=True)
    try:
        target = receiver.expect(PEER, 1, [0], 0, layout, FakeCache(layout).write)
        # A sender that is off pairs with a receiver that is on: pairing agrees on checksums...
        group = join(target.host, target.port, target.namespace, "gloo", 10.0, "127.0.0.1", checksum=False)
        assert group.checksum
        # ...and this one sends its pages without one anyway.
        k, v = (raw_bytes(tensor, group.device) for tensor in pages(layout, 1, seed=5, layer=0))
        header = Header(Kind.PAGES, 1, (PageRun(0, 0, 1, k.numel()),))
        limit = timedelta(seconds=10)
        for tensor in (header.tensor(), k, v, Header(Kind.END, 1).tensor(), Header(Kind.BYE).tensor()):
            group.post_send(tensor).wait(limit)
        assert group.recv_header(limit).kind is Kind.BYE  # the receiver's answer: the pair closes
        with pytest.raises(TransferError, match="without the CRC32C this pair agreed on"):
            receiver.completion(1).result(10)
    finally:
        receiver.close()


def test_a_grpc_channel_handshakes_again_once_its_receiver_requires_checksums() -> None:
    layout = layout_of("float32")
    server = GrpcServer(layout, timeout=30.0, checksum=False)
    pool = KVSenderPool(layout, timeout=10.0, checksum=False)

    def send(transfer_id: int):
        cache = FakeCache(layout)
        target = server.receiver.expect(PEER, transfer_id, [3], 0, layout, cache.write)
        sender = pool.sender(target)
        k, v = pages(layout, 1, seed=transfer_id, layer=0)
        for layer in range(layout.num_layers):
            sender.send(layer, 0, k.clone(), v.clone())
        sender.finish()
        return sender, server.receiver.completion(transfer_id)

    try:
        sender, completion = send(1)
        assert not sender.checksum and completion.result(20) == sender.wait(20)
        # What a decode worker restarted at the same address with --kv-checksum on does: the channel
        # reconnects by itself, with no Handshake, so the first transfer on it is refused...
        server.receiver.checksum = True
        sender, completion = send(2)
        with pytest.raises(TransferError, match="FAILED_PRECONDITION"):
            sender.wait(20)
        with pytest.raises(TransferError, match="without CRC32C"):
            completion.result(20)
        # ...and the next one handshakes again and carries checksums.
        sender, completion = send(3)
        assert sender.checksum and completion.result(20) == sender.wait(20)
    finally:
        pool.close()
        server.receiver.close()
        server.stop()
