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
from services.common.server import channel_options
from services.common.tls import TlsConfig


@dataclass(frozen=True)
class Channels:
    """`tls`: (mutual) TLS on the server and every channel (None: plaintext); `limits`: their
    message sizes and streams."""

    tls: TlsConfig | None = None
    limits: GrpcLimits = DEFAULT_GRPC_LIMITS

    def open(self, address: str, extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to another Tandem process (host:port): mutual TLS with `tls`,
        plaintext without."""
        options = self._options(extra_options)
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=options)

    def open_sync(self, address: str) -> grpc.Channel:
        """A synchronous channel to another Tandem process (the gRPC KV backend's)."""
        options = self._options(())
        if self.tls is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self.tls.channel_credentials(), options=options)

    def _options(self, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """`channel_options(limits)`, then `extra`, then TLS's (the expected peer name, if set)."""
        return [*channel_options(self.limits), *extra, *(self.tls.channel_options() if self.tls else [])]

    def server_credentials(self, client_auth: bool = True) -> grpc.ServerCredentials | None:
        """The server's credentials (None: plaintext); see TlsConfig.server_credentials."""
        return self.tls.server_credentials(client_auth) if self.tls is not None else None


# Plaintext with the default limits: a developer's loopback, and tests.
PLAINTEXT = Channels()
