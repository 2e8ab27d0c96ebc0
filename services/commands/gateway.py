"""`tandem gateway`: the client-facing APIs (gRPC and OpenAI-compatible HTTP) in front of prefill and
decode pools, or colocated workers."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.grpc_limits import GrpcLimits
    from services.common.tls import TlsConfig
    from services.gateway.api_keys import ApiKeys
    from services.gateway.catalog import ModelCatalog
    from services.gateway.limits import RequestLimits
    from services.gateway.registry import WorkerRegistry
    from services.repository.config import ModelRepository

from services.commands.address_flags import add_address_flags
from services.commands.gateway_cluster import add_cluster_flags
from services.commands.limit_flags import add_grpc_limit_flags, add_request_limit_flags, grpc_limits, request_limits
from services.commands.security_flags import add_api_key_flags, add_tls_flags, tls_config
from services.gateway.router import RoutingPolicy
from services.repository.config import load_repository

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `gateway` subcommand."""
    gateway = sub.add_parser("gateway", help="serve tandem.v1.Gateway in front of prefill and decode workers")
    add_address_flags(gateway, 50051, "its ready line")
    gateway.add_argument("--http-port", type=int, default=8000,
                         help="port of the OpenAI-compatible HTTP API; 0 = a free port")
    gateway.add_argument("--prefill", default="", help="prefill workers: HOST:PORT[,HOST:PORT...] (static discovery)")
    gateway.add_argument("--decode", default="", help="decode workers: HOST:PORT[,HOST:PORT...] (static discovery)")
    gateway.add_argument("--colocated", default="",
                         help="colocated workers (`tandem worker --role colocated`): HOST:PORT[,HOST:PORT...]")
    gateway.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                         help="time-to-first-token objective for requests that set none")
    gateway.add_argument("--tpot-slo-ms", type=float, default=100.0,
                         help="time-per-output-token objective for requests that set none")
    policy = RoutingPolicy()
    gateway.add_argument("--remote-ttft-share", type=float, default=policy.remote_ttft_share,
                         help="a decode worker whose running requests' TPOT slack allows it computes a prompt "
                              "itself once every prefill worker's predicted TTFT exceeds this share of the "
                              "objective, if that is sooner (1: only when no prefill worker meets it)")
    gateway.add_argument("--tpot-slack-share", type=float, default=policy.tpot_slack_share,
                         help="share of its running requests' least TPOT slack (the room left under their "
                              "objectives) a worker may spend stalling them with a prompt")
    gateway.add_argument("--max-queued-requests", type=int, default=256,
                         help="requests that may wait for capacity at once; beyond it they get RESOURCE_EXHAUSTED")
    gateway.add_argument("--max-migrations", type=int, default=2,
                         help="times a request may resume on another decode worker when its own fails "
                              "mid-stream; 0: the client gets the failure")
    gateway.add_argument("--model", default=None,
                         help="GGUF file or HF directory, for the tokenizer and the model's name "
                              "(default: the shipped SmolLM2-135M)")
    gateway.add_argument("--model-repository", default=None, metavar="TOML",
                         help="serve every model and version of this repository (services/repository), "
                              "each on the workers that report it, instead of --model; the file is watched "
                              "and a change (versions, splits) takes effect for the requests after it")
    gateway.add_argument("--max-model-len", type=int, default=None,
                         help="longest prompt plus output (default: the model's context length)")
    gateway.add_argument("--grace-period", type=float, default=30.0,
                         help="seconds in-flight requests get to finish on SIGTERM")
    gateway.add_argument("--wait-for-workers", type=float, default=300.0,
                         help="seconds to wait at startup for a serving worker in each pool before "
                              "reporting ready anyway")
    add_grpc_limit_flags(gateway)
    add_request_limit_flags(gateway)
    add_api_key_flags(gateway)
    add_tls_flags(gateway)
    add_cluster_flags(gateway)
    gateway.set_defaults(func=run)


