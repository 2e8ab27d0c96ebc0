"""What tensor parallelism costs a step here, against TP 1 in the same run (on a GPU: its bf16 arithmetic).

On CPU the collectives (gloo) per step; on a GPU the bf16 shard arithmetic against TP 1.

Random weights of the shipped model's shapes (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads), made
once with transformers into bench/.cache/. Each rank is a process that loads its shard
(engine.parallel) and runs the model directly (harness.greedy: a prompt in two
chunks, then greedy steps one token at a time).

- CPU (`--device cpu`, the default): TP 1 and TP --size, one rank pinned per core, one thread each;
  the prompt's time and the mean decode step, and a loop of the all-reduce a decode step makes
  (2 per layer of [1, hidden] plus the embedding's; the logits' gather) timed alone, so the
  collectives' share of a step is their count times that.
- GPU (`--device cuda`): TP 1 and TP --size in bfloat16 (all ranks on the one GPU, gloo: NCCL
  refuses two ranks on one GPU), each against fp32 TP 1: logits' differences and where the greedy
  tokens part. Its timings are not TP's speed (gloo copies through the host).

    python -m bench tensor_parallel [--device cpu|cuda] [--size 2] [--prompt 256] [--steps 32] [--quick]

Writes bench/results/tensor_parallel.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common.machine import cpu_model
from bench.common.suite import command_line, results_path, suite_parser, write_results
from harness.paths import REPO
from harness.ports import free_port

CACHE = REPO / "bench" / ".cache"
# heads, KV heads, hidden: the shipped model's, and the same size with heads that 2 and 4 ranks split.
SHAPES = {"smollm2-shape-random": (9, 3, 576), "smollm2-size-8-heads-random": (8, 4, 512)}
COLLECTIVE_LOOPS = 200


def model_for(size: int) -> Path:
    """Random weights of SmolLM2-135M's shapes (or, for a size its 9 heads do not take, 8 heads and
    4 KV heads of the same head size) as an HF directory, made once."""
    name = "smollm2-shape-random" if 9 % size == 0 else "smollm2-size-8-heads-random"
    directory = CACHE / name
    if not (directory / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        heads, kv_heads, hidden = SHAPES[name]
        config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                             max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                             tie_word_embeddings=True, initializer_range=0.05)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _rank(rank: int, size: int, port: int, model: str, device: str, dtype: torch.dtype, prompt: list[int],
          steps: int, out: str) -> None:
    from engine.parallel.layout import TensorParallelLayout
    from harness.greedy import Checkpoint, load

    torch.set_num_threads(1)
    if device == "cpu":
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    group = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        group = dist.group.WORLD
    layout = TensorParallelLayout(size, rank)
    built, config = load(Checkpoint(model, "none", "plain"), layout, device, dtype, group)
    _time(built, rank, group, config.hidden_size, device, dtype, prompt, steps, config.num_layers, out)


def _time(model, rank: int, group, hidden: int, device: str, dtype: torch.dtype, prompt: list[int], steps: int,
          layers: int, out: str) -> None:
    from harness.greedy import greedy

    greedy(model, prompt[:32], 2)  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    greedy(model, prompt, 0)
    sync()
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    run = greedy(model, prompt, steps)
    sync()
    step_s = (time.perf_counter() - start - prompt_s) / steps
    collective_s = 0.0
    if group is not None:  # one decode step's all-reduce, alone
        row = torch.zeros(1, hidden, dtype=dtype, device=device)
        start = time.perf_counter()
        for _ in range(COLLECTIVE_LOOPS):
            group.allreduce([row]).wait()
        sync()
        collective_s = (time.perf_counter() - start) / COLLECTIVE_LOOPS
        dist.destroy_process_group()
    if rank == 0:
        torch.save({"run": run, "prompt_s": prompt_s, "step_s": step_s, "allreduce_s": collective_s,
                    "layers": layers}, out)


def run_ranks(size: int, model: str, device: str, dtype: torch.dtype, prompt: list[int], steps: int,
              out: str) -> dict:
    """One layout's figures, from rank 0."""
    mp.start_processes(_rank, args=(size, free_port(), model, device, dtype, prompt, steps, out), nprocs=size,
                       join=True, start_method="spawn")
    return torch.load(out, weights_only=False)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main(argv: Sequence[str]) -> int:
    """Both layouts, the table, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", type=int, default=None, help="ranks (default: 2 on cpu, 3 on cuda)")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps")
    parser.add_argument("--quick", action="store_true", help="a 32-token prompt, 4 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt, args.steps = 32, 4
    size = args.size or (2 if args.device == "cpu" else 3)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prompt = [int(t) for t in torch.randint(0, 49152, (args.prompt,), generator=torch.Generator().manual_seed(0))]
    out_path = results_path(__name__, args.quick, suffix=".rank0.pt")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out = str(out_path)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = str(model_for(size))
    one = run_ranks(1, model, args.device, dtype, prompt, args.steps, out)
    split = run_ranks(size, model, args.device, dtype, prompt, args.steps, out)
    results = {"command": command_line(__name__, argv), "settings": vars(args), "size": size, "model": model,
               "dtype": str(dtype), "cpu": cpu_model()}
    print(f"{args.prompt}-token prompt, {args.steps} greedy steps, {dtype}, {args.device} ({results['cpu']})\n")
    print("| layout | prompt (ms) | decode step (ms) | all-reduce alone (µs) | collectives a step |")
    print("|---|---:|---:|---:|---:|")
    collectives = 2 * one["layers"] + 2  # o and down per layer, the embedding, the logits' gather
    for name, figures in (("TP 1", one), (f"TP {size}", split)):
        reduce_us = figures["allreduce_s"] * 1e6
        print(f"| {name} | {figures['prompt_s'] * 1e3:.1f} | {figures['step_s'] * 1e3:.2f} | "
              f"{reduce_us:.0f} | {collectives if figures is split else 0} |")
    results.update({"tp1": {k: v for k, v in one.items() if k != "run"},
                    f"tp{size}": {k: v for k, v in split.items() if k != "run"}})
    share = collectives * split["allreduce_s"] / split["step_s"]
    print(f"\nstep TP {size} / TP 1: {split['step_s'] / one['step_s']:.2f}x; the collectives alone: "
          f"{collectives} x {split['allreduce_s'] * 1e6:.0f} µs = {share:.0%} of a TP {size} decode step")
    results["collective_share_of_step"] = share
    if args.device == "cuda":
        exact = run_ranks(1, model, args.device, torch.float32, prompt, args.steps, out)
        for name, figures in (("TP 1 bf16", one), (f"TP {size} bf16", split)):
            difference = (figures["run"].logits - exact["run"].logits).abs()
            parted = _first_difference(figures["run"].token_ids, exact["run"].token_ids)
            print(f"{name} against fp32 TP 1: max |logit| {difference.max():.3f}, mean {difference.mean():.4f}, "
                  f"greedy tokens part at step {parted}")
            results[f"{name} vs fp32"] = {"max": difference.max().item(), "mean": difference.mean().item(),
                                          "parts_at": parted}
    Path(out).unlink(missing_ok=True)
    write_results(results_path(__name__, args.quick), results)
    return 0

