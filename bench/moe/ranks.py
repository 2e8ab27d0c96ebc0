"""The moe suite's figure 4: what expert parallelism's combine costs a CPU decode step (gloo), as the
tensor_parallel suite measures TP: the MoE model decoded greedily by harness.greedy in 1 process, in
2 processes splitting each expert's features (TP 2) and in 2 processes holding 4 whole experts each
(EP 2), every rank pinned to its own core on one thread; the mean decode step, and one decode step's
all-reduce ([1, hidden]) timed alone, so the collectives' share of a step is their count times that.

Both layouts all-reduce twice per layer (attention's output projection, then the MoE's partial sums:
EP's combine) plus the embedding's, and gather the logits: the same count. What differs is the
experts' work per rank: TP splits every expert a token routes to, EP gives a token's experts to
whichever rank holds them, so at batch 1 one rank may hold both while the other waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.ports import free_port

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

COLLECTIVE_LOOPS = 200
LAYOUTS = {"1 process": (1, False), "TP 2": (2, False), "EP 2": (2, True)}  # label -> (ranks, expert_parallel)


def _rank(rank: int, size: int, port: int, model: str, expert_parallel: bool, cpu_weights: str, prompt: list[int],
          steps: int, out: str) -> None:
    from engine.parallel.layout import TensorParallelLayout
    from harness.greedy import Checkpoint, load

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    group = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        group = dist.group.WORLD
    try:
        layout = TensorParallelLayout(size, rank, expert_parallel)
        model, config = load(Checkpoint(model, "none", cpu_weights, expert_parallel), layout, "cpu", torch.float32,
                             group)
        figures = {**_decode_times(model, prompt, steps), "layers": config.num_layers,
                   "allreduce_s": 0.0 if group is None else _allreduce_s(group, config.hidden_size)}
        if rank == 0:
            torch.save(figures, out)
    finally:
        if group is not None:
            dist.destroy_process_group()


def _decode_times(model: LlamaForCausalLM, prompt: list[int], steps: int) -> dict[str, float]:
    from harness.greedy import greedy

    greedy(model, prompt[: max(2, len(prompt) // 4)], 2)  # warm-up
    start = time.perf_counter()
    greedy(model, prompt, 0)
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    greedy(model, prompt, steps)
    return {"prompt_s": prompt_s, "step_s": (time.perf_counter() - start - prompt_s) / steps}


def _allreduce_s(group: dist.ProcessGroup, hidden: int) -> float:
    row = torch.zeros(1, hidden)
    for _ in range(10):  # warm-up, and the ranks leave it together: neither times the other's lag
        group.allreduce([row]).wait()
    start = time.perf_counter()
    for _ in range(COLLECTIVE_LOOPS):
        group.allreduce([row]).wait()
    return (time.perf_counter() - start) / COLLECTIVE_LOOPS


def run_layout(label: str, model: str, cpu_weights: str, prompt: list[int], steps: int, out: Path) -> dict:
    """One layout's figures, as rank 0 saw them."""
    size, expert_parallel = LAYOUTS[label]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out.parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(size, free_port(), model, expert_parallel, cpu_weights, prompt, steps, str(out)),
                       nprocs=size, join=True, start_method="spawn")
    figures = torch.load(out, weights_only=False)
    out.unlink(missing_ok=True)
    return figures


def collectives_per_step(layers: int) -> int:
    """All-reduces and gathers of a split decode step: 2 a layer (o, the MoE), the embedding, the logits."""
    return 2 * layers + 2


def measure_layouts(model: str, cpu_weights: str, prompt: list[int], steps: int, out: Path) -> dict:
    """Every layout of LAYOUTS, and the collectives' and the combine's share of the split steps."""
    figures = {label: run_layout(label, model, cpu_weights, prompt, steps, out) for label in LAYOUTS}
    for label, run in figures.items():
        if LAYOUTS[label][0] > 1:
            count = collectives_per_step(run["layers"])
            run["collectives"] = count
            run["collectives_share"] = count * run["allreduce_s"] / run["step_s"]
            run["combine_share"] = run["layers"] * run["allreduce_s"] / run["step_s"]  # the MoE's one a layer
    return figures


def layouts_table(figures: dict) -> str:
    """The layouts as a markdown table, each step against the 1-process step."""
    one = figures["1 process"]["step_s"]
    lines = ["| layout | prompt (ms) | decode step (ms) | vs 1 process | all-reduce alone (µs) | collectives a step "
             "| collectives' share | EP/TP combine's share |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, run in figures.items():
        split = "collectives" in run
        lines.append(f"| {label} | {run['prompt_s'] * 1e3:.1f} | {run['step_s'] * 1e3:.2f} | {run['step_s'] / one:.2f}x"
                     f" | {run['allreduce_s'] * 1e6:.0f} | {run.get('collectives', 0)} | "
                     f"{run['collectives_share'] if split else 0:.0%} | {run['combine_share'] if split else 0:.0%} |")
    return "\n".join(lines)