def parse_addresses(value: str, flag: str) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` as a list without duplicates (empty for an empty value);
    ValueError naming the flag."""
    addresses = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{flag}: {address!r} is not HOST:PORT")
    return addresses


def routing_policy(args: argparse.Namespace) -> RoutingPolicy:
    """The RoutingPolicy the flags describe; ValueError naming the flag."""
    try:
        return RoutingPolicy(args.remote_ttft_share, args.tpot_slack_share)
    except ValueError as error:
        flag = "--" + str(error).split(":")[0].replace("_", "-")
        raise ValueError(f"{flag}: {str(error).partition(': ')[2]}") from error


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the exit code."""
    import asyncio

    from services.common.tls import warn_if_exposed
    from services.gateway.key_file import load_api_keys
    from services.gateway.registry import WorkerRegistry
    from services.gateway.router import SloTargets
    from services.observability.tracing import setup_tracing

    pools = {
        "prefill": parse_addresses(args.prefill, "--prefill"),
        "decode": parse_addresses(args.decode, "--decode"),
        "colocated": parse_addresses(args.colocated, "--colocated"),
    }
    if args.discovery == "kubernetes":
        if any(pools.values()):
            raise ValueError("--prefill/--decode/--colocated: the workers come from Kubernetes with "
                             "--discovery kubernetes")
    elif not pools["decode"] and not pools["colocated"]:
        raise ValueError("--decode/--colocated: give at least one decode or colocated worker")
    elif pools["decode"] and not pools["prefill"]:
        raise ValueError("--prefill: decode workers need at least one prefill worker")
    slo = SloTargets(args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
    policy = routing_policy(args)
    tls = tls_config(args)
    limits = grpc_limits(args)
    requests = request_limits(args)
    keys = load_api_keys(args.api_key_file)
    repository = None
    if args.model_repository is not None:
        if args.model is not None:
            raise ValueError("--model: the repository names the models; give one or the other")
        repository = load_repository(args.model_repository)
    warn_if_exposed("gateway", args.host, tls, authenticated=keys is not None)

    async def serve() -> int:
        # Built on the running loop: its gRPC channels belong to it.
        registry = WorkerRegistry(**pools, default_slo=slo, tls=tls, limits=limits, policy=policy)
        return await _serve(args, registry, tls, keys, limits, requests, repository)

    tracing = setup_tracing("gateway")
    try:
        return asyncio.run(serve())
    finally:
        if tracing is not None:
            tracing.shutdown()


async def _serve(args: argparse.Namespace, registry: WorkerRegistry, tls: TlsConfig | None,
                 keys: ApiKeys | None, limits: GrpcLimits, requests: RequestLimits,
                 repository: ModelRepository | None) -> int:
    import asyncio

    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    from engine.model.paths import served_model_id
    from services.commands.gateway_cluster import cluster_services
    from services.common.http_server import HttpListener
    from services.common.server import RoleServer
    from services.gateway.api_keys import ApiKeyInterceptor, ApiKeyMiddleware
    from services.gateway.handler import GatewayServicer
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.migration import MigrationPolicy
    from services.gateway.openai_api.app import create_app
    from services.gateway.repository_watch import RepositoryWatch
    from services.gateway.service import GatewayService
    from services.observability.tracing import traced_http

    # The model's name labels the metrics; it is known without reading the model file.
    metrics = GatewayMetrics(repository.models[0].name if repository is not None else served_model_id(args.model))
    metrics.watch_workers(lambda: [(w.role, w.address, w.routable, w.serves) for w in registry.workers])
    service = GatewayService(registry, metrics, args.max_queued_requests, limits=requests,
                             migration=MigrationPolicy(args.max_migrations))
    discovery, planner = cluster_services(args, registry, per_version=repository is not None)
    if planner is not None:
        metrics.watch_planner(lambda: planner.recommended)
    watch = RepositoryWatch(args.model_repository, service, args.max_model_len) if repository is not None else None
    # Clients authenticate with API keys, not certificates: the client API asks for none.
    credentials = tls.server_credentials(client_auth=False) if tls is not None else None
    interceptors = [ApiKeyInterceptor(keys)] if keys is not None else []
    server = RoleServer("gateway", args.host, args.port, args.grace_period, credentials, interceptors, limits,
                        args.advertise_host)
    server.add(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(service),
               gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name)
    app = traced_http(create_app(service, requests))
    if keys is not None:
        app = ApiKeyMiddleware(app, keys, metrics_auth=args.metrics_auth == "on", rate_limits=service.rate_limits)
    server.listen(HttpListener(app, args.host, args.http_port, tls.uvicorn_kwargs() if tls is not None else {}))

    async def load() -> None:
        registry.start()
        if discovery is not None:
            discovery.start()
        if planner is not None:
            planner.start()
        service.catalog = await asyncio.to_thread(_catalog, args, repository)
        metrics.model_loaded(max(entry.model.max_model_len for entry in service.catalog.entries))
        if watch is not None:
            watch.start()
        # Ready means routable, so that workers and gateway can start together; requests sent
        # while a pool has no serving worker get UNAVAILABLE.
        if not await registry.wait_routable(args.wait_for_workers):
            log.warning("no serving worker in some pool after %.0f s; ready anyway", args.wait_for_workers)

    async def close() -> None:
        if watch is not None:
            await watch.stop()
        if discovery is not None:
            discovery.stop()
        if planner is not None:
            await planner.stop()
        await registry.close()

    return await server.run(load, close)


def _catalog(args: argparse.Namespace, repository: ModelRepository | None) -> ModelCatalog:
    """The models the gateway serves: the repository's every version, or --model alone."""
    from services.gateway.catalog import ModelCatalog
    from services.gateway.model import ServedModel

    if repository is not None:
        return ModelCatalog.load(repository, args.max_model_len)
    return ModelCatalog.single(ServedModel.load(args.model, args.max_model_len))
