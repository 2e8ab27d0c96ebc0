"""The Prefill gRPC service (protobuf <-> engine types only), which prefill workers and colocated
workers serve, and the prefill worker's server."""

from __future__ import annotations

import asyncio

import grpc
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

from engine.resume import Resumed
from kvtransfer.descriptor import KVLayout, TransferTarget
from services.common.convert import (
    finish_reason_to_proto,
    kv_budget_from_proto,
    sampling_params_from_proto,
    token_logprob_to_proto,
)
from services.common.errors import abort_with
from services.common.failure import Failure, WorkerError
from services.common.lora_service import add_lora_service
from services.common.prefill_site import PrefillResult, sender_pool
from services.common.server import RoleServer
from services.common.startup_profile import profile_engine
from services.common.tls import warn_if_worker_exposed
from services.common.worker import RoleWorker, load_engine
from services.common.worker_config import WorkerConfig
from services.common.worker_metrics import WorkerMetrics
from services.common.worker_rpcs import WorkerRpcs
from services.observability.metrics import serve_metrics
from services.prefill.telemetry import record_prefill
from services.prefill.worker import PrefillWorker


class PrefillServicer(WorkerRpcs[RoleWorker], prefill_pb2_grpc.PrefillServicer):
    """tandem.v1.Prefill: Prefill, Abort, GetLoad, WatchLoad, on a worker with a prefill site (a
    prefill worker, or a colocated one beside its Decode service)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        worker = await self.ready(context)
        try:
            params = sampling_params_from_proto(request.sampling)
            if not request.HasField("kv_target"):
                raise ValueError("kv_target: must be set")
            try:
                target = TransferTarget.from_proto(request.kv_target)
            except ValueError as error:
                raise ValueError(f"kv_target.{error}") from None
            resumed = Resumed(tuple(request.output_token_ids)) if request.output_token_ids else None
            budget = (kv_budget_from_proto(request.kv_budget, target.layout.block_size)
                      if request.HasField("kv_budget") else None)
            if worker.prefill_site is None:
                raise WorkerError(Failure.UNAVAILABLE, f"{worker.worker_id} computes no prompt for other workers")
            await worker.loop.compile_grammar(params, context.time_remaining())
            await worker.loop.ready_adapter(params)
            result = await worker.inflight.run(
                request.request_id,
                worker.prefill_site.prefill(request.request_id, request.prompt_token_ids, params, target, resumed,
                                            budget, _lora_fingerprint(request, params.lora_name)),
            )
        except Exception as exc:
            await abort_with(context, exc)
        config = worker.loop.engine.config
        record_prefill(result, self.metrics.of_request(config, params.lora_name), config.parallel_sizes)
        return _response(result)


def _lora_fingerprint(request: prefill_pb2.PrefillRequest, lora_name: str) -> bytes:
    """The adapter fingerprint the decode worker runs the request under; ValueError naming the field
    unless it comes with an adapter's name, and only with one (without it, the check that keeps another
    adapter's pages from arriving could not be made)."""
    if bool(lora_name) != bool(request.lora_fingerprint):
        raise ValueError(f"lora_fingerprint: {'required with' if lora_name else 'set without'} sampling.lora_name"
                         + (f" ({lora_name!r})" if lora_name else ""))
    return request.lora_fingerprint


def _response(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    output = result.output
    response = prefill_pb2.PrefillResponse(
        first_token_id=output.new_token_ids[0],
        finish_reason=finish_reason_to_proto(output.finish_reason),
        cached_tokens=output.num_cached_tokens,
        queue_s=result.queue_s,
        compute_s=result.compute_s,
        kv_bytes=result.kv_bytes,
        kv_delivery_wait_s=result.delivery_wait_s,
    )
    if result.kept is not None:
        response.kept_blocks.extend(result.kept.indices)
        response.kept_scores.extend(result.kept.scores)
    if output.logprobs:
        response.first_logprob.CopyFrom(token_logprob_to_proto(output.logprobs[0]))
    return response


async def serve(config: WorkerConfig) -> int:
    """Run a prefill worker until SIGTERM/SIGINT; returns the exit code. Its server and its gRPC KV
    channels to decode workers use `config.channels`. Its advertised host (default: the host) is the
    address its ready line names and its torch_dist pairs listen on; without one given, a pair
    listens on the address that routes to its receiver. `kv_checksum` False (`--kv-checksum off`)
    sends pages without CRC32C to decode workers that are off too."""
    engine_config = config.served_engine
    warn_if_worker_exposed("prefill", config.host, config.channels.tls)
    server = RoleServer("prefill", config.host, config.port, config.grace_period,
                        config.channels.server_credentials(), limits=config.channels.limits,
                        advertise_host=config.advertise_host)
    metrics = WorkerMetrics(engine_config.served_name, engine_config.model_version)
    server.metrics_address = serve_metrics(metrics.registry, config.host, config.metrics_port)
    servicer = PrefillServicer(metrics)
    server.add(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer,
               prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
    add_lora_service(server, servicer)

    async def load() -> None:
        engine = await asyncio.to_thread(load_engine, engine_config)
        worker = PrefillWorker(server.address, engine, server.draining,
                               sender_pool(config, KVLayout.of_engine(engine)), config.kv_timeout,
                               on_fatal=server.fail)
        await asyncio.to_thread(profile_engine, engine, worker.loop.step_model)
        worker.loop.start()
        metrics.watch_engine(worker.loop)
        servicer.worker = worker

    async def close() -> None:
        if servicer.worker is not None:
            await servicer.worker.close()

    return await server.run(load, close)
