"""`tandem kv-host-tier`: run a node's KV host tier owner (services.host_tier.owner) until stopped."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.config_flags import add_flags, flag, from_args

_MIB = 1024 * 1024


@dataclass(frozen=True)
class HostTierFlags:
    """The flags of `tandem kv-host-tier`."""

    socket: str = flag("/run/tandem/kv-host-tier.sock", "Unix socket path the node's workers' --kv-host-tier names")
    capacity_mib: int = flag(4096, "memory for KV blocks, MiB; least recently used blocks go first")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `kv-host-tier` subcommand."""
    command = sub.add_parser("kv-host-tier", help="hold KV blocks in memory for the workers of this node")
    add_flags(command, HostTierFlags)
    command.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import logging

    from services.host_tier.owner import HostTierServer

    flags: HostTierFlags = from_args(HostTierFlags, args)
    server = HostTierServer(flags.socket, flags.capacity_mib * _MIB)
    logging.getLogger(__name__).info("KV host tier: %d MiB on %s", flags.capacity_mib, flags.socket)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
