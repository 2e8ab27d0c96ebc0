"""The measuring side of the lora suite, shared by both systems' workers (Tandem's in the project's
venv, vLLM's in its own, so only the standard library is imported here): which adapter each request
runs under, a row timed, and a worker's command line.

A worker runs one setup of the workload (`--setup NAME`: the engine started once, with `max_loras`
slots, or without LoRA at 0) and times each of its rows: all the workload's prompts, request i under
adapter i mod k of the row's first k adapters (k = 0: the base model).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from bench.throughput.systems import emit, load_workload, run_cases

# (prompts, max_tokens, each prompt's adapter name or "" for the base)
#   -> (output tokens in all, mean TPOT, each request's output token ids)
AdapterGenerateFn = Callable[[list[list[int]], int, list[str]], tuple[int, float, list[list[int]]]]


def assigned(workload: dict, count: int) -> list[str]:
    """Each prompt's adapter name under a row of `count` adapters, round-robin ("": the base)."""
    names = [name for name, _ in workload["adapters"][:count]]
    return [names[i % count] if count else "" for i in range(len(workload["prompts"]))]


def time_row(workload: dict, name: str, count: int, generate: AdapterGenerateFn) -> dict[str, float]:
    """Row `name` (`count` adapters): the whole prompt set generated once to warm up (which also
    brings every adapter of the row into its slot), then timed `repeats` times, the fastest kept,
    with the last run's output token ids (`tokens`, by request), which the report compares."""
    names = assigned(workload, count)
    case = {"warmup_prompts": workload["prompts"], "repeats": workload["repeats"],
            "cases": [{"name": name, "prompts": workload["prompts"], "max_tokens": workload["max_tokens"]}]}
    outputs: list[list[int]] = []

    def timed(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        generated, tpot_s, tokens = generate(prompts, max_tokens, names[:len(prompts)])
        outputs[:] = tokens
        return generated, tpot_s

    return {**run_cases(case, timed)[name], "tokens": outputs}


def worker_main(measure: Callable[[dict, str], dict], doc: str | None, argv: list[str] | None = None) -> int:
    """A lora worker's main(): `--workload PATH --setup NAME`, then one result line."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--setup", required=True)
    args = parser.parse_args(argv)
    workload = load_workload(args.workload)
    if args.setup not in workload["setups"]:
        parser.error(f"--setup: {args.setup!r} is not one of the workload's ({', '.join(workload['setups'])})")
    emit(measure(workload, args.setup))
    return 0
