"""The two sides of the KV transfer integration tests: a receiver here (with a fake cache: plain
tensors indexed by block id) and a sender in a spawned child driven by plain commands through a
pipe. Pages are random but seeded, so both sides build them without shipping tensors outside the
transport under test."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from engine.kv_cache.codec import KV_FORMATS
from kvtransfer import KVLayout, KVSender, KVSenderPool, KVTransferServicer, TransferTarget
from kvtransfer.grpc_stream import GrpcReceiver
from kvtransfer.receiver import make_receiver
from kvtransfer.transport import KVReceiver

BACKENDS = ["torch_dist", "grpc"]
PEER = "prefill-0:50061"
# 200 fp32 blocks of 12 KiB: a whole layer's K is 2.4 MB, more than one 2 MiB gRPC piece.
NUM_BLOCKS = 200
CACHE_BLOCKS = 230


def layout_of(dtype: str, **changes: Any) -> KVLayout:
    return replace(KVLayout("tiny:0123456789abcdef", 4, 3, 64, dtype, 16), **changes)


def pages(layout: KVLayout, num_blocks: int, seed: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded K and V one layer of a transfer sends (both processes compute them), encoded as
    the layout's pages (a quantized layout's rows carry their scales)."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    kv_format = KV_FORMATS[layout.dtype]
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return kv_format.codec.encode(k).to(layout.torch_dtype), kv_format.codec.encode(v).to(layout.torch_dtype)


def layer_pieces(layer: int, num_blocks: int) -> list[tuple[int, int]]:
    """(first_block, end_block) sends of one layer: whole for layer 0, in two chunks after (as a
    chunked prefill sends them)."""
    half = num_blocks // 2
    return [(0, num_blocks)] if layer == 0 or half == 0 else [(0, half), (half, num_blocks)]


# ---- the sender process -----------------------------------------------------------------------------
def sender_process(conn: Connection, fault_file: Path | None = None) -> None:
    """Serve commands: open, send, finish, wait, abort, checked (1 if the transfer's pages carry a
    CRC32C), exit; reply ("ok", int) or ("error", str). With `fault_file`, its senders suffer the
    faults the file asks for (tests/kv_faults.py)."""
    torch.set_num_threads(1)
    if fault_file is not None:
        from kv_faults import install

        install(fault_file)
    pools: dict[tuple[KVLayout, bool], KVSenderPool] = {}
    senders: dict[int, tuple[KVSender, TransferTarget]] = {}
    while True:
        command, *args = conn.recv()
        try:
            if command == "exit":
                for pool in pools.values():
                    pool.close()
                conn.send(("ok", 0))
                return
            if command == "open":
                target = TransferTarget.from_proto(kvtransfer_pb2.KVTarget.FromString(args[0]))
                own_layout = KVLayout.from_proto(kvtransfer_pb2.KVLayout.FromString(args[1]))
                checksum = args[2]
                if (own_layout, checksum) not in pools:
                    pools[own_layout, checksum] = KVSenderPool(own_layout, timeout=10.0, checksum=checksum)
                pool = pools[own_layout, checksum]
                senders[target.transfer_id] = (pool.sender(target), target)
                reply = 0
            else:
                sender, target = senders[args[0]]
                reply = 0
                if command == "send":
                    seed, layer = args[1], args[2]
                    k, v = pages(target.layout, len(target.block_ids), seed, layer)
                    for start, end in layer_pieces(layer, len(target.block_ids)):
                        sender.send(layer, start, k[start:end].clone(), v[start:end].clone())
                elif command == "finish":
                    sender.finish()
                elif command == "wait":
                    reply = sender.wait(args[1])
                elif command == "abort":
                    sender.abort()
                elif command == "checked":
                    reply = int(sender.checksum)
            conn.send(("ok", reply))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Child:
    """The sender process, driven command by command."""

    def __init__(self, fault_file: Path | None = None) -> None:
        """`fault_file`: the child's senders suffer the faults it asks for (tests/kv_faults.py)."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=sender_process, args=(child_end, fault_file), daemon=True)
        self.process.start()

    def __call__(self, *command: Any) -> tuple[str, Any]:
        self.conn.send(command)
        if not self.conn.poll(30):
            raise AssertionError(f"the sender process did not answer {command[0]}")
        return self.conn.recv()

    def open(self, target: TransferTarget, own_layout: KVLayout | None = None, checksum: bool = True
             ) -> tuple[str, Any]:
        """Open a sender from a pool of `own_layout` (default: the target's) and `--kv-checksum`."""
        own = (own_layout or target.layout).to_proto().SerializeToString()
        return self("open", target.to_proto().SerializeToString(), own, checksum)

    def send_all(self, target: TransferTarget, seed: int) -> int:
        for layer in range(target.layout.num_layers):
            assert self("send", target.transfer_id, seed, layer) == ("ok", 0)
        assert self("finish", target.transfer_id) == ("ok", 0)
        status, sent = self("wait", target.transfer_id, 20.0)
        assert status == "ok", sent
        return sent

    def stop(self) -> None:
        if self.process.is_alive():
            self("exit")
        self.process.join(10)


