"""The measuring side of the engine_throughput suite: time one system on a workload file.

`python -m bench.throughput.systems {tandem,transformers} --workload PATH` loads the system, warms it
up, times every case and prints one `BENCH-RESULT {json}` line. vLLM's side (bench/vllm/offline.py)
reuses `run_cases`, `emit` and `load_workload`, so this module imports only the standard library at
load time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

from harness.paths import REPO
from harness.token_timer import tpot

RESULT_PREFIX = "BENCH-RESULT "
KV_CACHE_GIB = 2

# (prompts, max_tokens) -> (output tokens generated in total, mean time per output token after the first)
GenerateFn = Callable[[list[list[int]], int], tuple[int, float]]


def load_workload(path: str) -> dict:
    """The workload file the parent wrote: model_dir, threads, repeats, warmup_prompts, cases, limits."""
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def run_cases(workload: dict, generate: GenerateFn) -> dict[str, dict[str, float]]:
    """Warm up, then time every case `repeats` times and keep the fastest run (the one least
    disturbed by whatever else shares the machine). Raises if a system generated a wrong count."""
    generate(workload["warmup_prompts"], 4)
    results = {}
    for case in workload["cases"]:
        prompts, max_tokens = case["prompts"], case["max_tokens"]
        best: dict[str, float] = {"seconds": float("inf")}
        for _ in range(workload["repeats"]):
            start = time.perf_counter()
            generated, tpot_s = generate(prompts, max_tokens)
            seconds = time.perf_counter() - start
            if generated != len(prompts) * max_tokens:
                raise RuntimeError(f"{case['name']}: generated {generated} tokens, not {len(prompts) * max_tokens}")
            if seconds < best["seconds"]:
                best = {"seconds": seconds, "output_tokens": generated, "tpot_s": tpot_s}
        results[case["name"]] = best
    return results


def emit(result: dict) -> None:
    """Hand a worker's result to the parent on stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker_main(measure: Callable[[dict], dict], doc: str | None, argv: list[str] | None = None) -> int:
    """The main() of a baseline's worker program (bench/vllm/offline.py, bench/llamacpp/offline.py):
    `--workload PATH`, then one result line."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--workload", required=True)
    emit(measure(load_workload(parser.parse_args(argv).workload)))
    return 0


def pin_to_cores(workload: dict) -> None:
    """Bind this process to the workload's `cores` (if it names any), as vLLM binds its threads."""
    if workload.get("cores"):
        os.sched_setaffinity(0, workload["cores"])


def revision() -> str:
    """This checkout's commit, short ("unknown" outside git): the version a Tandem result records."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    return commit or "unknown"


def tandem(workload: dict) -> dict:
    """Tandem's Engine through engine.offline.generate (all requests submitted at once), on the
    workload's model_dir unless its `tandem` entry gives other EngineConfig fields (`{"model": null}`:
    the shipped GGUF at the engine's defaults)."""
    import torch

    from bench.common.engine_formats import engine_formats
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    pin_to_cores(workload)
    torch.set_num_threads(workload["threads"])
    engine = Engine(EngineConfig(
        max_model_len=workload["max_model_len"],
        cache=CacheConfig(memory_bytes=KV_CACHE_GIB << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=workload["max_num_seqs"]),
        **{"model": workload["model_dir"], **workload.get("tandem", {})},
    ))

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        completions = generate(engine, prompts, params)
        return sum(len(c.token_ids) for c in completions), sum(c.tpot_s for c in completions) / len(completions)

    return {"system": "tandem", "version": revision(),
            "mode": f"Engine, {engine.runner.model.layers[0].attention.name} attention, "
                    f"max_num_seqs={workload['max_num_seqs']}",
            "engine": {"model": engine.config.model or "shipped GGUF", **engine_formats(engine)},
            "cases": run_cases(workload, run)}


class _TokenClock:
    """A generate() streamer that only notes when each new token arrives (its first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._saw_prompt = False

    def put(self, _value: object) -> None:
        """Called by generate() with the prompt, then with every new token batch."""
        if self._saw_prompt:
            self.times.append(time.perf_counter())
        self._saw_prompt = True

    def end(self) -> None:
        """Nothing to flush."""


def transformers_generate(workload: dict) -> dict:
    """transformers' model.generate on static, left-padded batches, greedy."""
    import torch
    import transformers

    torch.set_num_threads(workload["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(workload["model_dir"], dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _TokenClock()
        # min_new_tokens == max_new_tokens is transformers' ignore_eos: EOS stays masked to the end.
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, streamer=clock)
        new_tokens = out.shape[1] - width
        return int(out.shape[0] * new_tokens), tpot(clock.times[0], clock.times[-1], new_tokens)

    return {"system": "transformers", "version": transformers.__version__,
            "mode": "model.generate, static batch, left padding, greedy, DynamicCache",
            "cases": run_cases(workload, run)}


def main(argv: list[str] | None = None) -> int:
    """Run one in-process system on a workload file and emit its result."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("system", choices=["tandem", "transformers"])
    parser.add_argument("--workload", required=True)
    args = parser.parse_args(argv)
    workload = load_workload(args.workload)
    emit(tandem(workload) if args.system == "tandem" else transformers_generate(workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
