"""`tandem probe`: exit 0 if a Tandem server's gRPC health says SERVING, 1 otherwise.

Kubernetes' own gRPC probes speak plaintext only; a worker that asks for client certificates is
probed from inside its pod with this command and the pod's own certificate instead.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from services.commands.security_flags import TlsFlags
from services.common.config_flags import add_flags, flag, from_args


@dataclass(frozen=True)
class ProbeFlags:
    """The flags of `tandem probe` (its address is a positional argument)."""

    timeout: float = flag(3.0, "seconds to wait for the answer")
    tls: TlsFlags = dataclasses.field(default_factory=TlsFlags)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `probe` subcommand."""
    probe = sub.add_parser("probe", help="check a server's gRPC health (exit 0 when SERVING)")
    probe.add_argument("address", help="HOST:PORT of the server")
    add_flags(probe, ProbeFlags)
    probe.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """0 when the server answers SERVING, 1 when it answers anything else or cannot be reached."""
    import asyncio
    import sys

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.channels import Channels

    flags: ProbeFlags = from_args(ProbeFlags, args)

    async def check() -> int:
        async with Channels(flags.tls.config()).open(args.address) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                        timeout=flags.timeout)
            except grpc.aio.AioRpcError as error:
                print(f"tandem probe: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
        return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1

    return asyncio.run(check())