# ---- the receiving side -----------------------------------------------------------------------------
class FakeCache:
    """Per-layer K and V tensors indexed by block id, written by the receiver's threads."""

    def __init__(self, layout: KVLayout) -> None:
        shape = (layout.num_layers, CACHE_BLOCKS, *layout.block_shape)
        self.k = torch.zeros(shape, dtype=layout.torch_dtype)
        self.v = torch.zeros(shape, dtype=layout.torch_dtype)
        self.writes = 0
        self.first_write = threading.Event()
        self._lock = threading.Lock()

    def write(self, layer: int, block_ids: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(list(block_ids))
        self.k[layer, index] = k
        self.v[layer, index] = v
        with self._lock:
            self.writes += 1
        self.first_write.set()

    def assert_holds(self, target: TransferTarget, seed: int) -> None:
        """Bit for bit, every layer's pages landed in target.block_ids."""
        index = torch.tensor(target.block_ids)
        for layer in range(target.layout.num_layers):
            k, v = pages(target.layout, len(target.block_ids), seed, layer)
            assert torch.equal(self.k[layer, index].view(torch.uint8), k.view(torch.uint8)), f"K of layer {layer}"
            assert torch.equal(self.v[layer, index].view(torch.uint8), v.view(torch.uint8)), f"V of layer {layer}"


class GrpcServer:
    """A grpc.aio server on 127.0.0.1:0 serving KVTransfer, on its own event-loop thread."""

    def __init__(self, layout: KVLayout, timeout: float, checksum: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        started = asyncio.run_coroutine_threadsafe(self._start(layout, timeout, checksum), self.loop)
        self.receiver, self.server = started.result(10)

    async def _start(self, layout: KVLayout, timeout: float, checksum: bool) -> tuple[GrpcReceiver, grpc.aio.Server]:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        receiver = GrpcReceiver(f"127.0.0.1:{port}", timeout, checksum)
        kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(layout, receiver), server)
        await server.start()
        return receiver, server

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class Receivers:
    """Receivers of one backend here, one per (dtype, timeout, --kv-checksum), made on first use."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._made: dict[tuple[str, float, bool], KVReceiver] = {}
        self._servers: list[GrpcServer] = []
        self._next_id = 1

    def get(self, dtype: str = "float32", timeout: float = 30.0, checksum: bool = True) -> KVReceiver:
        key = (dtype, timeout, checksum)
        if key not in self._made:
            if self.backend == "grpc":
                server = GrpcServer(layout_of(dtype), timeout, checksum)
                self._servers.append(server)
                self._made[key] = server.receiver
            else:
                self._made[key] = make_receiver("torch_dist", "127.0.0.1", "", timeout=timeout, checksum=checksum)
        return self._made[key]

    def expect(self, cache: FakeCache, layout: KVLayout, num_blocks: int = NUM_BLOCKS,
               receiver: KVReceiver | None = None, peer: str = PEER) -> TransferTarget:
        """A new transfer into scattered blocks of `cache`."""
        transfer_id, self._next_id = self._next_id, self._next_id + 1
        block_ids = torch.randperm(CACHE_BLOCKS, generator=torch.Generator().manual_seed(transfer_id))[:num_blocks]
        receiver = receiver or self.get(layout.dtype)
        return receiver.expect(peer, transfer_id, block_ids.tolist(), 16, layout, cache.write)

    def close(self) -> None:
        for receiver in self._made.values():
            receiver.close()
        for server in self._servers:
            server.stop()


def hooked_side(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Receivers, Child, Path]]:
    """The body of a module fixture parametrized by backend: the receivers of that backend here, and
    a sender process whose senders suffer the faults the yielded file asks for (tests/kv_faults.py)."""
    torch.set_num_threads(1)
    fault_file = tmp_path_factory.mktemp("kv-fault") / "fault"
    child = Child(fault_file)
    receivers = Receivers(request.param)
    try:
        yield receivers, child, fault_file
    finally:
        child.stop()
        receivers.close()
