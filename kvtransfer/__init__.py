"""Moving KV pages from a prefill process to a decode process, layer by layer.

Two backends: `torch_dist` (pairwise torch.distributed groups, gloo or NCCL) and `grpc` (chunked
client streams with CRC32C). The decode side makes a receiver, the prefill side a sender pool.
"""

from kvtransfer.descriptor import KVLayout, TransferError, TransferTarget, WriteBlocks
from kvtransfer.grpc_stream import KVTransferServicer
from kvtransfer.receiver import make_receiver
from kvtransfer.sender import KVSenderPool
from kvtransfer.transport import KVReceiver, KVSender

__all__ = [
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVSenderPool",
    "KVTransferServicer",
    "TransferError",
    "TransferTarget",
    "WriteBlocks",
    "make_receiver",
]
