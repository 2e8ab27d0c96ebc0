"""Ranks 1.. of a tensor-parallel engine: load this rank's shard of the model and its KV cache,
then run every forward pass rank 0's step plans describe, taking part in the collectives, until a
STOP plan or the group breaks. Only rank 0 schedules and samples."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.engine_model import load_engine_model
from engine.parallel.group import join_group, rank_device
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.step_plan import receive_plan

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
    group = join_group(port, rank, config.tensor_parallel_size, device)
    loaded = load_engine_model(config, None, TensorParallelLayout(config.tensor_parallel_size, rank), group, device)
    group.barrier().wait()
    model, caches = loaded.model, loaded.cache.kv_caches
    try:
        while (plan := receive_plan(group, device)) is not None:
            hidden = model(plan.input_ids, plan.positions, caches, plan.meta)
            if plan.sample_rows:
                model.compute_logits(hidden[torch.tensor(plan.sample_rows, device=device)])
    except RuntimeError as error:  # rank 0 or another rank is gone: nothing left to follow
        log.error("tensor-parallel rank %d stops: %s", rank, error)
