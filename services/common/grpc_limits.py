"""What every Tandem gRPC server and channel accepts: message sizes and streams per connection.

One `GrpcLimits` per process, from its command line (each field is a flag); its server
and every channel it opens to another Tandem process use it, so peers configured alike agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.config_flags import flag

# KV chunks are a few MiB; leave room above gRPC's 4 MiB default.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Above any burst the overload tests send over one channel (the gateway's to a decode worker carries
# every request it routes there), yet bounded.
DEFAULT_MAX_CONCURRENT_STREAMS = 1024


@dataclass(frozen=True)
class GrpcLimits:
    """`max_message_bytes`: the largest message a server or channel sends or receives (a larger one
    fails its RPC with RESOURCE_EXHAUSTED). `max_concurrent_streams`: RPCs one client connection may
    have open at a server (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a gRPC client queues the calls
    beyond it until a stream ends, so it bounds a connection's share of the server rather than
    refusing anything."""

    max_message_bytes: int = flag(DEFAULT_MAX_MESSAGE_BYTES,
                                  "largest gRPC message this process's server and channels send or receive")
    max_concurrent_streams: int = flag(DEFAULT_MAX_CONCURRENT_STREAMS, "gRPC calls one client connection may "
                                       "have open at once (further calls wait)")

    def __post_init__(self) -> None:
        # gRPC takes both as C ints.
        for name in ("max_message_bytes", "max_concurrent_streams"):
            value = getattr(self, name)
            if not 1 <= value < 2**31:
                raise ValueError(f"{name}: must be in [1, 2^31), got {value}")

    def channel_options(self) -> list[tuple[str, Any]]:
        """The message-size options of a channel."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        """The message-size and stream options of a server."""
        return [*self.channel_options(), ("grpc.max_concurrent_streams", self.max_concurrent_streams)]


DEFAULT_GRPC_LIMITS = GrpcLimits()
