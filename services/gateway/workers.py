"""One worker as the gateway sees it, kept current by streams from it.

Per worker the gateway holds one channel and two subscriptions: gRPC health Watch (is it
SERVING?) and WatchLoad (its latest LoadReport). Either stream breaking (worker down, draining,
not started yet) marks the worker unusable until a resubscription succeeds. Workers come from
static lists or are added and removed at run time (Kubernetes discovery); a removed worker gets
no new requests, finishes the streams it has, then its channel closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, lora_pb2, lora_pb2_grpc, prefill_pb2_grpc

from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from services.common.channels import PLAINTEXT, Channels
from services.common.chunk import Chunk
from services.common.convert import chunk_from_proto, sampling_params_to_proto, step_model_from_proto
from services.common.errors import status_error_from_rpc
from services.gateway.adapters import AdapterRef, WorkerAdapter, waits_for_slot
from services.gateway.router import Role, SloTargets, WorkerView
from services.gateway.tpot_slack import DecodeProgress

log = logging.getLogger(__name__)

_RESUBSCRIBE_S = 0.5
_LOAD_INTERVAL_MS = 200
# gRPC's default reconnect backoff grows to two minutes; a restarted worker should be seen in seconds.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class RemoteWorker:
    """One worker process as the gateway sees it over its channel: health, latest load, and what
    this gateway sent it since."""

    def __init__(self, address: str, role: Role, on_change: Callable[[], None] = lambda: None,
                 channels: Channels = PLAINTEXT,
                 on_report: Callable[[RemoteWorker, common_pb2.LoadReport | None], None] = lambda w, r: None) -> None:
        """`on_change` runs whenever its health or load changes (admission re-tries waiting requests);
        `channels` opens its channel (TLS, message sizes); `on_report` gets each report it takes (with
        its block events) and None when its reports stop (the stream broke, or one was refused): the
        next stream's first report starts its blocks afresh."""
        self.address = address
        self.role = role
        self.channel = channels.open(address, _RECONNECT_OPTIONS)
        stub_class = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        self.stub = stub_class(self.channel)
        self.lora_stub = lora_pb2_grpc.LoraAdaptersStub(self.channel)
        self.serving = False
        # The latest valid load report; None until one came (the worker is not routed to meanwhile).
        self.report: common_pb2.LoadReport | None = None
        # What this gateway sent here and the worker's reports may not show yet.
        self.pending_prompt_tokens = 0  # prompt tokens it must still compute for us, first token not yet back
        self.pending_context_tokens = 0  # context of the requests streaming from it
        self.prompt_tokens_sent = 0  # every prompt token it computed for us (the planner's arrival rate)
        self.decoding: set[DecodeProgress] = set()  # the requests this gateway streams from it (decode, colocated)
        self._on_change = on_change
        self._on_report = on_report
        self._refusing = False  # the latest report was refused
        self._tasks: list[asyncio.Task] = []

    @property
    def routable(self) -> bool:
        """Whether the router may send it requests: its health is SERVING and its load reports arrive."""
        return self.serving and self.report is not None

    @property
    def version_key(self) -> str | None:
        """NAME@VERSION of the model version its load reports name; None before its first report."""
        if self.report is None:
            return None
        return f"{self.report.model_name}@{self.report.model_version}"

    def offers(self, version_key: str | None) -> bool:
        """Whether it may serve a request routed for NAME@VERSION (None: any version): the version it
        serves, or one a hot swap in its process retires and still holds (LoadReport)."""
        return version_key is None or (self.report is not None and (
            version_key == self.version_key or version_key in self.report.retiring_versions))

    @property
    def adapters(self) -> tuple[WorkerAdapter, ...]:
        """The LoRA adapters its latest report says it serves."""
        if self.report is None:
            return ()
        return tuple(WorkerAdapter(a.name, a.fingerprint, a.path, a.in_slot, a.in_memory,
                                   a.running_requests + a.waiting_requests)
                     for a in self.report.lora_adapters)

    def adapter(self, ref: AdapterRef) -> WorkerAdapter | None:
        """Its state of the adapter `ref` names, if it serves that adapter (the same fingerprint)."""
        return next((a for a in self.adapters if a.name == ref.name and a.fingerprint == ref.fingerprint), None)

    def waits_for_slot(self, ref: AdapterRef) -> bool:
        """Whether a request for `ref` would wait here for a slot other adapters' requests hold
        (services.gateway.adapters.waits_for_slot)."""
        return self.report is not None and waits_for_slot(self.adapters, self.report.max_loras, ref.name)

    async def load_adapter(self, name: str, path: str, timeout: float) -> bytes:
        """Have it serve the adapter in `path` (as it sees the path) as `name`: the adapter's
        fingerprint; StatusError with the worker's code and reason when it does not."""
        try:
            reply = await self.lora_stub.LoadLoraAdapter(lora_pb2.LoadLoraAdapterRequest(name=name, path=path),
                                                         timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise status_error_from_rpc(error) from error
        return reply.fingerprint

    async def unload_adapter(self, name: str, timeout: float) -> None:
        """Have it stop serving `name`; StatusError with the worker's code and reason when it does not."""
        try:
            await self.lora_stub.UnloadLoraAdapter(lora_pb2.UnloadLoraAdapterRequest(name=name), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise status_error_from_rpc(error) from error

    @property
    def in_flight(self) -> int:
        """Requests this gateway is streaming from it."""
        return len(self.decoding)

    def start(self) -> None:
        """Subscribe to its health and load (on the running event loop)."""
        self._tasks = [asyncio.create_task(self._watch_health()), asyncio.create_task(self._watch_load())]

    async def close(self) -> None:
        """End the subscriptions and the channel."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    async def generate(
        self,
        request_id: str,
        worker_request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        prefill_address: str,
        timeout: float | None,
        resumed: Resumed | None = None,
        version_key: str | None = None,
        slo: SloTargets | None = None,
    ) -> AsyncIterator[Chunk]:
        """Decode or colocated role: run a request here with its prompt (and, `resumed`, the output
        its client already has) computed by `prefill_address` (empty: by this worker), yielding
        its chunks (labelled `request_id`), on the model version `version_key` (None: the one it
        serves), routed against the objectives `slo` (None: none, for the worker to count its TPOT
        against). The worker's refusal or failure is a StatusError with its gRPC code (and the prefill
        worker it blames, if any); leaving the stream early cancels the request on the worker."""
        call = self.stub.Generate(
            decode_pb2.DecodeRequest(
                request_id=worker_request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling_params_to_proto(sampling),
                prefill_address=prefill_address,
                output_token_ids=resumed.output_token_ids if resumed is not None else (),
                output_text_length=(resumed.text_length or 0) if resumed is not None else 0,
                model=version_key or "",
                slo=_slo_to_proto(slo) if slo is not None else None,
            ),
            timeout=timeout,
        )
        try:
            async for message in call:
                yield chunk_from_proto(message, request_id)
        except grpc.aio.AioRpcError as error:
            raise status_error_from_rpc(error) from error
        finally:
            # Cancels the worker's request when our client went away; a no-op once it ended.
            call.cancel()

    def view(self, idle: bool = False) -> WorkerView | None:
        """Its load for routing: the latest report, raised to what this gateway knows it sent since;
        None until it sent a valid report. With `idle`, the same worker with nothing queued or
        running (what it could do at best)."""
        report = self.report
        if report is None:
            return None
        # A decode worker given to the gateway as colocated computes its own prompts but serves no
        # Prefill for others: what it serves is the role it reports, not the pool it was listed in.
        prefills_for_others = report.role != "decode"
        if idle:
            return WorkerView(self.address, self.role, self.serving, free_kv_blocks=report.total_kv_blocks,
                              block_size=report.block_size, step_model=step_model_from_proto(report.step_model),
                              chunk_tokens=report.max_num_batched_tokens or 2048,
                              kv_delivery_wait_s=report.kv_delivery_wait_s, kv_layout=report.kv_layout,
                              prefills_for_others=prefills_for_others)
        reported = report.running_requests + report.waiting_requests + report.reserved_requests
        sequences = max(reported, self.in_flight)
        context_tokens = max(report.context_tokens, self.pending_context_tokens)
        step_model = step_model_from_proto(report.step_model)
        return WorkerView(
            address=self.address,
            role=self.role,
            serving=self.serving,
            queued_prompt_tokens=max(report.queued_prompt_tokens, self.pending_prompt_tokens),
            sequences=sequences,
            context_tokens=context_tokens,
            free_kv_blocks=report.free_kv_blocks,
            block_size=report.block_size,
            step_model=step_model,
            chunk_tokens=report.max_num_batched_tokens or 2048,
            kv_delivery_wait_s=report.kv_delivery_wait_s,
            tpot_slack_s=self._tpot_slack_s(reported, step_model.step_s(0, sequences, context_tokens)),
            kv_layout=report.kv_layout,
            prefills_for_others=prefills_for_others,
        )

    def _tpot_slack_s(self, reported_sequences: int, step_s: float) -> float:
        """The least stall any request decoding here can absorb (router.WorkerView.tpot_slack_s);
        0 when the worker runs requests this gateway does not stream (another gateway's), whose
        objectives and progress it cannot know."""
        if reported_sequences > self.in_flight:
            return 0.0
        now = time.monotonic()
        return min((progress.slack_s(step_s, now) for progress in self.decoding), default=math.inf)

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            log.info("%s worker %s is %s", self.role, self.address, "SERVING" if serving else "NOT serving")
            self.serving = serving
            self._on_change()

    async def _watch_health(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest(service="")):
                    self._set_serving(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError as error:
                log.debug("%s worker %s: health watch: %s: %s", self.role, self.address, error.code().name,
                          error.details())
            self._set_serving(False)
            await asyncio.sleep(_RESUBSCRIBE_S)

    def _receive(self, report: common_pb2.LoadReport) -> None:
        """Take a load report, or refuse one the router cannot use: without its block size the
        gateway cannot count the worker's KV room or its prefix blocks."""
        if report.block_size < 1:
            if not self._refusing:
                log.warning("%s worker %s: load report without block_size refused; not routing to it until "
                            "one carries it", self.role, self.address)
            self._refusing = True
            self.report = None
        else:
            if self._refusing:
                log.info("%s worker %s: load reports carry block_size again", self.role, self.address)
            self._refusing = False
            self.report = report
            self._on_report(self, report)
        self._on_change()

    async def _watch_load(self) -> None:
        request = common_pb2.WatchLoadRequest(interval_ms=_LOAD_INTERVAL_MS)
        while True:
            try:
                async for report in self.stub.WatchLoad(request):
                    self._receive(report)
            except grpc.aio.AioRpcError as error:
                log.debug("%s worker %s: load watch: %s: %s", self.role, self.address, error.code().name,
                          error.details())
            self.report = None
            self._on_report(self, None)
            await asyncio.sleep(_RESUBSCRIBE_S)


def _slo_to_proto(slo: SloTargets) -> common_pb2.Slo:
    """The objectives in whole milliseconds (at least 1: 0 would mean none)."""
    return common_pb2.Slo(ttft_ms=max(1, round(slo.ttft_s * 1000)), tpot_ms=max(1, round(slo.tpot_s * 1000)))
