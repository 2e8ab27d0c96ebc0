"""Where the cores go: decode attention's memory bandwidth over long KV, and one engine's steps on one
thread against two.

Attention: the decode attention op (engine/model/kernels/decode_attention.cpp) over 30 layers'
pages, each layer its own cache so that they stream from memory as a serving step's do, blocks in a
random order as a long-running pool leaves them; reported as the KV bytes read per second, beside
the rate torch sums a 512 MiB tensor at (what the cores can stream) on the same threads. Cases: a
few long sequences (the long-prompt workload's decode) and many short ones (the chat workload's).

Steps: one engine on the shipped GGUF at this checkout's defaults, the same process at each thread
count (torch.set_num_threads): a prompt's compute (first token only) at 256 and 2,048 tokens, and
the median decode step of batches of short and long contexts.

    python -m bench cores [--threads 1,2] [--repeats 5] [--quick]

Writes bench/results/cores.json (--quick: smaller cases, under bench/results/smoke/).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from bench.common.call_timer import median_call_s
from bench.common.engine_formats import engine_formats
from bench.common.machine import describe
from bench.common.model_quality import FIXED_TEXT
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.kernels import cpu_kernels
from engine.sampling_params import SamplingParams

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16  # the shipped model's attention
ATTENTION_CASES = ((1, 2500), (4, 2500), (32, 300))  # (sequences, context positions)
PREFILL_CASES = (256, 2048)
DECODE_CASES = ((1, 300), (8, 300), (32, 300), (4, 2000))
STREAM_BYTES = 512 << 20


def attention_gbps(batch: int, length: int, dtype: torch.dtype, repeats: int) -> float:
    """KV bytes the decode attention op reads per second, every layer's pages its own."""
    kernels = cpu_kernels("cpu")
    if kernels is None:
        raise RuntimeError("no CPU kernels could be built here")
    generator = torch.Generator().manual_seed(0)
    per_sequence = (length + BLOCK) // BLOCK + 1
    blocks = batch * per_sequence + 1
    caches = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in "kv")
              for _ in range(LAYERS)]
    tables = (torch.randperm(blocks - 1, generator=generator)[: batch * per_sequence] + 1).int().view(batch, -1)
    tables = tables.contiguous()
    lens = torch.full((batch,), length, dtype=torch.int32)
    slots = tables[:, (length - 1) // BLOCK].long() * BLOCK + (length - 1) % BLOCK
    q, k, v = (torch.randn(batch, heads, HEAD_DIM, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS))

    def step() -> None:
        for k_cache, v_cache in caches:
            kernels.decode_attention(q, k, v, k_cache, v_cache, slots, tables, lens, HEAD_DIM ** -0.5)

    step()
    read = LAYERS * batch * length * KV_HEADS * HEAD_DIM * 2 * caches[0][0].element_size()
    return read / median_call_s(step, repeats) / 1e9


def stream_gbps(repeats: int) -> float:
    """Bytes per second torch's sum reads from a tensor far larger than the caches."""
    data = torch.ones(STREAM_BYTES // 4)
    data.sum()
    return STREAM_BYTES / median_call_s(data.sum, repeats) / 1e9


def prompt_s(engine: Engine, tokens: list[int]) -> float:
    """Seconds from adding a prompt to its first token, nothing else running."""
    engine.add_request(f"prompt-{time.monotonic_ns()}", tokens, SamplingParams(max_tokens=1, ignore_eos=True))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def decode_step_s(engine: Engine, text: list[int], batch: int, context: int, steps: int) -> float:
    """The median step once `batch` sequences of `context` positions all decode."""
    ids = [f"decode-{index}-{time.monotonic_ns()}" for index in range(batch)]
    for index, request_id in enumerate(ids):
        engine.add_request(request_id, text[index:index + context],
                           SamplingParams(max_tokens=4 * steps, temperature=0.0, ignore_eos=True))
    decoding: set[str] = set()
    while len(decoding) < batch:
        decoding.update(output.request_id for output in engine.step() if output.new_token_ids)
    seconds = median_call_s(engine.step, steps)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return seconds


def main(argv: Sequence[str]) -> int:
    """Measure at every thread count; print the tables; write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per attention case and decode steps")
    parser.add_argument("--quick", action="store_true", help="small cases, for a smoke run")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    attention_cases = ((1, 300), (4, 300)) if args.quick else ATTENTION_CASES
    prefill_cases = (64,) if args.quick else PREFILL_CASES
    decode_cases = ((2, 64),) if args.quick else DECODE_CASES
    load = {"start": load_average()}
    engine = Engine(EngineConfig(cache=CacheConfig(memory_bytes=1 << 30, enable_prefix_caching=False)))
    text = engine.tokenizer.encode(FIXED_TEXT.read_text(encoding="utf-8"))
    runs: dict[int, dict] = {}
    for count in threads:
        torch.set_num_threads(count)
        run: dict = {"stream_gbps": stream_gbps(args.repeats), "attention_gbps": {}, "prompt_s": {}, "step_s": {}}
        for dtype in (torch.float32, torch.bfloat16):
            for batch, length in attention_cases:
                run["attention_gbps"][f"{dtype}".removeprefix("torch.") + f" b{batch} L{length}"] = attention_gbps(
                    batch, length, dtype, args.repeats)
        prompt_s(engine, text[:64])  # warm-up
        run["prompt_s"] = {str(n): prompt_s(engine, text[:n]) for n in prefill_cases}
        run["step_s"] = {f"b{b} ctx{c}": decode_step_s(engine, text, b, c, args.repeats * 4) for b, c in decode_cases}
        runs[count] = run
        print(f"{count} thread(s), stream {run['stream_gbps']:.1f} GB/s: attention " + ", ".join(
            f"{case} {gbps:.1f} GB/s" for case, gbps in run["attention_gbps"].items()), flush=True)
    load["end"] = load_average()
    print("\n| threads | " + " | ".join(f"prompt {n}, s" for n in runs[threads[0]]["prompt_s"]) + " | "
          + " | ".join(f"step {case}, ms" for case in runs[threads[0]]["step_s"]) + " |")
    print("|---:|" + "---:|" * (len(runs[threads[0]]["prompt_s"]) + len(runs[threads[0]]["step_s"])))
    for count, run in runs.items():
        print(f"| {count} | " + " | ".join(f"{s:.2f}" for s in run["prompt_s"].values()) + " | "
              + " | ".join(f"{s * 1e3:.1f}" for s in run["step_s"].values()) + " |")
    machine = describe()
    print(f"\nengine: {engine_formats(engine)}; {machine['processor']} ({', '.join(machine['isa'])}); load average "
          f"{load['start']} -> {load['end']}")
    write_results(results_path(__name__, args.quick), {
        "command": command_line(__name__, argv), "machine": machine, "engine": engine_formats(engine),
        "load_average": load, "runs": {str(count): run for count, run in runs.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
