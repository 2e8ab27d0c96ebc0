"""One process's gRPC links to other Tandem processes, built once from its TLS and limits.

A process's server and every channel it opens (to workers, to prefill workers, for KV pages) use
the same `Channels`, so that peers configured alike agree on TLS and message sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.grpc_limits import DEFAULT_GRPC_LIMITS, GrpcLimits
from services.common.tls import TlsConfig, open_channel, open_sync_channel


@dataclass(frozen=True)
class Channels:
    """`tls`: (mutual) TLS on the server and every channel (None: plaintext); `limits`: their
    message sizes and streams."""

    tls: TlsConfig | None = None
    limits: GrpcLimits = DEFAULT_GRPC_LIMITS

    def open(self, address: str, extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to another Tandem process (host:port)."""
        return open_channel(address, self.tls, extra_options, self.limits)

    def open_sync(self, address: str) -> grpc.Channel:
        """A synchronous channel to another Tandem process (the gRPC KV backend's)."""
        return open_sync_channel(address, self.tls, self.limits)

    def server_credentials(self, client_auth: bool = True) -> grpc.ServerCredentials | None:
        """The server's credentials (None: plaintext); see TlsConfig.server_credentials."""
        return self.tls.server_credentials(client_auth) if self.tls is not None else None


# Plaintext with the default limits: a developer's loopback, and tests.
PLAINTEXT = Channels()
