"""The only code that turns scheduled work into tensors and runs the model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.scored import ScoredAttention
from engine.kv_cache.cache_engine import CacheEngine
from engine.kv_cache.kv_budget import KVBudget
from engine.lora.batch import NO_LORA, LoraBatch
from engine.lora.slots import LoraSlots
from engine.model.llama import LlamaForCausalLM
from engine.parallel.context_parallel import ContextParallelPrefill
from engine.parallel.pipeline import PipelineStages
from engine.parallel.step_plan import StepPlan
from engine.sampler import Sampler, SamplingRequestState, TokenLogprobs
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.speculative.verify import num_accepted

SampledToken = tuple[int, TokenLogprobs | None]


@dataclass(frozen=True)
class BlockScoring:
    """Under a KV budget: the attention that scores held blocks, the budget that says which
    queries score, and where each step's mass goes: (request id, table indices, masses)."""

    attention: ScoredAttention
    budget: KVBudget
    record: Callable[[str, Sequence[int], Sequence[float]], None]


class ModelRunner:
    """Owns the model, the KV cache tensors, the sampler and each seeded request's generator."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheEngine, sampler: Sampler, device: torch.device,
                 plans: Callable[[StepPlan], None] | None = None,
                 context: ContextParallelPrefill | None = None, stages: PipelineStages | None = None,
                 scoring: BlockScoring | None = None, lora: LoraSlots | None = None) -> None:
        """`plans` hands each step's inputs to the other ranks of a tensor- or pipeline-parallel engine
        before this rank runs it (engine.parallel.step_plan); `context` splits long prompts across the
        ranks of a prefill context-parallel engine (engine.parallel.context_parallel); `stages` runs a
        pipeline-parallel engine's step through its stages (engine.parallel.pipeline); `scoring`
        scores the blocks each request holds under a KV budget (engine.kv_cache.kv_budget); `lora`:
        the LoRA adapters' slots (engine.lora), filled as each step's `adapter_loads` say."""
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = device
        self._plans = plans
        self._context = context
        self._stages = stages
        self._scoring = scoring
        self._lora = lora
        # Under a KV budget: steps by the attention they ran, "scored" or "regular" (a metric).
        self.budget_steps: Counter[str] = Counter()
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None,
        export_blocks: Sequence[int] = (), before_layer: Callable[[int], None] | None = None,
    ) -> dict[str, list[SampledToken]]:
        """Run one step; return the new tokens of every chunk that reached its request's end: one
        sampled token, or for a chunk with drafts the accepted drafts and the token after them
        (engine.speculative.verify). `export_blocks`: the blocks whose pages `on_layer_done` gathers,
        which the other ranks of a tensor-parallel engine gather beside it. `before_layer`: runs before each
        layer's attention (see LlamaForCausalLM.forward); single-process engines only (the lower KV tiers,
        its one user, refuse parallel layouts at start-up)."""
        if out.is_empty:
            return {}
        logits = self._forward(out, on_layer_done, export_blocks, before_layer)
        sampling = [c for c in out.chunks if c.samples]
        if logits is None:
            return {}
        states = [state for c in sampling for state in self._row_states(c)]
        rewind = {c.request.request_id: self._generators[c.request.request_id].get_state() for c in sampling
                  if c.draft_token_ids and c.request.request_id in self._generators}
        results = iter(self.sampler.sample(logits, states))
        new_tokens: dict[str, list[SampledToken]] = {}
        for chunk in sampling:
            rows = [next(results) for _ in range(chunk.num_sampled_rows)]
            kept = rows[: num_accepted(chunk.draft_token_ids, [token for token, _ in rows]) + 1]
            request_id = chunk.request.request_id
            if request_id in rewind and len(kept) < len(rows):
                # The rejected positions' draws were never used: leave the generator as if only the
                # kept tokens had drawn, so the request's next token draws what it would without drafts.
                generator = self._generators[request_id]
                generator.set_state(rewind[request_id])
                self.sampler.advance(generator, len(kept))
            new_tokens[request_id] = kept
        return new_tokens

    def _forward(self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None,
                 export_blocks: Sequence[int], before_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        """The step's forward pass (on this rank, or with the others): the sampled rows' logits (None
        where no row is sampled: a prompt chunk short of its end)."""
        input_ids, positions, meta, sample_rows = self._prepare(out)
        bounds = None if self._context is None else self._context.split(out)
        if bounds is not None and self._context is not None:
            # The one prompt's last token, whose logits it samples, is the one row computed here.
            return self.model.compute_logits(self._context.run(input_ids, bounds, meta, self.cache.kv_caches,
                                                               on_layer_done))
        if self._plans is not None:
            self._plans(StepPlan(input_ids, positions, meta, sample_rows, list(export_blocks)))
        if self._stages is not None:
            return self._stages.step(input_ids, positions, meta, sample_rows, self.cache.kv_caches, on_layer_done)
        if self._lora is not None:
            for slot, adapter in out.adapter_loads:
                self._lora.load(slot, adapter)
            self.model.lora_step.batch = LoraBatch.of([(c.request.lora_slot, c.num_tokens) for c in out.chunks],
                                                      self._lora.max_rank, self._lora.dtype)
        try:
            hidden = self.model(input_ids, positions, self.cache.kv_caches, meta, on_layer_done, before_layer)
        finally:
            self.model.lora_step.batch = NO_LORA
        if self._scoring is not None:
            self.budget_steps["regular" if meta.held_blocks is None else "scored"] += 1
            if meta.held_blocks is not None:
                for chunk, held, mass in zip(out.chunks, meta.held_blocks, self._scoring.attention.take_scores(),
                                             strict=True):
                    self._scoring.record(chunk.request.request_id, held, mass.tolist())
        if not sample_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])

    def _row_states(self, chunk: ScheduledChunk) -> list[SamplingRequestState]:
        """One sampling state per sampled row; row i sees the first i drafts as output already."""
        request = chunk.request
        generator = self._generator_for(request.request_id, request.params.seed)
        output = request.output_token_ids
        # A structured output's row i may take what its grammar allows after the first i drafts.
        allowed = None if request.grammar is None else request.grammar.allowed(chunk.draft_token_ids)
        return [
            SamplingRequestState(params=request.params, prompt_token_ids=request.prompt_token_ids,
                                 output_token_ids=output + list(chunk.draft_token_ids[:i]), generator=generator,
                                 allowed=None if allowed is None else allowed[i])
            for i in range(chunk.num_sampled_rows)
        ]

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        block_size = self.cache.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for chunk in out.chunks:
            end = chunk.start + chunk.num_tokens
            known = chunk.request.token_ids
            token_ids.extend(known[chunk.start : end] if not chunk.draft_token_ids
                             else (known + list(chunk.draft_token_ids))[chunk.start : end])
            table = chunk.block_table
            for pos in range(chunk.start, end):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            query_start.append(query_start[-1] + chunk.num_tokens)
            seq_lens.append(end)
            sample_rows.extend(range(query_start[-1] - chunk.num_sampled_rows, query_start[-1]))
        width = max(len(c.block_table) for c in out.chunks)
        # Padding, and the entries of blocks freed outside a sliding window, name block 0: the
        # attention backends never read a position their window hides (engine.kv_cache.window).
        tables = [[max(block, 0) for block in c.block_table] + [0] * (width - len(c.block_table)) for c in out.chunks]
        scoring = self._scoring if self._needs_scoring(out) else None
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            query_start_loc=self._tensor(query_start, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            query_lens_list=tuple(c.num_tokens for c in out.chunks),
            seq_lens_list=tuple(seq_lens),
            # The entries of blocks a KV budget freed are negative (engine.kv_cache.manager.FREED).
            held_blocks=None if scoring is None else tuple(
                tuple(i for i, block in enumerate(c.block_table) if block >= 0) for c in out.chunks),
            score_from=None if scoring is None else tuple(
                scoring.budget.score_from(c.request.num_tokens) for c in out.chunks),
        )
        return self._tensor(token_ids, torch.long), self._tensor(positions, torch.long), meta, sample_rows

    def _needs_scoring(self, out: SchedulerOutput) -> bool:
        """Whether the step runs the attention that gathers held blocks and scores them: under a KV
        budget, where a query scores (from its request's score_from on: a prompt's observation
        window, every decode row) or a request has freed blocks (negative entries:
        engine.kv_cache.manager.FREED), which the regular backend would read. A step with neither
        (a long prompt's chunks before its window) gets no held blocks in its metadata, so it runs
        the engine's regular backend (engine.attention.scored): its flash paths and CPU kernels cost
        less than gathers and a masked SDPA over every pair, and its masses would all be 0."""
        scoring = self._scoring
        return scoring is not None and any(
            c.start + c.num_tokens > scoring.budget.score_from(c.request.num_tokens) or min(c.block_table) < 0
            for c in out.chunks)

    def _tensor(self, values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    def resume_generator(self, request_id: str, seed: int | None, draws: int) -> None:
        """Re-create a seeded request's generator as if `draws` tokens had been sampled here, so a
        request that moves between engines keeps its seeded token sequence."""
        generator = self._generator_for(request_id, seed)
        if generator is not None:
            self.sampler.advance(generator, draws)

    def keep_first_layers(self, num_layers: int) -> None:
        """Run only the model's first `num_layers` layers before its final norm and head (an early-exit
        draft); their KV pages alone are kept."""
        model = self.model
        if not 1 <= num_layers <= len(model.layers):
            raise ValueError(f"draft_layers: must be in [1, {len(model.layers)}], got {num_layers}")
        model.keep_first_layers(num_layers)
        self.cache.kv_caches = self.cache.kv_caches[:num_layers]

    def forget(self, request_id: str) -> None:
        """Drop per-request state once the request is gone."""
        self._generators.pop(request_id, None)
