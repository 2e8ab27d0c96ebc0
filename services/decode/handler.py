"""The Decode gRPC service (protobuf <-> engine types only) and the decode worker's server."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from tandem.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import split_address
from kvtransfer.grpc_stream import KVTransferServicer
from kvtransfer.receiver import make_receiver
from services.common.channels import Channels
from services.common.convert import sampling_params_from_proto, token_chunk
from services.common.errors import abort_with
from services.common.lora_service import add_lora_service
from services.common.prefill_site import sender_pool
from services.common.server import RoleServer
from services.common.tls import warn_if_worker_exposed
from services.common.worker import load_engine
from services.common.worker_config import WorkerConfig
from services.common.worker_metrics import WorkerMetrics
from services.common.worker_rpcs import WorkerRpcs, loaded
from services.decode.model_swap import ModelSwap
from services.decode.prefill_client import PrefillClients
from services.decode.served_engines import ServedEngines
from services.decode.telemetry import DecodeRecorder
from services.decode.worker import DecodeWorker
from services.observability.metrics import serve_metrics
from services.prefill.handler import PrefillServicer


class DecodeServicer(WorkerRpcs[DecodeWorker], decode_pb2_grpc.DecodeServicer):
    """tandem.v1.Decode: Generate, Abort, GetLoad, WatchLoad."""

    def __init__(self, metrics: WorkerMetrics, channels: Channels, prefill: PrefillServicer | None = None) -> None:
        """`prefill`: the process's Prefill service (a colocated worker's), which reaches the same workers."""
        self.prefills = PrefillClients(channels)
        self.metrics = metrics
        self.engines = ServedEngines(self, metrics, () if prefill is None else (prefill,))

    async def Generate(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        arrived_at = time.perf_counter()
        await self.ready(context)
        try:
            worker = self.engines.serving(request.model)
            params = sampling_params_from_proto(request.sampling)
            if request.prefill_address:
                # Malformed, it is bad input here rather than a failed name lookup later.
                split_address(request.prefill_address, "prefill_address")
            resumed = _resumed(request)
            await worker.loop.compile_grammar(params, context.time_remaining())
            await worker.loop.ready_adapter(params)
            request_id = request.request_id or uuid.uuid4().hex
            config = worker.loop.engine.config
            recorder = DecodeRecorder(self.metrics.of_request(config, params.lora_name), arrived_at,
                                      len(request.output_token_ids), config.parallel_sizes,
                                      request.slo.tpot_ms / 1000 if request.slo.tpot_ms else None)
            await worker.inflight.run(request_id, self._stream(worker, request_id, request, params, resumed, context,
                                                               recorder))
        except Exception as exc:
            await abort_with(context, exc)
        # The chunks go out through context.write (from the request's own task, which Abort can
        # cancel), yet Generate must be an async generator: that is how the OpenTelemetry server
        # interceptor serves every response-streaming handler.
        return
        yield

    async def _stream(
        self,
        worker: DecodeWorker,
        request_id: str,
        request: decode_pb2.DecodeRequest,
        params: SamplingParams,
        resumed: Resumed | None,
        context: grpc.aio.ServicerContext,
        recorder: DecodeRecorder,
    ) -> None:
        progress = recorder.progress
        # A retiring version's prompt is computed here: the gateway pairs prefill workers with this
        # worker's current version only.
        if request.prefill_address and worker is self.worker:
            prefill = self.prefills.peer(request.prefill_address)
            outputs = worker.generate(request_id, request.prompt_token_ids, params, prefill, progress, resumed)
        else:
            outputs = worker.generate_local(request_id, request.prompt_token_ids, params, progress, resumed)
        try:
            # aclosing: leaving early (client gone, Abort) runs the request's cleanup before this returns.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    recorder.output(output, time.perf_counter())
                    generated_here = output.num_output_tokens - progress.resumed_tokens
                    timings = progress.timings(generated_here) if output.finished else None
                    await context.write(token_chunk(output, timings))
        except Exception as error:
            recorder.failed(error)
            raise
        finally:
            recorder.trace()


def _resumed(request: decode_pb2.DecodeRequest) -> Resumed | None:
    """A resumed request's delivered output (None for a new request)."""
    if not request.output_token_ids:
        return None
    return Resumed(tuple(request.output_token_ids), request.output_text_length)


class LateKVTransfer(kvtransfer_pb2_grpc.KVTransferServicer):
    """tandem.v1.KVTransfer, registered before the model loads (a started server takes no new
    services) and served by kvtransfer's servicer once the layout is known."""

    def __init__(self) -> None:
        self.servicer: KVTransferServicer | None = None

    async def Handshake(self, request: kvtransfer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext):
        return await (await loaded(self.servicer, context)).Handshake(request, context)

    async def Push(self, request_iterator, context: grpc.aio.ServicerContext):
        return await (await loaded(self.servicer, context)).Push(request_iterator, context)


async def serve(config: WorkerConfig) -> int:
    """Run a decode (or colocated: `config.engine.role`) worker until SIGTERM/SIGINT; returns the exit
    code. Prefill workers reach its gRPC KV receiver at its advertised host (the server may listen on
    a wildcard address). Its server and its channels to prefill workers use `config.channels`.
    `kv_checksum` False (`--kv-checksum off`) takes pages without CRC32C from prefill workers that
    are off too; True requires it on every page. With `swap`, the worker follows its pool's version
    in the repository file, loading each version beside the serving one (services.decode.model_swap).
    A colocated worker also serves tandem.v1.Prefill: it computes prompts for other workers too."""
    engine_config = config.served_engine
    role = engine_config.role
    advertise_host = config.advertise_host or config.host
    kv_host = config.kv_host or advertise_host
    warn_if_worker_exposed(role, config.host, config.channels.tls)
    server = RoleServer(role, config.host, config.port, config.grace_period, config.channels.server_credentials(),
                        limits=config.channels.limits, advertise_host=advertise_host)
    metrics = WorkerMetrics(engine_config.served_name, engine_config.model_version)
    server.metrics_address = serve_metrics(metrics.registry, config.host, config.metrics_port)
    prefill = PrefillServicer(metrics) if role == "colocated" else None
    servicer = DecodeServicer(metrics, config.channels, prefill)
    kv_transfer = LateKVTransfer()
    swaps: list[ModelSwap] = []
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, servicer,
               decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name)
    if prefill is not None:
        server.add(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill,
                   prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
    server.add(kvtransfer_pb2_grpc.add_KVTransferServicer_to_server, kv_transfer,
               kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)
    add_lora_service(server, servicer)

    async def load() -> None:
        engine = await asyncio.to_thread(load_engine, engine_config)
        advertised = f"{advertise_host}:{server.port}"
        receiver = make_receiver(config.kv_backend, kv_host, advertised, timeout=config.kv_timeout,
                                 device=engine_config.device, checksum=config.kv_checksum)
        worker = DecodeWorker(server.address, engine, server.draining, receiver, config.kv_timeout,
                              on_fatal=server.fail,
                              senders=None if prefill is None else lambda layout: sender_pool(config, layout))
        await servicer.engines.start(worker)
        kv_transfer.servicer = servicer.engines.kv_transfer = KVTransferServicer(
            worker.layout, receiver if config.kv_backend == "grpc" else None)
        servicer.engines.promote(worker)
        if config.swap is not None:
            swaps.append(ModelSwap(config.swap, servicer.engines, config.engine))
            swaps[0].start()

    async def close() -> None:
        for model_swap in swaps:
            await model_swap.stop()
        await servicer.engines.close()
        await servicer.prefills.close()

    return await server.run(load, close)
