"""How KV pages travel between workers: the flags both ends of a transfer (prefill and decode
workers) and the mesh that starts them take alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.config_flags import flag


@dataclass(frozen=True)
class KVLinkFlags:
    """`--kv-backend` (the receiving end's) and `--kv-checksum` (both ends'). The backends are
    kvtransfer.descriptor.Backend's, spelled out so that parsing the command line imports no torch."""

    kv_backend: Literal["torch_dist", "grpc"] = flag("torch_dist", "how prompts' KV pages arrive from prefill "
                                                                   "workers")
    kv_checksum: Literal["on", "off"] = flag(
        "on", "a checksum on KV pages (CRC32C on gRPC and gloo, device sums on NCCL). off skips it only for "
        "peers that are off too: a checksum is used unless both ends say off")
