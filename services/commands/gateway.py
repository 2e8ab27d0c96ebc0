"""`tandem gateway`: the client-facing APIs (gRPC and OpenAI-compatible HTTP) in front of prefill and
decode pools, or colocated workers."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.channels import Channels
    from services.gateway.api_keys import ApiKeys
    from services.gateway.catalog import ModelCatalog
    from services.gateway.registry import WorkerRegistry
    from services.repository.config import ModelRepository

from services.commands.address_flags import AddressFlags
from services.commands.gateway_cluster import ClusterFlags
from services.commands.security_flags import ApiKeyFlags, TlsFlags
from services.common.config_flags import add_flags, flag, from_args
from services.common.grpc_limits import GrpcLimits
from services.gateway.approximate_index import PrefixIndexKind
from services.gateway.limits import RequestLimits
from services.gateway.routing_policy import RoutingPolicy
from services.gateway.tools.choice import ToolFlags
from services.repository.config import load_repository

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayFlags:
    """The flags of `tandem gateway`: one field per flag."""

    address: AddressFlags = dataclasses.field(default_factory=AddressFlags)
    http_port: int = flag(8000, "port of the OpenAI-compatible HTTP API; 0 = a free port")
    prefill: str = flag("", "prefill workers: HOST:PORT[,HOST:PORT...] (static discovery)")
    decode: str = flag("", "decode workers: HOST:PORT[,HOST:PORT...] (static discovery)")
    colocated: str = flag("", "colocated workers (`tandem worker --role colocated`): HOST:PORT[,HOST:PORT...]")
    ttft_slo_ms: float = flag(2000.0, "time-to-first-token objective for requests that set none")
    tpot_slo_ms: float = flag(100.0, "time-per-output-token objective for requests that set none")
    routing: RoutingPolicy = dataclasses.field(default_factory=RoutingPolicy)
    prefix_index: PrefixIndexKind = flag(
        "exact", "where the router looks up which worker caches a prompt's prefix: exact, the workers' own block "
        "events (their hashes checked at registration); approximate, the gateway's record of where it placed each "
        "prompt, bounded by each worker's KV size (for workers whose events cannot be trusted or reached)")
    max_queued_requests: int = flag(256, "requests that may wait for capacity at once; beyond it they get "
                                         "RESOURCE_EXHAUSTED")
    max_migrations: int = flag(2, "times a request may resume on another decode worker when its own fails "
                                  "mid-stream; 0: the client gets the failure")
    model: str | None = flag(None, "GGUF file or HF directory, for the tokenizer and the model's name (default: "
                                   "the shipped SmolLM2-135M)")
    model_repository: str | None = flag(
        None, "serve every model and version of this repository (services/repository), each on the workers that "
        "report it, instead of --model; the file is watched and a change (versions, splits) takes effect for the "
        "requests after it", metavar="TOML")
    max_model_len: int | None = flag(None, "longest prompt plus output (default: the model's context length; "
                                     "beyond it for workers with --kv-sliding-window)")
    grace_period: float = flag(30.0, "seconds in-flight requests get to finish on SIGTERM")
    wait_for_workers: float = flag(300.0, "seconds to wait at startup for a serving worker in each pool before "
                                          "reporting ready anyway")
    limits: GrpcLimits = dataclasses.field(default_factory=GrpcLimits)
    requests: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    keys: ApiKeyFlags = dataclasses.field(default_factory=ApiKeyFlags)
    tls: TlsFlags = dataclasses.field(default_factory=TlsFlags)
    cluster: ClusterFlags = dataclasses.field(default_factory=ClusterFlags)
    tools: ToolFlags = dataclasses.field(default_factory=ToolFlags)


# The gateway's own default --port.
PORT = 50051


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `gateway` subcommand."""
    gateway = sub.add_parser("gateway", help="serve tandem.v1.Gateway in front of prefill and decode workers")
    add_flags(gateway, GatewayFlags, defaults={"port": PORT})
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


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the exit code."""
    import asyncio

    from services.common.channels import Channels
    from services.common.tls import warn_if_exposed
    from services.gateway.key_file import load_api_keys
    from services.gateway.registry import WorkerRegistry
    from services.gateway.router import SloTargets
    from services.observability.tracing import setup_tracing

    flags: GatewayFlags = from_args(GatewayFlags, args)
    pools = {
        "prefill": parse_addresses(flags.prefill, "--prefill"),
        "decode": parse_addresses(flags.decode, "--decode"),
        "colocated": parse_addresses(flags.colocated, "--colocated"),
    }
    if flags.cluster.discovery == "kubernetes":
        if any(pools.values()):
            raise ValueError("--prefill/--decode/--colocated: the workers come from Kubernetes with "
                             "--discovery kubernetes")
    elif not pools["decode"] and not pools["colocated"]:
        raise ValueError("--decode/--colocated: give at least one decode or colocated worker")
    elif pools["decode"] and not pools["prefill"]:
        raise ValueError("--prefill: decode workers need at least one prefill worker")
    slo = SloTargets(flags.ttft_slo_ms / 1000, flags.tpot_slo_ms / 1000)
    channels = Channels(flags.tls.config(), flags.limits)
    keys = load_api_keys(flags.keys.api_key_file)
    repository = None
    if flags.model_repository is not None:
        if flags.model is not None:
            raise ValueError("--model: the repository names the models; give one or the other")
        repository = load_repository(flags.model_repository)
        if flags.tools.chat_template is not None:
            raise ValueError("--chat-template: a repository's models render chats with their own templates")
    warn_if_exposed("gateway", flags.address.host, channels.tls, authenticated=keys is not None)

    async def serve() -> int:
        # Built on the running loop: its gRPC channels belong to it.
        registry = WorkerRegistry(**pools, default_slo=slo, channels=channels, policy=flags.routing,
                                  prefix_index=flags.prefix_index)
        return await _serve(flags, registry, channels, keys, repository)

    tracing = setup_tracing("gateway")
    try:
        return asyncio.run(serve())
    finally:
        if tracing is not None:
            tracing.shutdown()


async def _serve(flags: GatewayFlags, registry: WorkerRegistry, channels: Channels, keys: ApiKeys | None,
                 repository: ModelRepository | None) -> int:
    import asyncio

    from tandem.v1 import gateway_pb2, gateway_pb2_grpc

    from engine.model.paths import served_model_id
    from services.commands.gateway_cluster import cluster_services
    from services.common.http_server import HttpListener
    from services.common.server import RoleServer
    from services.gateway.adapter_sync import AdapterSync
    from services.gateway.api_keys import ApiKeyInterceptor, ApiKeyMiddleware
    from services.gateway.handler import GatewayServicer
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.migration import MigrationPolicy
    from services.gateway.openai_api.app import create_app
    from services.gateway.pool_load import PoolSloUse
    from services.gateway.repository_watch import RepositoryWatch
    from services.gateway.service import GatewayService
    from services.observability.tracing import traced_http

    # The model's name labels the metrics; it is known without reading the model file.
    metrics = GatewayMetrics(repository.models[0].name if repository is not None else served_model_id(flags.model))
    metrics.watch_workers(lambda: [(w.role, w.address, w.routable, w.version_key) for w in registry.workers])
    metrics.watch_prefix_index(registry.prefix_index, lambda: registry.blocks.size, registry.probe.refused,
                               lambda: registry.probe.mismatches)
    metrics.registry.register(PoolSloUse(metrics.model_name, registry.pool_slo_use))
    service = GatewayService(registry, metrics, flags.max_queued_requests, limits=flags.requests,
                             migration=MigrationPolicy(flags.max_migrations))
    discovery, planner = cluster_services(flags.cluster, registry, per_version=repository is not None)
    if planner is not None:
        metrics.watch_planner(lambda: planner.recommended)
    watch = RepositoryWatch(flags.model_repository, service, flags.max_model_len) if repository is not None else None
    adapter_sync = AdapterSync(registry, lambda: service.catalog) if repository is not None else None
    # Clients authenticate with API keys, not certificates: the client API asks for none.
    credentials = channels.server_credentials(client_auth=False)
    interceptors = [ApiKeyInterceptor(keys)] if keys is not None else []
    server = RoleServer("gateway", flags.address.host, flags.address.port, flags.grace_period, credentials,
                        interceptors, channels.limits, flags.address.advertise_host)
    server.add(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(service, flags.tools),
               gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name)
    app = traced_http(create_app(service, flags.requests, flags.tools))
    if keys is not None:
        app = ApiKeyMiddleware(app, keys, metrics_auth=flags.keys.metrics_auth == "on", rate_limits=service.rate_limits)
    https = channels.tls.uvicorn_kwargs() if channels.tls is not None else {}
    server.listen(HttpListener(app, flags.address.host, flags.http_port, https))

    async def load() -> None:
        registry.start()
        if discovery is not None:
            discovery.start()
        if planner is not None:
            planner.start()
        service.catalog = await asyncio.to_thread(_catalog, flags, repository)
        metrics.model_loaded(max(entry.model.max_model_len for entry in service.catalog.entries))
        if watch is not None:
            watch.start()
        if adapter_sync is not None:
            adapter_sync.start()
        # Ready means routable, so that workers and gateway can start together; requests sent
        # while a pool has no serving worker get UNAVAILABLE.
        if not await registry.wait_routable(flags.wait_for_workers):
            log.warning("no serving worker in some pool after %.0f s; ready anyway", flags.wait_for_workers)

    async def close() -> None:
        if watch is not None:
            await watch.stop()
        if adapter_sync is not None:
            await adapter_sync.stop()
        if discovery is not None:
            discovery.stop()
        if planner is not None:
            await planner.stop()
        await registry.close()

    return await server.run(load, close)


def _catalog(flags: GatewayFlags, repository: ModelRepository | None) -> ModelCatalog:
    """The models the gateway serves: the repository's every version, or --model alone."""
    from services.gateway.catalog import ModelCatalog
    from services.gateway.model import ServedModel

    if repository is not None:
        return ModelCatalog.load(repository, flags.max_model_len)
    model = ServedModel.load(flags.model, flags.max_model_len)
    if flags.tools.chat_template is not None:
        with open(flags.tools.chat_template, encoding="utf-8") as template:
            model = dataclasses.replace(model, tokenizer=model.tokenizer.with_chat_template(template.read()))
    return ModelCatalog.single(model)
