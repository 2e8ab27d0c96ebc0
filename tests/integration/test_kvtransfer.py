"""KV pages between two real processes over each backend (see kvtransfer_harness): bit-exact
delivery, shared pairs, refusals, corruption, deadlines, cancellation and a dying sender."""

from __future__ import annotations

from collections.abc import Iterator

import google_crc32c
import grpc
import pytest
import torch
from kvtransfer_harness import (
    BACKENDS,
    NUM_BLOCKS,
    PEER,
    Child,
    FakeCache,
    GrpcServer,
    Receivers,
    layout_of,
)
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from kvtransfer import KVLayout, KVSenderPool, TransferError


@pytest.fixture(scope="module", params=BACKENDS)
def side(request: pytest.FixtureRequest) -> Iterator[tuple[Receivers, Child]]:
    """The receivers of one backend here, and a long-lived sender process."""
    torch.set_num_threads(1)
    receivers, child = Receivers(request.param), Child()
    yield receivers, child
    child.stop()
    receivers.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3", "int8", "int4"])
def test_layers_arrive_bit_exact(side: tuple[Receivers, Child], dtype: str) -> None:
    receivers, child = side
    layout, cache = layout_of(dtype), FakeCache(layout_of(dtype))
    target = receivers.expect(cache, layout)
    assert child.open(target) == ("ok", 0)
    sent = child.send_all(target, seed=7)
    received = receivers.get(dtype).completion(target.transfer_id).result(20)
    # Codes and their scales alike: a quantized page's rows hold both.
    cache.assert_holds(target, seed=7)
    # Layer 0 went whole, the others in two chunks: every byte counted once.
    assert sent == received == 2 * layout.num_layers * NUM_BLOCKS * layout.block_bytes
    if dtype in ("fp8_e4m3", "int8"):  # one byte a value plus a float32 scale per 64: 68 / 256 of fp32
        assert layout.block_bytes * 256 == layout_of("float32").block_bytes * 68
    if dtype == "int4":  # half a byte a value plus a float16 scale and minimum per 16: 48 / 256 of fp32
        assert layout.block_bytes * 256 == layout_of("float32").block_bytes * 48


def test_interleaved_transfers_share_and_reuse_the_pair(side: tuple[Receivers, Child]) -> None:
    receivers, child = side
    layout = layout_of("float32")
    caches = [FakeCache(layout) for _ in range(3)]
    targets = [receivers.expect(cache, layout, num_blocks=9) for cache in caches]
    for target in targets:
        assert child.open(target) == ("ok", 0)
    for layer in range(layout.num_layers):
        for seed, target in enumerate(targets):
            assert child("send", target.transfer_id, seed, layer) == ("ok", 0)
    for target in reversed(targets):
        assert child("finish", target.transfer_id) == ("ok", 0)
    for seed, (cache, target) in enumerate(zip(caches, targets, strict=True)):
        assert child("wait", target.transfer_id, 20.0)[0] == "ok"
        receivers.get().completion(target.transfer_id).result(20)
        cache.assert_holds(target, seed)
    # A later transfer travels on the same pair (same rendezvous namespace, no re-pairing).
    later_cache = FakeCache(layout)
    later = receivers.expect(later_cache, layout, num_blocks=3)
    assert (later.host, later.port, later.namespace) == (targets[0].host, targets[0].port, targets[0].namespace)
    assert child.open(later) == ("ok", 0)
    child.send_all(later, seed=11)
    receivers.get().completion(later.transfer_id).result(20)
    later_cache.assert_holds(later, seed=11)


@pytest.mark.parametrize(("own", "expected"), [
    (layout_of("float32", block_size=32), "block_size: 32 here, 16 there"),
    (layout_of("fp8_e4m3"), "dtype: fp8_e4m3 here, float32 there"),  # a quantized cache against an auto one
])
def test_layout_mismatch_is_refused_naming_the_field(
    side: tuple[Receivers, Child], own: KVLayout, expected: str
) -> None:
    receivers, child = side
    layout = layout_of("float32")
    target = receivers.expect(FakeCache(layout), layout)
    status, message = child.open(target, own_layout=own)
    assert status == "error" and "TransferError" in message and expected in message
    receivers.get().cancel(target.transfer_id)


def test_grpc_handshake_refuses_a_receiver_with_another_layout() -> None:
    server = GrpcServer(layout_of("float32"), timeout=30.0)
    pool = KVSenderPool(layout_of("float32", head_dim=32))
    try:
        # The target (and the sender) claim head_dim 32; the receiving service holds head_dim 64.
        claimed = layout_of("float32", head_dim=32)
        target = server.receiver.expect(PEER, 1, [0], 0, claimed, FakeCache(layout_of("float32")).write)
        with pytest.raises(TransferError, match="head_dim: 32 here, 64 there"):
            pool.sender(target)
    finally:
        pool.close()
        server.receiver.close()
        server.stop()


