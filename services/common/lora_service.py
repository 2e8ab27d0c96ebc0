"""The LoraAdapters gRPC service (protobuf <-> engine types only), which every worker serves, whatever
its role: an adapter is read and checked off the engine's thread (it reads files), then served, or
stopped, on that thread between steps (services.common.engine_loop), so the engine's registry needs
no lock. The codes of its refusals are services.common.errors'."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from tandem.v1 import lora_pb2, lora_pb2_grpc

from engine.commands import AddAdapter, RemoveAdapter
from services.common.errors import abort_with
from services.common.server import RoleServer
from services.common.worker_rpcs import WorkerRpcs


class LoraAdaptersServicer(lora_pb2_grpc.LoraAdaptersServicer):
    """tandem.v1.LoraAdapters on the worker that `rpcs` (the role's own servicer) serves now."""

    def __init__(self, rpcs: WorkerRpcs) -> None:
        self._rpcs = rpcs

    async def LoadLoraAdapter(self, request: lora_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        worker = await self._rpcs.ready(context)
        try:
            if not request.path:
                raise ValueError(f"path: required (adapter {request.name!r})")
            adapter = await asyncio.to_thread(worker.loop.engine.read_adapter, request.name, Path(request.path))
            await worker.loop.call(AddAdapter(adapter))
        except Exception as exc:
            await abort_with(context, exc)
        return lora_pb2.LoraAdapterReply(fingerprint=adapter.fingerprint)

    async def UnloadLoraAdapter(self, request: lora_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext):
        worker = await self._rpcs.ready(context)
        try:
            await worker.loop.call(RemoveAdapter(request.name))
        except Exception as exc:
            await abort_with(context, exc)
        return lora_pb2.LoraAdapterReply()


def add_lora_service(server: RoleServer, rpcs: WorkerRpcs) -> None:
    """Serve tandem.v1.LoraAdapters on `server`, for the worker `rpcs` serves."""
    server.add(lora_pb2_grpc.add_LoraAdaptersServicer_to_server, LoraAdaptersServicer(rpcs),
               lora_pb2.DESCRIPTOR.services_by_name["LoraAdapters"].full_name)
