"""`tandem gateway`: the client-facing API in front of fixed prefill and decode pools."""

from __future__ import annotations

import argparse
import logging

from services.commands.telemetry_flags import add_metrics_flag, metrics_port

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `gateway` subcommand."""
    gateway = sub.add_parser("gateway", help="serve tandem.v1.Gateway in front of prefill and decode workers")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=50051, help="0 = a free port")
    gateway.add_argument("--prefill", required=True, help="prefill workers: HOST:PORT[,HOST:PORT...]")
    gateway.add_argument("--decode", required=True, help="decode workers: HOST:PORT[,HOST:PORT...]")
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
    add_metrics_flag(gateway)
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

    from services.observability.tracing import setup_tracing

    prefill = parse_addresses(args.prefill, "--prefill")
    decode = parse_addresses(args.decode, "--decode")
    port = metrics_port(args)
    tracing = setup_tracing("gateway")
    try:
        return asyncio.run(_serve(args, prefill, decode, port))
    finally:
        if tracing is not None:
            tracing.shutdown()


async def _serve(args: argparse.Namespace, prefill: list[str], decode: list[str], metrics_port: int) -> int:
    import asyncio

    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    from engine.model.paths import served_model_id
    from services.common.server import RoleServer
    from services.gateway.handler import GatewayServicer
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.model import ServedModel
    from services.gateway.workers import WorkerRegistry
    from services.observability.metrics import serve_metrics

    registry = WorkerRegistry(prefill, decode)
    # The model's name labels the metrics; it is known without reading the model file.
    metrics = GatewayMetrics(served_model_id(args.model))
    servicer = GatewayServicer(registry, metrics)
    server = RoleServer("gateway", args.host, args.port, args.grace_period)
    server.metrics_address = serve_metrics(metrics.registry, args.host, metrics_port)
    server.add(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer,
               gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name)

    async def load() -> None:
        registry.start()
        servicer.model = await asyncio.to_thread(ServedModel.load, args.model, args.max_model_len)
        # Ready means routable, so that workers and gateway can start together; requests sent
        # while a pool has no serving worker get UNAVAILABLE.
        if not await registry.wait_routable(args.wait_for_workers):
            log.warning("no serving worker in some pool after %.0f s; ready anyway", args.wait_for_workers)

    return await server.run(load, registry.close)
