"""What pipeline stages and prefill context parallelism cost or buy on CPU, against one process in the same run.

The shipped model (SmolLM2-135M, 30 layers, its GGUF file at the engine's default formats), each
layout an Engine whose other ranks are processes of their own (gloo), every process on one thread,
so a layout of N processes uses N cores:

- Pipeline (`--pipeline-parallel-size 2`): the mean engine step of a decode batch of 1 and of 8
  sequences (128-token prompts), against one process on one thread. At batch 1 the two stages run
  one after the other, so the difference is the hand-off's cost; at 8 the micro-batches let them
  overlap. The hand-off alone (a point-to-point send and receive of one micro-batch's [rows, 576]
  hidden states, there and back) is timed in a loop beside it.
- Prefill context parallelism (`--prefill-context-parallel-size 2`): the time to first token of one
  fresh prompt near the model's 8,192-token context (--context-tokens), against one process on one
  thread and on two (the same cores as the split).

    python -m bench parallel_layouts [--context-tokens 8000] [--decode-steps 32] [--quick]

Writes bench/results/parallel_layouts.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from bench.common.machine import describe
from bench.common.suite import command_line, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.offline import generate
from engine.sampling_params import SamplingParams
from harness.ports import free_port

VOCAB = 49152
HANDOFF_LOOPS = 200


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, VOCAB, (length,), generator=generator).tolist() for _ in range(count)]


def decode_step_s(config: EngineConfig, batch: int, steps: int) -> float:
    """The mean engine step while `batch` sequences decode (their prompts computed first)."""
    engine = Engine(config)
    try:
        for index, prompt in enumerate(_prompts(batch, 128, batch)):
            engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        while engine.stats().num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        engine.close()


def first_token_s(config: EngineConfig, tokens: int) -> float:
    """One fresh prompt of `tokens` tokens to its first token (the best of two, after a warm-up)."""
    engine = Engine(config)
    try:
        generate(engine, _prompts(1, 64, 0), SamplingParams(max_tokens=1))
        best = float("inf")
        for seed in (1, 2):
            start = time.perf_counter()
            generate(engine, _prompts(1, tokens, seed), SamplingParams(max_tokens=1))
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        engine.close()


def _handoff(rank: int, port: int, rows: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hidden = torch.zeros(rows, 576)
    for loop in range(HANDOFF_LOOPS + 10):
        if loop == 10:
            start = time.perf_counter()
        if rank == 0:
            dist.send(hidden, 1)
            dist.recv(hidden, 1)
        else:
            dist.recv(hidden, 0)
            dist.send(hidden, 0)
    if rank == 0:
        torch.save((time.perf_counter() - start) / HANDOFF_LOOPS / 2, out)
    dist.destroy_process_group()


def handoff_s(rows: int, out: str) -> float:
    """One hand-off of a micro-batch's hidden states between two processes (gloo, loopback)."""
    mp.start_processes(_handoff, args=(free_port(), rows, out), nprocs=2, join=True, start_method="spawn")
    return float(torch.load(out))


def main(argv: Sequence[str]) -> int:
    """Every figure, the tables, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--context-tokens", type=int, default=8000, help="the prompt the split prefill computes")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch")
    parser.add_argument("--quick", action="store_true", help="a 512-token prompt, 4 decode steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.context_tokens, args.decode_steps = 512, 4
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    base = EngineConfig(cache=CacheConfig(memory_bytes=None, num_blocks=args.context_tokens // 16 + 64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.context_tokens + 64))
    record: dict = {"command": command_line(__name__, argv), "cpu": describe(), "pipeline": {}, "context": {}}
    print(f"# Parallel layouts on {describe()}, the shipped model, one thread a process")
    print("| pipeline | batch | engine step (ms) | vs 1 process |\n|---|---:|---:|---:|")
    for batch in (1, 8):
        one = decode_step_s(base, batch, args.decode_steps)
        two = decode_step_s(replace(base, pipeline_parallel_size=2), batch, args.decode_steps)
        record["pipeline"][batch] = {"one_s": one, "two_stages_s": two}
        print(f"| 1 process | {batch} | {one * 1e3:.2f} | 1.00x |\n| 2 stages | {batch} | {two * 1e3:.2f} | "
              f"{two / one:.2f}x |")
    out = str(results_path(__name__, args.quick, suffix=".handoff.pt"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    for rows in (1, 8):
        record["pipeline"][f"handoff_{rows}_rows_s"] = seconds = handoff_s(rows, out)
        print(f"- hand-off of {rows} row(s) of hidden states alone: {seconds * 1e6:.0f} µs")
    os.unlink(out)
    one = first_token_s(base, args.context_tokens)
    split = first_token_s(replace(base, prefill_context_parallel_size=2,
                                  prefill_context_parallel_min_tokens=256), args.context_tokens)
    torch.set_num_threads(2)
    two_threads = first_token_s(base, args.context_tokens)
    record["context"] = {"tokens": args.context_tokens, "one_thread_s": one, "split_2_s": split,
                         "two_threads_s": two_threads}
    print(f"\n| prefill of {args.context_tokens} tokens | TTFT (s) | split's speed-up |\n|---|---:|---:|")
    print(f"| 1 process, 1 thread | {one:.2f} | {one / split:.2f}x |")
    print(f"| 1 process, 2 threads | {two_threads:.2f} | {two_threads / split:.2f}x |")
    print(f"| context parallel 2 (1 thread each) | {split:.2f} | 1.00x |")
    write_results(results_path(__name__, args.quick), record)
    return 0
