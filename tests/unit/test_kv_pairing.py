"""The one KV layout check: a prefill worker's sender pairing with a decode worker's receiver
(torch_dist pairing, the gRPC backend's Handshake), on real loopback pairs and channels."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace

import grpc
import pytest
import torch
from tandem.v1 import kvtransfer_pb2_grpc

from kvtransfer import KVLayout, KVSenderPool, KVTransferServicer, TransferTarget
from kvtransfer.descriptor import LayoutTransferError
from kvtransfer.torch_dist_receiver import TorchDistReceiver

OURS = KVLayout("tiny:0123456789abcdef", 2, 1, 4, "float32", 16)
THEIRS = replace(OURS, block_size=32)
QUANTIZED = replace(OURS, dtype="fp8_e4m3")  # the same model, its cache in fp8: pages of another format
PEER = "prefill-0:50061"


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _refuse_to_dial(address: str) -> grpc.Channel:
    raise AssertionError(f"dialled {address} for a target of another layout")


@pytest.mark.parametrize("backend", ["torch_dist", "grpc"])
@pytest.mark.parametrize(("theirs", "reason"), [
    (THEIRS, "block_size: 16 here, 32 there"),
    (QUANTIZED, "dtype: float32 here, fp8_e4m3 there"),
])
def test_a_target_of_another_layout_is_refused_before_any_connection(
    backend: str, theirs: KVLayout, reason: str
) -> None:
    # Nothing listens on the port: a pool that tried to pair would fail otherwise, and later.
    pool = KVSenderPool(OURS, timeout=5.0, connect=_refuse_to_dial)
    target = TransferTarget(theirs, 1, (0,), 0, backend, "127.0.0.1", _unused_port(), "ab" * 16)
    try:
        with pytest.raises(LayoutTransferError) as refused:
            pool.sender(target)
        assert refused.value.reason == reason
        assert str(refused.value) == f"KV layout mismatch with {target.address}: {reason}"
    finally:
        pool.close()


def test_a_torch_dist_pair_serves_only_targets_of_the_layout_it_was_paired_for() -> None:
    receiver = TorchDistReceiver("127.0.0.1", timeout=10.0)
    pool = KVSenderPool(OURS, timeout=10.0)
    try:
        paired = receiver.expect(PEER, 1, [0], 0, OURS, lambda *_: None)
        sender = pool.sender(paired)
        # The same receiver's next target, on the same pair (namespace), but in another layout.
        other = receiver.expect(PEER, 2, [1], 0, THEIRS, lambda *_: None)
        assert other.namespace == paired.namespace
        with pytest.raises(LayoutTransferError, match="block_size: 16 here, 32 there"):
            pool.sender(other)
        pages = torch.zeros(1, *OURS.block_shape)
        for layer in range(OURS.num_layers):
            sender.send(layer, 0, pages.clone(), pages.clone())
        sender.finish()
        assert receiver.completion(1).result(10) == sender.wait(10) == 2 * OURS.num_layers * OURS.block_bytes
    finally:
        pool.close()
        receiver.close()


def test_a_grpc_channel_serves_only_targets_of_the_layout_its_handshake_accepted() -> None:
    asyncio.run(_against_a_kv_service(OURS, _channel_for_one_layout))


@pytest.mark.parametrize(("theirs", "reason"), [
    (THEIRS, "block_size: 16 here, 32 there"),
    (QUANTIZED, "dtype: float32 here, fp8_e4m3 there"),
])
def test_a_grpc_receiver_holding_another_layout_is_refused_by_the_handshake(theirs: KVLayout, reason: str) -> None:
    asyncio.run(_against_a_kv_service(theirs, lambda pool, address: _handshake_refused(pool, address, reason)))


async def _channel_for_one_layout(pool: KVSenderPool, address: str) -> None:
    host, port = address.rsplit(":", 1)
    sender = await asyncio.to_thread(pool.sender, TransferTarget(OURS, 1, (0,), 0, "grpc", host, int(port)))
    sender.abort()
    # What a decode worker restarted at the same address with 32-token blocks would send: the
    # channel reconnects by itself, so only the target's layout can tell.
    restarted = TransferTarget(THEIRS, 2, (0,), 0, "grpc", host, int(port))
    with pytest.raises(LayoutTransferError, match="block_size: 16 here, 32 there"):
        await asyncio.to_thread(pool.sender, restarted)


async def _handshake_refused(pool: KVSenderPool, address: str, reason: str) -> None:
    host, port = address.rsplit(":", 1)
    # The target claims our layout; only the receiver's answer shows it holds another.
    target = TransferTarget(OURS, 1, (0,), 0, "grpc", host, int(port))
    with pytest.raises(LayoutTransferError) as refused:
        await asyncio.to_thread(pool.sender, target)
    assert refused.value.reason == reason


async def _against_a_kv_service(layout: KVLayout, scenario) -> None:
    """Run `scenario(pool, address)` with our pool against a KVTransfer service holding `layout`."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(layout, None), server)
    await server.start()
    pool = KVSenderPool(OURS, timeout=10.0)
    try:
        await scenario(pool, f"127.0.0.1:{port}")
    finally:
        await asyncio.to_thread(pool.close)
        await server.stop(None)