def test_missing_pages_fail_the_transfer(side: tuple[Receivers, Child]) -> None:
    receivers, child = side
    layout = layout_of("float32")
    target = receivers.expect(FakeCache(layout), layout, num_blocks=4)
    assert child.open(target) == ("ok", 0)
    assert child("send", target.transfer_id, 1, 0) == ("ok", 0)
    assert child("finish", target.transfer_id) == ("ok", 0)
    child("wait", target.transfer_id, 20.0)
    with pytest.raises(TransferError, match="missing"):
        receivers.get().completion(target.transfer_id).result(20)


def test_silent_sender_fails_by_the_deadline(side: tuple[Receivers, Child]) -> None:
    receivers, child = side
    layout = layout_of("float32")
    receiver = receivers.get(timeout=1.0)
    target = receivers.expect(FakeCache(layout), layout, receiver=receiver)
    assert child.open(target) == ("ok", 0)
    with pytest.raises(TransferError, match="not complete within"):
        receiver.completion(target.transfer_id).result(20)
    assert child("abort", target.transfer_id) == ("ok", 0)


def test_cancel_stops_writes(side: tuple[Receivers, Child]) -> None:
    receivers, child = side
    layout = layout_of("float32")
    cache = FakeCache(layout)
    target = receivers.expect(cache, layout, num_blocks=4)
    assert child.open(target) == ("ok", 0)
    # torch_dist writes a message's pages once the next header arrives, and a busy sender coalesces
    # queued layers into one message: layers go one at a time until a write shows the transfer under
    # way (two sends then one wait flaked in a full `make test` on an Intel Xeon: both in one message).
    sent = 0
    while not cache.first_write.is_set() and sent < layout.num_layers - 1:
        assert child("send", target.transfer_id, 3, sent) == ("ok", 0)
        sent += 1
        if sent > 1:
            cache.first_write.wait(5)
    assert cache.first_write.is_set()
    completion = receivers.get().completion(target.transfer_id)
    receivers.get().cancel(target.transfer_id)
    writes_at_cancel = cache.writes
    for layer in range(sent, layout.num_layers):
        child("send", target.transfer_id, 3, layer)
    child("finish", target.transfer_id)
    child("wait", target.transfer_id, 20.0)
    with pytest.raises(TransferError, match="cancelled"):
        completion.result(20)
    # A later transfer from the same sender completes, so everything sent before it was handled.
    later = receivers.expect(FakeCache(layout), layout, num_blocks=2)
    assert child.open(later) == ("ok", 0)
    child.send_all(later, seed=4)
    receivers.get().completion(later.transfer_id).result(20)
    assert cache.writes == writes_at_cancel


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_sender_fails_the_pending_transfer(backend: str) -> None:
    receivers, child = Receivers(backend), Child()
    try:
        layout = layout_of("float32")
        cache = FakeCache(layout)
        target = receivers.expect(cache, layout, num_blocks=4, peer="doomed-prefill:1")
        assert child.open(target) == ("ok", 0)
        # The receiver writes a message's pages once the next header arrives, and a busy sender
        # coalesces queued layers into one message: layers go one at a time until a write shows the
        # transfer under way (two sends then a single wait flaked under load: both in one message).
        for layer in range(layout.num_layers):
            assert child("send", target.transfer_id, 5, layer) == ("ok", 0)
            if layer and cache.first_write.wait(5):
                break
        assert cache.first_write.is_set()
        child.process.kill()
        with pytest.raises(TransferError) as failure:
            receivers.get().completion(target.transfer_id).result(20)
        assert "not complete within" not in str(failure.value)  # failed for the death, not by the deadline
        if backend == "torch_dist":  # the broken pair was dropped: the next transfer pairs anew
            again = receivers.expect(FakeCache(layout), layout, peer="doomed-prefill:1")
            assert again.namespace != target.namespace
    finally:
        child.process.join(10)
        receivers.close()


def test_corrupted_grpc_chunk_fails_with_data_loss() -> None:
    server = GrpcServer(layout_of("float32"), timeout=30.0)
    try:
        layout = layout_of("float32")
        target = server.receiver.expect(PEER, 99, [0, 1], 0, layout, FakeCache(layout).write)
        data = bytes(layout.block_bytes)
        good_crc = google_crc32c.value(data)
        chunk = kvtransfer_pb2.KVChunk(transfer_id=99, layer=0, first_block=0, num_blocks=1, kv=0, offset=0,
                                       total_bytes=len(data), data=data[:-1] + b"\x01", crc32c=good_crc)
        with grpc.insecure_channel(target.address) as channel, pytest.raises(grpc.RpcError) as failure:
            kvtransfer_pb2_grpc.KVTransferStub(channel).Push(iter([chunk]), timeout=20)
        assert failure.value.code() is grpc.StatusCode.DATA_LOSS
        with pytest.raises(TransferError, match="CRC32C"):
            server.receiver.completion(99).result(20)
    finally:
        server.receiver.close()
        server.stop()
