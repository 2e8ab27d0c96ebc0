"""What the prefill and decode workers share: the engine thread, the requests in flight and the load
they report. Transport-free: the gRPC side of it is `services.common.worker_rpcs`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.commands import GetStats
from engine.compose import build_engine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.formats import EngineFormats
from engine.kv_cache.block_hash import PROBE_TEXT, prompt_block_hashes
from engine.outputs import EngineStats
from kvtransfer.descriptor import KVLayout
from services.common.engine_loop import EngineLoop
from services.common.inflight import InflightRequests
from services.common.prefill_site import PrefillSite
from services.common.step_model import StepModel


def load_engine(config: EngineConfig) -> Engine:
    """The worker's engine. A model repository's version that does not load (a missing or unreadable
    file, weights whose shapes do not match their architecture) is named in the error, so that the
    worker's start-up failure says which entry of the repository to fix."""
    try:
        return build_engine(config)
    except (OSError, ValueError) as error:
        if not config.model_version:
            raise
        raise ValueError(f"model repository version {config.served_name}@{config.model_version} "
                         f"({config.model}) does not load: {error}") from error


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load now, as its load reports carry it."""

    worker_id: str
    role: str
    stats: EngineStats
    prefill_tokens_per_s: float  # recently measured (0 until measured)
    decode_step_s: float  # recently measured time per decode step (0 until measured)
    step_model: StepModel
    reserved_requests: int
    finished_requests: int
    kv_delivery_wait_s: float
    formats: EngineFormats  # what the engine computes in, fixed at its start-up
    tensor_parallel_size: int  # ranks the model is split across
    expert_parallel_size: int  # ranks its experts are split across whole (1: none)
    prefill_context_parallel_size: int  # processes a long prompt's prefill is split across (1: none)
    pipeline_parallel_size: int  # stage processes its layers are split across (1: none)
    model_name: str  # the served model's name
    model_version: str  # its version in the model repository ("" outside one)
    kv_layout: str  # what its KV pages mean (KVLayout.page_fingerprint)
    retiring_versions: tuple[str, ...] = ()  # NAME@VERSION still served after a hot swap (decode side)
    # What the gateway's exact prefix index needs besides the block events (LoadReport says more).
    block_hash_salt: bytes = b""  # the salt of its blocks' chain hashes
    probe_block_hashes: tuple[bytes, ...] = ()  # block_hash.PROBE_TEXT's, by its tokenizer and salt
    kv_load_s_per_block: dict[str, float] = field(default_factory=dict)  # per lower tier, measured
    host_tier_id: str = ""  # the shared host tier it is attached to ("" for none)
    kv_events_seq: int = 0  # block events reported so far


class RoleWorker:
    """One loaded engine serving one role (prefill, decode or colocated), as its handlers see it.
    `prefill_site` computes prompts for other workers (prefill and colocated; None: it does not)."""

    prefill_site: PrefillSite | None = None

    def __init__(self, role: str, address: str, loop: EngineLoop, draining: asyncio.Event) -> None:
        self.role = role
        self.worker_id = f"{role}@{address}"
        self.loop = loop
        self.formats = loop.engine.formats  # immutable: safe to read off the engine thread
        self.kv_layout = KVLayout.of_engine(loop.engine).page_fingerprint
        engine = loop.engine
        self.kv_events = engine.kv_events  # thread-safe: read by the load streams off the engine thread
        self.probe_block_hashes = tuple(prompt_block_hashes(engine.tokenizer.encode(PROBE_TEXT),
                                                            engine.kv.block_size, engine.fingerprint))
        self.draining = draining
        self.inflight = InflightRequests()

    @property
    def version_key(self) -> str:
        """NAME@VERSION of the model version its engine serves."""
        config = self.loop.engine.config
        return f"{config.served_name}@{config.model_version}"

    @property
    def reserved_requests(self) -> int:
        """Requests whose KV is reserved here and still arriving (only the decode role has any)."""
        return 0

    @property
    def kv_delivery_wait_s(self) -> float:
        """Recent wait for KV delivery after a first token of a prompt computed for another worker."""
        return 0.0 if self.prefill_site is None else self.prefill_site.delivery_wait_s

    async def load(self, retiring_versions: tuple[str, ...] = ()) -> WorkerLoad:
        """This worker's load now (the engine's stats are read on its thread, between steps), naming
        the `retiring_versions` its process still serves beside it."""
        stats = await self.loop.call(GetStats())
        rates = self.loop.rates
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            stats=stats,
            prefill_tokens_per_s=rates.prefill_tokens_per_s,
            decode_step_s=rates.decode_step_s,
            step_model=self.loop.step_model.model,
            reserved_requests=self.reserved_requests,
            finished_requests=self.inflight.finished,
            kv_delivery_wait_s=self.kv_delivery_wait_s,
            formats=self.formats,
            tensor_parallel_size=self.loop.engine.config.tensor_parallel_size,
            expert_parallel_size=self.loop.engine.config.parallel_sizes["expert_parallel_size"],
            prefill_context_parallel_size=self.loop.engine.config.prefill_context_parallel_size,
            pipeline_parallel_size=self.loop.engine.config.pipeline_parallel_size,
            model_name=self.loop.engine.config.served_name,
            model_version=self.loop.engine.config.model_version,
            kv_layout=self.kv_layout,
            retiring_versions=retiring_versions,
            block_hash_salt=self.loop.engine.fingerprint,
            probe_block_hashes=self.probe_block_hashes,
            kv_load_s_per_block=dict(self.kv_events.load_s_per_block()),
            host_tier_id=self.loop.engine.host_tier_id,
            kv_events_seq=self.kv_events.next_seq,
        )

    async def close(self) -> None:
        """Stop the engine thread (after the server drained), then the engine's other ranks."""
        await asyncio.to_thread(self.loop.stop)
        await asyncio.to_thread(self.loop.engine.close)
