"""Ranks 1.. of a tensor-parallel engine: load this rank's shard of the model and its KV cache,
then run every forward pass rank 0's step plans describe, taking part in the collectives, and take
this rank's heads of the pages rank 0 imports (engine.parallel.kv_heads), until a STOP plan or the
group breaks. Ranks 1.. of a prefill context-parallel engine load the whole model and compute their
slice of each split prompt (engine.parallel.context_parallel); those of a pipeline-parallel engine
their stage's layers, and run them over each step (engine.parallel.pipeline). Only rank 0 schedules
and samples."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.engine_model import load_engine_model
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.cache_engine import CacheEngine
from engine.lora.serving import attach_slots
from engine.lora.slots import LoraSlots
from engine.parallel.adapter_shard import adapter_shard
from engine.parallel.context_parallel import run_slice, wrap_attention
from engine.parallel.kv_heads import RankKVHeads
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.pipeline import StageRank
from engine.parallel.pipeline_layout import PipelineLayout
from engine.parallel.process_group import join_group, rank_device, stage_prefix
from engine.parallel.step_plan import PagesPlan, SequencePlan, StepPlan, receive_plan

log = logging.getLogger(__name__)


@torch.inference_mode()
def follow(config: EngineConfig, rank: int, port: int, threads: int) -> None:
    """A follower process's whole life (started by engine.parallel.group), computing on as many
    threads as rank 0 (`--threads`)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = join_group(port, rank, config.world_size, device)
    if config.prefill_context_parallel_size > 1:
        _follow_splits(config, rank, group, device)
        return
    if config.pipeline_parallel_size > 1:
        stage, tensor_rank = divmod(rank, config.tensor_parallel_size)
        tensor = None if config.tensor_parallel_size == 1 else join_group(
            port, tensor_rank, config.tensor_parallel_size, device, prefix=stage_prefix(stage))
        _follow_stage(config, PipelineLayout(config.pipeline_parallel_size, stage), tensor_rank, group, tensor,
                      device)
        return
    layout = TensorParallelLayout.of(config, rank)
    loaded = load_engine_model(config, None, layout, group, device)
    group.barrier().wait()
    model, cache = loaded.model, loaded.cache
    heads = RankKVHeads(loaded.config, config.tensor_parallel_size, group)
    # This rank's part of every LoRA adapter rank 0 loads (engine.parallel.adapter_shard).
    slots = None if config.lora is None else attach_slots(model, config.lora, loaded.dtype,
                                                          adapter_shard(layout, loaded.config))
    try:
        while (plan := receive_plan(group, device)) is not None:
            assert not isinstance(plan, SequencePlan), plan
            if isinstance(plan, PagesPlan):
                _import_pages(plan, cache, heads)
                continue
            _load_adapters(slots, plan)
            with model.lora_step.running(plan.lora_slots, plan.meta.query_lens_list):
                hidden = model(plan.input_ids, plan.positions, cache.kv_caches, plan.meta,
                               _exporter(plan, cache, heads))
            if plan.sample_rows:
                model.compute_logits(hidden[torch.tensor(plan.sample_rows, device=device)])
    except RuntimeError as error:  # rank 0 or another rank is gone: nothing left to follow
        log.error("tensor-parallel rank %d stops: %s", rank, error)


def _follow_splits(config: EngineConfig, rank: int, group: dist.ProcessGroup,
                   device: torch.device) -> None:
    """A context-parallel rank: the whole model, and its cache as scratch for each split prompt
    (blocks 0.. in order, so a token's slot is its position); rank 0 keeps the pages."""
    loaded = load_engine_model(config, None, TensorParallelLayout(1, 0), None, device)
    group.barrier().wait()
    attention = wrap_attention(loaded.model, group, rank)
    cache = loaded.cache
    try:
        while (plan := receive_plan(group, device)) is not None:
            assert isinstance(plan, SequencePlan), plan
            tokens = plan.input_ids.numel()
            table = torch.arange(blocks_for(tokens, cache.block_size), device=device)
            run_slice(loaded.model, attention, group, rank, plan.input_ids, plan.bounds,
                      torch.arange(tokens, device=device), table, cache.kv_caches)
    except RuntimeError as error:  # rank 0 or another rank is gone: nothing left to follow
        log.error("prefill context-parallel rank %d stops: %s", rank, error)


def _follow_stage(config: EngineConfig, layout: PipelineLayout, tensor_rank: int, group: dist.ProcessGroup,
                  tensor: dist.ProcessGroup | None, device: torch.device) -> None:
    """A rank of a pipeline stage (other than rank 0): its shard of its stage's layers, their KV cache,
    and every step's micro-batches; `tensor` is its stage's tensor-parallel group (None at TP 1)."""
    tensor_layout = TensorParallelLayout.of(config, tensor_rank)
    loaded = load_engine_model(config, None, tensor_layout, tensor, device, layout)
    group.barrier().wait()
    heads = None if tensor is None else RankKVHeads(loaded.config, config.tensor_parallel_size, tensor)
    rank = StageRank(loaded, layout, config.tensor_parallel_size, tensor_rank, group, heads)
    # This rank's part of its stage's layers of every LoRA adapter rank 0 loads.
    slots = None if config.lora is None else attach_slots(loaded.model, config.lora, loaded.dtype,
                                                          adapter_shard(tensor_layout, loaded.config))
    try:
        while (plan := receive_plan(group, device)) is not None:
            if isinstance(plan, PagesPlan):
                rank.import_pages(plan)
            elif isinstance(plan, StepPlan):
                _load_adapters(slots, plan)
                rank.step(plan)
    except RuntimeError as error:  # rank 0 or another stage is gone: nothing left to follow
        log.error("pipeline stage %d stops: %s", layout.stage, error)


def _load_adapters(slots: LoraSlots | None, plan: StepPlan) -> None:
    """Copy the adapters rank 0 loads before the step into this rank's slots (each keeps its part)."""
    if slots is not None:
        for load in plan.adapter_loads:
            slots.load(load.slot, load.rank, load.weights)


def _exporter(plan: StepPlan, cache: CacheEngine, heads: RankKVHeads) -> Callable[[int], None] | None:
    """The layer hook that hands rank 0 this rank's heads of the step's exported blocks."""
    if not plan.export_blocks:
        return None
    return lambda layer: heads.send(*cache.gather_blocks(layer, plan.export_blocks))


def _import_pages(plan: PagesPlan, cache: CacheEngine, heads: RankKVHeads) -> None:
    k_cache = cache.kv_caches[plan.layer][0]
    k, v = heads.receive(k_cache.shape[1:], len(plan.block_ids), k_cache.dtype, k_cache.device)
    cache.scatter_blocks(plan.layer, plan.block_ids, k, v)
