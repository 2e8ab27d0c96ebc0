"""The engine: add_request / step / abort; its KV connector (engine.kv_connector) takes a prompt's KV
from elsewhere (reserve / import_kv / start_decode) or hands it on (an export, then release).

Each step is schedule -> execute -> postprocess (token-level stops in the scheduler, then
incremental detokenization and stop strings here).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_model import load_engine_model
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.cache_engine import bytes_per_block
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget, check_scores_for
from engine.kv_cache.kv_events import KVEvents
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.window import max_model_len
from engine.kv_connector.connector import KVConnector
from engine.kv_connector.export import KVExport
from engine.kv_connector.policy import DEFAULT_KV_WAIT_S, KVConnectorPolicy
from engine.kv_connector.tier_loading import LOAD_TIMEOUT_S
from engine.kv_connector.tier_mover import TierMover, open_tiers
from engine.kv_connector.worker_side import KVConnectorWorker
from engine.lora.adapter import LoraAdapter
from engine.lora.identity import request_fingerprint
from engine.lora.registry import LoraDisabled
from engine.lora.serving import ServedAdapters, serve_adapters
from engine.model.loader import ModelFiles
from engine.outputs import (
    EngineStats,
    KVReservation,
    NoKVRoom,
    RequestOutput,
    ReserveResult,
    StepTokens,
    TooLargeForKV,
)
from engine.parallel.adapter_shard import adapter_shard
from engine.parallel.context_parallel import ContextParallelPrefill
from engine.parallel.group import TensorParallelGroup
from engine.parallel.kv_heads import kv_head_ranges
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.pipeline import PipelineStages
from engine.parallel.pipeline_layout import PipelineLayout
from engine.request import FinishReason, Request
from engine.resume import Resumed, check_resumable, replay_text
from engine.runner import BlockScoring, ModelRunner, SampledToken
from engine.sampler import Sampler, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative.calibration import calibrate
from engine.speculative.drafter import Drafter
from engine.speculative.gate import DraftGate
from engine.speculative.proposer import Proposer
from engine.stop_strings import StopStringMatcher
from engine.structured.grammars import Grammars
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher


class Engine:
    """One model, one paged KV cache, one scheduler: the runtime every pool shares."""

    def __init__(self, config: EngineConfig, files: ModelFiles | None = None, proposer: Proposer | None = None) -> None:
        """Load the model (or use already loaded `files`, so tests and benchmarks load it once; they
        are converted to the engine's dtype). `proposer` drafts for speculative decoding, which
        `config.speculative` asks for and engine.compose builds. ValueError naming the field for a
        format this engine has no kernel for (on this device), or a combination of formats that cannot run."""
        spec = config.speculative
        if (spec is None) != (proposer is None):
            raise ValueError("speculative: a proposer goes with --speculative-config, and only with it "
                             "(engine.compose.build_engine builds the one it names)")
        self.config = config
        self.device = torch.device(config.device)
        size = config.tensor_parallel_size
        layout = TensorParallelLayout.of(config, 0)
        pipeline = PipelineLayout(config.pipeline_parallel_size, 0)
        if files is not None:  # a size the model cannot take is refused before any rank starts
            layout.check(files.config)
            pipeline.check(files.config)
        # The other ranks of a tensor- or context-parallel engine start loading beside this one (engine.parallel).
        self._parallel = TensorParallelGroup(config) if config.world_size > 1 else None
        tensor_parallel = self._parallel if size > 1 else None
        # The other ranks run what rank 0 sends in the order it sends it: a step (its plan and every
        # collective of its forward pass) and a move of pages from another thread never interleave.
        self._ranks_busy: contextlib.AbstractContextManager = (
            threading.Lock() if config.world_size > 1 else contextlib.nullcontext())
        try:
            loaded = load_engine_model(config, files, layout,
                                       None if tensor_parallel is None else tensor_parallel.tensor_group, self.device,
                                       pipeline)
            if self._parallel is not None:
                self._parallel.ready(loaded.config)
        except BaseException:
            if self._parallel is not None:
                self._parallel.close(ready=False)
            raise
        self.kv_format = loaded.kv_format
        self.formats = loaded.formats
        log.info("engine formats: %s", self.formats.describe())
        if self.formats.warning is not None:
            log.warning("%s", self.formats.warning)
        self.model_config = loaded.config
        self.tokenizer = Tokenizer.from_path(loaded.source)
        self.max_model_len = max_model_len(config, loaded.config, loaded.window)
        num_blocks, block_size = loaded.cache.num_blocks, config.cache.block_size
        # The weight format is part of the model: KV computed with other weights is neither reused nor
        # accepted. So is the KV format: a block's hash names its pages, and pages of another format
        # (int4 codes against bf16 values) are other bytes for the same tokens.
        weights = f"{loaded.dtype}|{loaded.quantization}|{self.formats.activation_quantization}"
        # So is the window it was computed under (the config names a model's own; this, the serving option's sinks).
        window = "" if loaded.window is None else loaded.window.policy
        kv = f"{self.kv_format.name}|{window}"
        self.fingerprint = hashlib.sha256(f"{loaded.config!r}|{weights}|{kv}".encode()).digest()
        self.window = loaded.window
        # Every KV tier's block events, which the worker's load reports carry to the gateway's exact index.
        self.kv_events = KVEvents()
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, salt=self.fingerprint,
                                 events=self.kv_events, window=loaded.window, budget=loaded.budget)
        eos = set(self.tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids)
        sampler = Sampler(loaded.config.vocab_size, sorted(eos))
        context, stages = None, None
        if self._parallel is not None and config.prefill_context_parallel_size > 1:
            context = ContextParallelPrefill(loaded.model, self._parallel.group, self._parallel.send,
                                             config.prefill_context_parallel_size,
                                             config.prefill_context_parallel_min_tokens)
        if self._parallel is not None and pipeline.size > 1:
            stages = PipelineStages(loaded, pipeline, size, self._parallel.group, self._parallel.send)
        # Every step's plan goes to tensor-parallel ranks and to pipeline stages.
        plans = None if self._parallel is None or context is not None else self._parallel.send
        scoring = None if loaded.scored is None or loaded.budget is None else BlockScoring(
            loaded.scored, loaded.budget, self.kv.add_scores)
        # LoRA adapters over the base (None without --enable-lora): the runner's slots, the scheduler's registry.
        try:
            self.adapters = serve_adapters(config, loaded.model, loaded.config, loaded.dtype,
                                           adapter_shard(layout, loaded.config))
        except BaseException:  # a start-up adapter not served: the other ranks, in their loop, stop too
            if self._parallel is not None:
                self._parallel.close()
            raise
        self.runner = ModelRunner(loaded.model, loaded.cache, sampler, self.device, plans, context, stages, scoring,
                                  None if self.adapters is None else self.adapters.slots)
        page = self.kv_format.page_shape(block_size, loaded.config.num_kv_heads, loaded.config.head_dim)
        policy = KVConnectorPolicy.of(config)
        self.connector = KVConnector(policy, KVConnectorWorker(
            loaded.cache, tuple(page), block_size, loaded.config.num_layers, tensor_parallel, self._ranks_busy,
            stages))
        block_bytes = bytes_per_block(loaded.config, block_size, self.kv_format)
        self.tiers = open_tiers(config.kv_tiers, loaded.cache, block_bytes, self.kv_events, self.connector.write_pages)
        if self.tiers is not None:
            self.kv.track_new_cached()
        self.scheduler = Scheduler(config.scheduler, self.kv, eos_token_ids=eos, connector=self.connector.scheduler,
                                   tier_loads=self.tiers,
                                   adapters=None if self.adapters is None else self.adapters.registry)
        self._text: dict[str, _TextState] = {}
        self.last_step_tokens = StepTokens()
        self._drafter = None if spec is None or proposer is None else Drafter(spec, proposer, self._draft_gate())
        log.info("engine ready: %s, KV connector: %s, %s, %d KV blocks of %d tokens%s, kv_cache=%s, attention=%s",
                 loaded.config.name, policy.describe(),
                 ", ".join(f"{name}={value}" for name, value in config.parallel_sizes.items()), num_blocks,
                 block_size, " on each rank" if size > 1 else "", self.kv_format.name, loaded.attention)

    def _draft_gate(self) -> DraftGate | None:
        """The gate on verification costs timed now, on this CPU (None with `gate: "off"`)."""
        spec = self.config.speculative
        if spec is None or spec.gate == "off":
            return None
        costs = calibrate(self.scheduler, self.runner, self.model_config.vocab_size, self.max_model_len,
                          spec.num_speculative_tokens, spec.disable_by_batch_size)
        log.info("speculation gate on steps timed now: %s", costs.describe())
        return DraftGate(costs, self.scheduler.spec_stats)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    resumed: Resumed | None = None, export: KVExport | None = None) -> NoKVRoom | None:
        """Queue a request; ValueError naming the field if it cannot be served. With `resumed`, the
        request continues after output another engine already delivered (see engine.resume). With
        `export`, each layer's pages go to its sink as soon as the layer wrote them, and the request
        hands off: it ends at its first token (finish_reason "handoff") and keeps its blocks until
        `release` (engine.kv_connector.policy bounds how long); without, it decodes here (unless this
        engine decodes nothing: role prefill). An engine that decodes admits an export at once with
        every block it needs, or refuses it (NoKVRoom, nothing kept) instead of queueing it behind
        blocks its own reservations hold (engine.scheduler.Scheduler.admit_export)."""
        request = self._new_request(request_id, prompt_token_ids, params, resumed,
                                    None if export is None else export.adapter_fingerprint)
        too_large = self._too_large(request, computed_here=True)
        if too_large is not None:
            raise ValueError(str(too_large))
        if export is not None and export.budget is not None:
            check_scores_for(self.kv.budget, export.budget)
            if export.receiver_cached_tokens:
                raise ValueError("kv_target.num_cached_tokens: must be 0 under kv_budget (the kept blocks all ship)")
        text = self._text_state(params, resumed)
        if export is None or not self.connector.scheduler.policy.decodes:
            self.scheduler.add(request)
        elif not self.scheduler.admit_export(request):
            return NoKVRoom(self._blocks_needed(request), self.kv.num_free_blocks)
        self._text[request_id] = text
        if export is not None:
            self.connector.worker.add_export(request_id, export, request.num_tokens)
            self.connector.scheduler.hand_off(request_id)
        if resumed is not None:
            self.runner.resume_generator(request_id, params.seed, draws=len(resumed.output_token_ids))
        return None

    def _new_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     resumed: Resumed | None, expected_adapter: bytes | None = None) -> Request:
        if not request_id:
            raise ValueError("request_id: must not be empty")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt)} tokens leave no room to generate within the model's context "
                f"of {self.max_model_len} tokens (max_model_len)"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {params.max_tokens} plus the prompt's {len(prompt)} tokens exceeds the model's "
                f"context of {self.max_model_len} tokens (max_model_len; at most {self.max_model_len - len(prompt)})"
            )
        for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("prediction", params.prediction)):
            outside = next((t for t in ids if not 0 <= t < vocab), None)
            if outside is not None:
                raise ValueError(f"{field}: token id {outside} is outside the vocabulary [0, {vocab})")
        output = list(check_resumable(resumed, params.max_tokens, vocab)) if resumed is not None else []
        request = Request(request_id, prompt, params, self.max_model_len, token_ids=prompt + output)
        request.adapter_fingerprint = request_fingerprint(None if self.adapters is None else self.adapters.registry,
                                                          params.lora_name, expected_adapter)
        if params.structured is not None:
            request.grammar = self.grammars.state(params.structured, output)
        return request

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured outputs' grammars against this model's tokenizer, built on first use (a
        handler thread's `compile` or a constrained request)."""
        return Grammars(self.tokenizer.backend_json(), self.model_config.vocab_size,
                        sorted(self.scheduler.eos_token_ids), config=self.config.structured_outputs)

    def _blocks_needed(self, request: Request, computed_here: bool = False) -> int:
        """Blocks for every known token plus the next one's slot; for a request `computed_here` (not
        reserved: a reservation takes every page at once) under a sliding window with chunked
        prefill, the most it holds at once (its blocks outside the window are freed as it goes)."""
        needed = blocks_for(request.num_tokens + 1, self.kv.block_size)
        if self.window is None or not computed_here or not self.config.scheduler.enable_chunked_prefill:
            return needed
        chunk = self.config.scheduler.max_num_batched_tokens
        return min(needed, self.window.max_held_blocks(self.kv.block_size, chunk))

    def _too_large(self, request: Request, computed_here: bool = False) -> TooLargeForKV | None:
        needed = self._blocks_needed(request, computed_here)
        if needed <= self.kv.num_blocks:
            return None
        return TooLargeForKV(request.num_prompt_tokens, needed, self.kv.num_blocks)

    def _text_state(self, params: SamplingParams, resumed: Resumed | None) -> _TextState:
        text = _TextState(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                          StopStringMatcher(params.stop))
        if resumed is not None:
            replay_text(text.detokenizer, text.stop, resumed)
        return text

    def abort(self, request_id: str) -> bool:
        """Abort a request at any point of its life; frees its blocks. False if unknown."""
        known = request_id in self.scheduler.requests
        self.scheduler.abort([request_id])
        self._forget(request_id)
        return known

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (or loading its prefix from a lower tier), or
        a deadline of the KV connector has passed (the next step frees what it held)."""
        return self.scheduler.has_work() or self.connector.scheduler.is_due()

    def next_kv_deadline(self) -> float | None:
        """When (time.monotonic()) the KV connector's next deadline passes: a step after it frees the
        blocks of a reservation whose KV never came or of a hand-off never released. None if none."""
        return self.connector.scheduler.next_deadline()

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that gained a token or finished.

        As soon as a layer has written this step's KV, the pages of every exported request go to
        its sink, so pages leave while later layers compute. First, the requests whose KV
        connector deadline passed are aborted and their blocks freed.
        """
        for request_id in self.scheduler.expire():
            log.warning("request %s: aborted, its KV connector deadline passed", request_id)
            self._forget(request_id)
        if self._drafter is not None:
            self._drafter.draft(self.scheduler.running)
        out = self.scheduler.schedule()
        # A decode chunk computes its request's last token (and any drafts after it); draft rows
        # count as prompt-like tokens, which is what they cost.
        decoding = [c for c in out.chunks
                    if c.num_tokens - len(c.draft_token_ids) == 1 and c.start >= c.request.num_prompt_tokens]
        draft_rows = sum(len(c.draft_token_ids) for c in decoding)
        on_layer_done, exported = self.connector.worker.step_exports(out.chunks, self.kv.block_table)
        loading = self._tier_loads(out)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        before_layer = None
        if loading and self.tiers is not None:
            # Only a step with a lower tier's load in it waits, before each layer's attention, for its pages.
            before_layer = functools.partial(self.tiers.wait_for_layer, list(loading.values()), deadline)
        started = time.perf_counter()
        with self._ranks_busy:
            sampled = self.runner.execute(out, on_layer_done, exported, before_layer)
        if loading and self.tiers is not None:
            self._end_tier_loads(self.tiers, out, sampled, loading, deadline)
        if self._drafter is not None and decoding and len(decoding) == len(out.chunks):
            self._drafter.observe(len(decoding), draft_rows, time.perf_counter() - started)
        before = {c.request.request_id: c.request.num_output_tokens for c in out.chunks}
        self.scheduler.update(out, {rid: [token for token, _ in tokens] for rid, tokens in sampled.items()})
        # A prompt exported under a budget is scored now: its kept blocks go (a kept hand-off holds them).
        self.connector.worker.ship_kept([rid for rid in sampled if self.kv.has_request(rid)], self._kept_blocks)
        if self.tiers is not None:
            self.tiers.store(self.kv.take_new_cached())
        outputs = []
        for chunk in out.chunks:
            request = chunk.request
            results = sampled.get(request.request_id)
            if results is not None:
                outputs.append(self._postprocess(request, results[: request.num_output_tokens
                                                                   - before[request.request_id]]))
        decoding_ids = {c.request.request_id for c in decoding}
        self.last_step_tokens = StepTokens(
            prefill=out.num_tokens - len(decoding), decode=len(decoding),
            decode_context=sum(c.start + 1 for c in decoding), draft=draft_rows,
            decode_tokens=sum(len(o.new_token_ids) for o in outputs if o.request_id in decoding_ids))
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        return outputs

    def _kept_blocks(self, request_id: str, budget: KVBudget) -> tuple[KeptBlocks, list[int]]:
        """The blocks a request whose prompt was just computed keeps under `budget`, and their ids."""
        return self.kv.kept(request_id, budget, self.scheduler.requests[request_id].num_computed_tokens)

    @property
    def host_tier_id(self) -> str:
        """The node's host tier this engine's blocks go to (any engine attached to it can load them),
        as its owner last answered; "" for none."""
        return "" if self.tiers is None else self.tiers.tiers.host_tier_id

    def _tier_loads(self, out: SchedulerOutput) -> dict[str, int]:
        """The step's requests whose prefix loads from a lower tier as it runs: request id -> ticket."""
        loading = self.scheduler.tier_loading
        if loading is None or not loading.tickets:
            return {}
        return {c.request.request_id: loading.tickets[c.request.request_id] for c in out.chunks
                if c.request.request_id in loading.tickets}

    def _end_tier_loads(self, tiers: TierMover, out: SchedulerOutput, sampled: dict[str, list[SampledToken]],
                        loading: dict[str, int], deadline: float) -> None:
        """After the step's forward: a load that wrote every layer joins the prefix cache; a failed
        one's request loses what the step computed for it (over pages that never came) and is
        rewound to recompute, before the scheduler's update could hash any of its blocks."""
        for request_id, ticket in loading.items():
            chunk = next(c for c in out.chunks if c.request.request_id == request_id)
            if tiers.finish(ticket, deadline):
                self.scheduler.tier_loaded(chunk.request)
                continue
            log.warning("request %s: its prefix did not load from the lower KV tiers; recomputing it", request_id)
            out.chunks.remove(chunk)
            sampled.pop(request_id, None)
            self.scheduler.rewind(request_id)
            self.runner.forget(request_id)  # a seeded request draws again from its seed

    def _postprocess(self, request: Request, results: Sequence[SampledToken]) -> RequestOutput:
        """Detokenize the step's new tokens (those the scheduler kept) one by one, as one-token steps
        would, ending the request at a stop string even inside a run of accepted drafts."""
        text = self._text[request.request_id]
        new_text = ""
        for index, (token, _) in enumerate(results):
            piece, stopped = text.stop.feed(text.detokenizer.push(token))
            new_text += piece
            if stopped:
                if index < len(results) - 1:
                    dropped = len(results) - index - 1
                    self.scheduler.stop_inside_run(request.request_id, request.num_output_tokens - dropped)
                    results = results[: index + 1]
                elif not request.is_finished:
                    self.scheduler.finish(request.request_id, FinishReason.STOP)
                break
        else:
            if request.is_finished:
                new_text += text.stop.feed(text.detokenizer.flush())[0] + text.stop.flush()
        logprobs = tuple(lp for _, lp in results if lp is not None)
        return self._output(request, tuple(token for token, _ in results), new_text, logprobs)

    def _output(
        self, request: Request, tokens: tuple[int, ...], text: str, logprobs: tuple[TokenLogprobs, ...]
    ) -> RequestOutput:
        reason = request.finish_reason
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=request.is_finished,
            finish_reason=reason.value if reason is not None else None,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            # A resumed request's prefix hit may reach into its output; usage counts prompt tokens.
            num_cached_tokens=min(request.num_cached_tokens, request.num_prompt_tokens),
            num_output_tokens=request.num_output_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def _forget(self, request_id: str) -> None:
        self._text.pop(request_id, None)
        self.connector.worker.drop_export(request_id)
        self.runner.forget(request_id)

    # ---- the KV connector: hand-off and reservations ------------------------------------------------
    def release(self, request_id: str) -> None:
        """Free the blocks a request kept for its hand-off once its KV was delivered; full blocks stay
        in the prefix cache."""
        self.scheduler.release(request_id)
        self._forget(request_id)

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                resumed: Resumed | None = None, kv_timeout_s: float = DEFAULT_KV_WAIT_S) -> ReserveResult:
        """Reserve blocks for an incoming prompt's KV (with `resumed`, for the prompt and the output
        already delivered: the sender computes both): the reservation, or why the cache cannot take it
        (now, or ever). After `kv_timeout_s` without `start_decode`, a step aborts the request and
        frees its blocks. ValueError naming the field for bad input."""
        request = self._new_request(request_id, prompt_token_ids, params, resumed)
        too_large = self._too_large(request)
        if too_large is not None:
            return too_large
        text = self._text_state(params, resumed)
        ticket = self.scheduler.reserve(request, kv_timeout_s)
        if ticket is None:
            return NoKVRoom(self._blocks_needed(request), self.kv.num_free_blocks)
        self._text[request_id] = text
        # The sender skips the head this engine has: its prefix-cache hit, or what its window hides.
        # (Under a budget neither: only the blocks the sender picks arrive.)
        budget = self.kv.budget
        unsent = 0 if budget is not None else max(request.num_cached_tokens,
                                                  self.kv.hidden_head(request.num_tokens) * self.kv.block_size)
        return KVReservation(request_id, tuple(self.kv.block_table(request_id)), unsent, self.kv.block_size, ticket,
                             budget, request.adapter_fingerprint)

    def import_kv(self, reservation: KVReservation, layer: int, block_ids: Sequence[int],
                  k: torch.Tensor, v: torch.Tensor) -> None:
        """Write received KV blocks of one layer (pages of all the model's KV heads) into a live
        reservation's blocks, on any thread (engine.kv_connector.connector: KeyError once the
        reservation ended)."""
        self.connector.import_pages(reservation, layer, block_ids, k, v)

    def start_decode(self, request_id: str, first_token: int, kept: KeptBlocks | None = None) -> RequestOutput:
        """The prompt's KV is complete: join the running batch after the sender's first token (for a
        resumed request, the first token after the output already delivered). Under a KV budget
        `kept` says where the blocks that arrived go (the sender picked them). TimeoutError if the
        reservation's deadline passed first; ValueError naming kept_blocks if `kept` does not fit."""
        request = self.scheduler.start_reserved(request_id, first_token, kept)
        # Every token sampled so far (the prefill side's included) drew once from a seeded generator.
        self.runner.resume_generator(request_id, request.params.seed, draws=request.num_output_tokens)
        output = self._postprocess(request, [(first_token, None)])
        if output.finished:
            self._forget(request_id)
        return output

    # ---- LoRA adapters (engine.lora) -------------------------------------------------------------
    def read_adapter(self, name: str, path: Path) -> LoraAdapter:
        """The adapter in directory `path`, read and checked to serve as `name`, on any thread (it
        touches no engine state, so a worker reads files off the engine's thread; `add_adapter`
        serves it). AdapterError or ValueError naming it if it cannot be served."""
        return self._served_adapters().read(name, path)

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` under its name from the next step; ValueError naming it if the name is taken,
        AdaptersBusy while every adapter held in memory has requests (--max-cpu-loras)."""
        self._served_adapters().registry.serve(adapter)

    def keep_adapter(self, adapter: LoraAdapter) -> None:
        """Keep `adapter`, dropped from memory and read again off the engine thread (KeepAdapter)."""
        self._served_adapters().registry.keep(adapter)

    def needs_read(self, name: str) -> Path | None:
        """Where to read the adapter `name` from when a request for it would make the engine read it
        (served, but dropped from memory); None otherwise. Any thread may ask: it only looks."""
        if self.adapters is None or not name:
            return None
        registry = self.adapters.registry
        served = registry.known.get(name)
        return None if served is None or registry.in_memory(name) else served.path

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name`: UnknownAdapter if not served, AdapterInUse while requests use it."""
        self._served_adapters().registry.remove(name)

    def _served_adapters(self) -> ServedAdapters:
        if self.adapters is None:
            raise LoraDisabled(f"lora: model {self.config.served_name} is served without adapters (--enable-lora)")
        return self.adapters

    @property
    def kv_head_ranges(self) -> list[range]:
        """The KV heads each tensor-parallel rank's cache holds, in rank order."""
        return kv_head_ranges(self.model_config, self.config.tensor_parallel_size)

    def lost_rank(self) -> str | None:
        """Which other rank of a tensor-parallel engine has exited, if one has: the engine cannot
        compute without it."""
        return None if self._parallel is None else self._parallel.lost_rank()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine and the lower tiers' mover."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self._parallel is not None:
            self._parallel.close()
            self._parallel = None

    # ---- load ------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Current load: queue, batch and KV cache occupancy."""
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_waiting_tokens=self.scheduler.num_waiting_tokens,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            num_cached_blocks=self.kv.num_cached_blocks,
            kv_usage=self.kv.usage,
            block_size=self.kv.block_size,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            num_context_tokens=sum(request.num_tokens for request in self.scheduler.running),
            spec_decode=self.scheduler.spec_stats.snapshot() if self.config.speculative is not None else None,
            num_preemptions=self.scheduler.total_preemptions,
            kv_budget_steps=dict(self.runner.budget_steps),
            **self._tier_stats(),
            **({} if self.adapters is None else self.adapters.stats(self.scheduler)),
        )

    def _tier_stats(self) -> dict[str, Any]:
        loading = self.scheduler.tier_loading
        if self.tiers is None or loading is None:
            return {}
        return {"kv_tiers": self.tiers.tiers.stats(), "external_prefix_cache_queries": loading.queried_tokens,
                "external_prefix_cache_hits": loading.hit_tokens, "kv_tier_dropped_blocks": self.tiers.dropped_blocks,
                "kv_tier_load_wait_s": self.tiers.wait_s, "kv_tier_first_layer_wait_s": self.tiers.first_layer_wait_s}

