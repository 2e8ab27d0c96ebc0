"""A LoRA adapter over the base in each weight format, judged against the adapter over exact fp32.

An adapter's two thin products run in the adapter's dtype over whatever the base's product computes
(engine.lora.product), so a base format other than exact fp32 moves the adapter's output as much as
it moves the base's. Measured per base format (exact fp32, the GGUF file's own blocks, int8, bf16),
each with the same random rank-16 adapter on every projection (the lora suite's first,
bench.lora.adapters): perplexity of 8 windows of 512 tokens of README + architecture.md
teacher-forced under the adapter and under the base alone, and the index of the first token where
greedy decoding under the adapter departs from fp32's under the adapter, over 48 tokens on 8 prompts.

    python -m bench lora_fidelity [--threads 2] [--windows 8]
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from bench.common.machine import cpu_model
from bench.common.model_quality import document_windows, first_difference, perplexity
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.lora.adapters import RANK, ensure_adapters
from bench.suites.hf_export import ensure_export
from engine.config import CacheConfig, EngineConfig, LoraConfig
from engine.engine import Engine
from engine.model.loader import load_model_files
from engine.offline import generate
from engine.sampling_params import SamplingParams

FORMATS = {  # label -> EngineConfig fields
    "fp32": {"dtype": "float32", "quantization": "none", "cpu_weights": "fp32"},
    "gguf blocks": {"dtype": "float32", "quantization": "gguf"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
}
WINDOW_TOKENS = 512
AGREEMENT_TOKENS = 48
PROMPTS = 8


@contextmanager
def _under_adapter(engine: Engine, name: str, rows: int) -> Iterator[None]:
    """Every forward of `rows` rows runs under the adapter `name` (in slot 0) while inside: perplexity
    drives the model directly (bench.common.model_quality), not through the scheduler, which would
    otherwise fill the slot and set the step's rows."""
    adapters = engine.adapters
    assert adapters is not None
    adapter = adapters.registry.adapter(name)
    adapters.slots.load(0, adapter.rank, adapter.weights)
    try:
        with engine.runner.model.lora_step.running([0], [rows]):
            yield
    finally:
        adapters.slots.clear(0)


def measure(engine: Engine, name: str, windows: int) -> dict:
    """One base format's perplexities (base alone, under the adapter `name`) and greedy outputs under it."""
    texts = document_windows(engine, windows, WINDOW_TOKENS)
    base = perplexity(engine, texts)
    with _under_adapter(engine, name, WINDOW_TOKENS):
        adapted = perplexity(engine, texts)
    prompts = [text[:64] for text in document_windows(engine, PROMPTS, WINDOW_TOKENS)]
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)
    greedy = [run.token_ids for run in generate(engine, prompts, params)]
    return {"perplexity_base": base, "perplexity_adapter": adapted, "greedy": greedy}


def main(argv: Sequence[str]) -> int:
    """Each base format's figures under the adapter, against fp32's; print the table, write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 tokens")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    files = load_model_files(None, torch.float32)
    ensure_export()
    (name, directory), = ensure_adapters(1)
    lora = LoraConfig(max_loras=1, max_lora_rank=RANK, modules=((name, directory),))
    print(f"CPU: {cpu_model()}, {args.threads} thread(s), load average {load_average()}")
    results: dict[str, dict] = {}
    for label, fields in FORMATS.items():
        config = EngineConfig(cache=CacheConfig(enable_prefix_caching=False), lora=lora, **fields)  # type: ignore[arg-type]
        results[label] = measure(Engine(config, files=files), name, args.windows)
    reference = results["fp32"]["greedy"]
    for figures in results.values():
        figures["first_difference"] = [first_difference(r, o) for r, o in zip(reference, figures.pop("greedy"),
                                                                                strict=True)]
    fp32 = results["fp32"]
    print(f"\n| base format | perplexity, base | under {name} | vs fp32 under it | "
          f"greedy under it equal to fp32's for (of {AGREEMENT_TOKENS}), median [min] |")
    print("|---|---:|---:|---:|---:|")
    for label, figures in results.items():
        change = figures["perplexity_adapter"] / fp32["perplexity_adapter"] - 1
        agree = figures["first_difference"]
        print(f"| {label} | {figures['perplexity_base']:.3f} | {figures['perplexity_adapter']:.3f} | "
              f"{change:+.2%} | {statistics.median(agree):.0f} [{min(agree)}] |")
    write_results(args.out, {"command": command_line(__name__, argv), "cpu": cpu_model(), "threads": args.threads,
                             "adapter": {"name": name, "path": directory}, "formats": results})
    return 0
