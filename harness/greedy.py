"""Greedy decoding of one prompt straight through a model (no engine), alone or split across real
processes (gloo), for the tensor parallelism tests and the tensor_parallel suite: each rank loads
the checkpoint, keeps its shard, and decodes together with the others; rank 0 writes the tokens,
the top-2 margins and the logits."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import TorchPagedAttention
from engine.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import build_model, load_model_files
from engine.parallel.collectives import TensorParallelSharding
from engine.parallel.layout import TensorParallelLayout
from engine.parallel.shard import shard_files
from harness.ports import free_port

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Checkpoint:
    """What every rank loads: a path (None: the shipped model) and the format it serves in."""

    path: str | None
    quantization: str = "none"
    cpu_weights: str = "fp32"
    expert_parallel: bool = False  # a mixture of experts' experts split whole over the ranks


@dataclass(frozen=True)
class GreedyRun:
    token_ids: list[int]
    margins: list[float]
    logits: torch.Tensor  # [prompt + steps - 1, vocab]: the prompt's and each decode step's


def _meta(start: int, end: int, num_blocks: int, device: torch.device) -> AttentionMetadata:
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)
    positions = torch.arange(start, end, device=device)
    return AttentionMetadata(
        slot_mapping=table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE,
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        block_tables=table[None, :],
        query_lens_list=(end - start,),
        seq_lens_list=(end,),
    )


@torch.inference_mode()
def greedy(model: LlamaForCausalLM, prompt: list[int], steps: int) -> GreedyRun:
    """The prompt in two chunks, then `steps` greedy tokens one step at a time, on the model's device
    and in its dtype."""
    config = model.config
    device, dtype = model.norm.device, model.norm.dtype
    total = len(prompt) + steps
    num_blocks = -(-total // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(config.num_layers)]
    tokens, margins, rows = list(prompt), [], []
    bounds = [0, len(prompt) // 2, len(prompt)]
    for start, end in itertools.pairwise(bounds):
        hidden = model(torch.tensor(tokens[start:end], device=device), torch.arange(start, end, device=device),
                       caches, _meta(start, end, num_blocks, device))
        rows.append(model.compute_logits(hidden))
    for _ in range(steps):
        last = rows[-1][-1]
        top2 = torch.topk(last, 2).values
        margins.append(float(top2[0] - top2[1]))
        tokens.append(int(last.argmax()))
        at = len(tokens) - 1
        hidden = model(torch.tensor(tokens[at:], device=device), torch.tensor([at], device=device), caches,
                       _meta(at, at + 1, num_blocks, device))
        rows.append(model.compute_logits(hidden))
    return GreedyRun(tokens[len(prompt):], margins, torch.cat(rows)[:-1].cpu())


def load(checkpoint: Checkpoint, layout: TensorParallelLayout, device: str = "cpu",
         dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None,
         ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Rank `layout.rank`'s model, built from its shard on `device` in `dtype` (with `group`, made whole
    with the other ranks), and the whole model's config."""
    files = load_model_files(checkpoint.path, dtype, checkpoint.quantization)
    sharding = None if group is None else TensorParallelSharding(layout, files.config, group)
    return build_model(shard_files(files, layout), TorchPagedAttention(), device, checkpoint.quantization,
                       checkpoint.cpu_weights, dtype, sharding=sharding), files.config


def _rank(rank: int, size: int, port: int, checkpoint: Checkpoint, prompt: list[int], steps: int,
          out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        layout = TensorParallelLayout(size, rank, checkpoint.expert_parallel)
        model, _ = load(checkpoint, layout, group=dist.group.WORLD)
        run = greedy(model, prompt, steps)
        if rank == 0:
            torch.save(run, out)
    finally:
        dist.destroy_process_group()


def greedy_on_ranks(size: int, checkpoint: Checkpoint, prompt: list[int], steps: int, out: str) -> GreedyRun:
    """`greedy` by `size` processes, each holding its shard; what rank 0 saw."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(size, free_port(), checkpoint, prompt, steps, out), nprocs=size, join=True,
                       start_method="spawn")
    return torch.load(out, weights_only=False)
