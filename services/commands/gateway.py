"""`tandem gateway`: the client-facing API in front of the prefill and decode pools."""

from __future__ import annotations

import argparse
import logging

from services.commands.gateway_cluster import add_cluster_flags

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `gateway` subcommand."""
    gateway = sub.add_parser("gateway", help="serve tandem.v1.Gateway in front of prefill and decode workers")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=50051, help="0 = a free port")
    gateway.add_argument("--prefill", help="prefill workers: HOST:PORT[,HOST:PORT...] (static discovery)")
    gateway.add_argument("--decode", help="decode workers: HOST:PORT[,HOST:PORT...] (static discovery)")
    gateway.add_argument("--model", default=None,
                         help="GGUF file or HF directory, for the tokenizer and the model's name "
                              "(default: the shipped SmolLM2-135M)")
    gateway.add_argument("--max-model-len", type=int, default=None,
                         help="longest prompt plus output (default: the model's context length)")
    gateway.add_argument("--grace-period", type=float, default=30.0,
                         help="seconds in-flight requests get to finish on SIGTERM")
    gateway.add_argument("--wait-for-workers", type=float, default=300.0,
                         help="seconds to wait at startup for a serving worker in each pool before "
                              "reporting ready anyway")
    add_cluster_flags(gateway)
    gateway.set_defaults(func=run)


def parse_addresses(value: str, flag: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` as a list without duplicates; ValueError naming the flag."""
    addresses = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not addresses:
        raise ValueError(f"{flag}: give at least one HOST:PORT")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{flag}: {address!r} is not HOST:PORT")
    return addresses


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the exit code."""
    import asyncio

    if args.discovery == "kubernetes":
        if args.prefill or args.decode:
            raise ValueError("--prefill/--decode: the workers come from Kubernetes with --discovery kubernetes")
        return asyncio.run(_serve(args, [], []))
    prefill = parse_addresses(args.prefill or "", "--prefill")
    decode = parse_addresses(args.decode or "", "--decode")
    return asyncio.run(_serve(args, prefill, decode))


async def _serve(args: argparse.Namespace, prefill: list[str], decode: list[str]) -> int:
    import asyncio

    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    from services.commands.gateway_cluster import cluster_services
    from services.common.server import RoleServer
    from services.gateway.handler import GatewayServicer
    from services.gateway.model import ServedModel
    from services.gateway.workers import WorkerRegistry

    registry = WorkerRegistry(prefill, decode)
    discovery, planner = cluster_services(args, registry)
    servicer = GatewayServicer(registry)
    server = RoleServer("gateway", args.host, args.port, args.grace_period)
    server.add(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer,
               gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name)

    async def load() -> None:
        registry.start()
        if discovery is not None:
            discovery.start()
        if planner is not None:
            planner.start()
        servicer.model = await asyncio.to_thread(ServedModel.load, args.model, args.max_model_len)
        # Ready means routable, so that workers and gateway can start together; requests sent
        # while a pool has no serving worker get UNAVAILABLE.
        if not await registry.wait_routable(args.wait_for_workers):
            log.warning("no serving worker in some pool after %.0f s; ready anyway", args.wait_for_workers)

    async def close() -> None:
        if discovery is not None:
            discovery.stop()
        if planner is not None:
            await planner.stop()
        await registry.close()

    return await server.run(load, close)
