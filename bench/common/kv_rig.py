"""One prompt's KV moved between two processes the way a prefill worker sends it: a sender process
(a KVSenderPool) and a receiving cache indexed by block id, for the kv_transfer and mesh_overhead
suites.

The prompt is 512 tokens of the default model's shape (30 layers, 3 KV heads, head_dim 64, blocks
of 16, fp32: about 23.6 MB; fp8_e4m3 or int8, 1-byte codes plus a float32 scale per row: about 6.3
MB; int4, 4-bit codes and a float16 scale and minimum per 16: about 4.4 MB), sent layer by layer; a
run is timed from the command that starts the sender to the receiver's completion, and each
receiver's first run (pairing, handshakes) is a warm-up. Every function takes the layout to send (default: fp32).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection

import grpc
import torch
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from engine.kv_cache.codec import KV_FORMATS
from engine.kv_cache.page_copy import copy_rows
from kvtransfer import KVLayout, KVSenderPool, KVTransferServicer, TransferTarget
from kvtransfer.grpc_stream import GrpcReceiver
from kvtransfer.transport import KVReceiver

LAYOUT = KVLayout("SmolLM2-135M-Instruct:bench", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32",
                  block_size=16)
PROMPT_TOKENS = 512
NUM_BLOCKS = PROMPT_TOKENS // LAYOUT.block_size


def layout_of(dtype: str) -> KVLayout:
    """The bench layout with its pages in KV format `dtype` (a KVLayout dtype name)."""
    return replace(LAYOUT, dtype=dtype)


def total_bytes(layout: KVLayout = LAYOUT) -> int:
    """Bytes of one prompt's K and V in `layout`."""
    return 2 * layout.num_layers * NUM_BLOCKS * layout.block_bytes


TOTAL_BYTES = total_bytes()


def prompt_kv(layout: KVLayout = LAYOUT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One prompt's K and V per layer, as an export hands them on (encoded in the layout's format)."""
    codec = KV_FORMATS[layout.dtype].codec
    shape = (NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [(codec.encode(torch.randn(shape)), codec.encode(torch.randn(shape))) for _ in range(layout.num_layers)]


# ---- the sender process -------------------------------------------------------------------------------
def sender_process(conn: Connection, layout: KVLayout = LAYOUT) -> None:
    """Answer ("kv", target bytes, --kv-checksum on) and ("raw", port) with the bytes sent; ("exit",) ends."""
    torch.set_num_threads(1)
    pools = {checksum: KVSenderPool(layout, timeout=60.0, checksum=checksum) for checksum in (True, False)}
    layers = prompt_kv(layout)
    while (command := conn.recv())[0] != "exit":
        if command[0] == "kv":
            target = TransferTarget.from_proto(kvtransfer_pb2.KVTarget.FromString(command[1]))
            sender = pools[command[2]].sender(target)
            for layer, (k, v) in enumerate(layers):
                sender.send(layer, 0, k, v)
            sender.finish()
            conn.send(sender.wait(60.0))
        else:
            with socket.create_connection(("127.0.0.1", command[1])) as sock:
                for k, v in layers:
                    sock.sendall(k.view(torch.uint8).numpy())
                    sock.sendall(v.view(torch.uint8).numpy())
            conn.send(total_bytes(layout))
    for pool in pools.values():
        pool.close()


# ---- the receiving side -------------------------------------------------------------------------------
class Cache:
    """The receiver's KV cache: per-layer tensors indexed by block id."""

    def __init__(self, layout: KVLayout = LAYOUT) -> None:
        shape = (layout.num_layers, NUM_BLOCKS + 8, *layout.block_shape)
        self.k, self.v = torch.zeros(shape, dtype=layout.torch_dtype), torch.zeros(shape, dtype=layout.torch_dtype)

    def write(self, layer: int, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(list(block_ids))
        copy_rows(self.k[layer], index, k)  # as the engine's cache writes received pages
        copy_rows(self.v[layer], index, v)


def serve_grpc(layout: KVLayout = LAYOUT, checksum: bool = True,
               host: str = "127.0.0.1") -> tuple[GrpcReceiver, Callable[[], None]]:
    """A grpc.aio server with the KVTransfer service on its own thread, on an ephemeral port of
    `host`, its receiver's `--kv-checksum` `checksum`; (receiver, stop)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start() -> tuple[GrpcReceiver, grpc.aio.Server]:
        server = grpc.aio.server()
        port = server.add_insecure_port(f"{host}:0")
        receiver = GrpcReceiver(f"{host}:{port}", timeout=60.0, checksum=checksum)
        kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(layout, receiver), server)
        await server.start()
        return receiver, server

    receiver, server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    return receiver, stop


class BackendRun:
    """Timed transfers through one receiver; the first one (pairing, handshake) is a warm-up.
    `checksum` is the sender's `--kv-checksum` (pages go without CRC32C only if the receiver's is off too)."""

    def __init__(self, conn: Connection, receiver: KVReceiver, layout: KVLayout = LAYOUT,
                 checksum: bool = True) -> None:
        self._conn = conn
        self._receiver = receiver
        self._layout = layout
        self._checksum = checksum
        self._cache = Cache(layout)
        self._next_id = 1
        self.once()

    def once(self) -> float:
        """Seconds for one transfer, from the command that starts the sender to the completion."""
        transfer_id, self._next_id = self._next_id, self._next_id + 1
        block_ids = list(range(8, 8 + NUM_BLOCKS))
        target = self._receiver.expect("bench-prefill", transfer_id, block_ids, 0, self._layout, self._cache.write)
        future = self._receiver.completion(transfer_id)
        start = time.perf_counter()
        self._conn.send(("kv", target.to_proto().SerializeToString(), self._checksum))
        received = future.result(60)
        elapsed = time.perf_counter() - start
        assert self._conn.recv() == received == total_bytes(self._layout)
        return elapsed
