"""The weight formats side by side on CPU: fp32, fp16 weights, the GGUF file's own blocks and int8.

From one load of the shipped model, on `--threads` torch threads (1 by default), two tables:

- products: ms per call (on one thread the thread's CPU time, else wall time) at each of `--rows`
  rows for the model's shapes (fused qkv, o, fused gate/up, down, the LM head), the median of
  `--repeat` calls after a warm-up: F.linear over fp32
  weights, fbgemm's fp16-weight product, the CPU kernel over the file's blocks (Q4_1, the head
  Q8_0), the same weight dequantized then F.linear (what `QuantizedLinear` does from
  DENSE_MIN_ROWS rows up), the kernel over round-to-nearest int8, and torch's own packed
  products (`_weight_int4pack_mm_for_cpu` over the Q4_1 blocks, `_weight_int8pack_mm` per
  channel; bench.common.torch_packed) at fp32 and bf16 activations, with how far each moves a weight;
- engine: for quantization none (fp32 weights pre-packed for oneDNN), none with fp16 weights,
  gguf and int8: the median ms of the decode steps at each `--batch` (prompts of 128 tokens, each
  step one token for all of them, `--decode-tokens` steps), the ms of one `--prefill-tokens` prompt
  (times as the products table takes them), perplexity of 8 windows of 512
  tokens of README + architecture.md, and the index of the first token where greedy decoding
  departs from fp32's over 48 tokens on 8 prompts.

    python -m bench weight_formats [--rows 1,4,8,16,32,512] [--batch 1,8,32] [--threads 1]
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench.common import torch_packed
from bench.common.machine import cpu_model
from bench.common.model_quality import document_windows, first_difference, perplexity
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.int8 import quantize_int8
from engine.model.kernels import kernels
from engine.model.loader import ModelFiles, load_model_files
from engine.model.product_plan import plan_quantized
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import QuantizedLinear
from engine.model.weight_formats import WeightFormat
from engine.offline import generate
from engine.sampling_params import SamplingParams

PRODUCTS = {  # name -> the HF tensors stacked into it (layer 0; the head is the tied embedding)
    "qkv 960x576": ("q_proj", "k_proj", "v_proj"),
    "o 576x576": ("o_proj",),
    "gate_up 3072x576": ("gate_proj", "up_proj"),
    "down 576x1536": ("down_proj",),
    "lm_head 49152x576": (),
}
ENGINES = {  # label -> EngineConfig fields
    "fp32": {"quantization": "none", "cpu_weights": "fp32"},
    "fp16 weights": {"quantization": "none", "cpu_weights": "fp16"},
    "gguf": {"quantization": "gguf"},
    "int8": {"quantization": "int8"},
}
PROMPT_TOKENS = 128
AGREEMENT_TOKENS = 48
WINDOW_TOKENS = 512


def _served(files: ModelFiles, name: str) -> QuantizedLinear:
    """Layer 0's product (or the head) over the file's own blocks."""
    parts = PRODUCTS[name]
    if not parts:
        head = files.weights["model.embed_tokens.weight"]
        assert isinstance(head, QuantizedWeight)
        return QuantizedLinear(head, plan_quantized(head, torch.float32))
    names = [f"model.layers.0.{'mlp' if p in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{p}.weight"
             for p in parts]
    product = WeightFormat("gguf", torch.float32).product(name, [(n, files.weights[n]) for n in names])
    assert isinstance(product, QuantizedLinear)
    return product


def _clock() -> Callable[[], float]:
    # On one thread, the thread's CPU time: on a shared machine it leaves out the time the thread
    # waited for a core (everything measured here runs on the calling thread then).
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _median_ms(call: Callable[[], object], repeat: int) -> float:
    clock = _clock()
    call()
    times = []
    for _ in range(repeat):
        start = clock()
        call()
        times.append(clock() - start)
    return 1000 * statistics.median(times)


def _time_products(x: torch.Tensor, served: QuantizedLinear, int8: QuantizedLinear, repeat: int) -> dict[str, float]:
    ops = kernels()
    weight = served.dequantize()
    fp16 = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight)
    w, i8 = served.weight, int8.weight
    return {
        "fp32 F.linear": _median_ms(lambda: F.linear(x, weight), repeat),
        "fp16 fbgemm": _median_ms(lambda: torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation(x, fp16, None),
                                  repeat),
        "gguf kernel": _median_ms(lambda: ops.matmul(x, w), repeat),
        "gguf dequantize + F.linear": _median_ms(lambda: F.linear(x, served.dequantize()), repeat),
        "int8 kernel": _median_ms(lambda: ops.matmul(x, i8), repeat),
        **_time_torch_packed(x, served.source, repeat),
    }


def _time_torch_packed(x: torch.Tensor, weight: QuantizedWeight, repeat: int) -> dict[str, float]:
    """torch's packed products (bench.common.torch_packed) at fp32 and bf16 activations; NaN
    where this torch or this weight's format has none."""
    figures: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, build in (("int4pack", torch_packed.int4pack), ("int8pack", torch_packed.int8pack)):
            label = f"torch {name} {str(dtype).removeprefix('torch.')}"
            try:
                product = build(weight, dtype)
            except (ValueError, RuntimeError):
                figures[label] = float("nan")
                continue
            figures[label] = _median_ms(lambda product=product: product(x), repeat)
    return figures


def measure_products(files: ModelFiles, rows: list[int], repeat: int) -> dict:
    """ms per call of each kernel, per product and row count."""
    results: dict[str, dict] = {}
    for name in PRODUCTS:
        served = _served(files, name)
        rounded = quantize_int8(served.dequantize())
        int8 = QuantizedLinear(rounded, plan_quantized(rounded, torch.float32))
        results[name] = {str(count): _time_products(torch.randn(count, served.weight.shape[1]), served, int8, repeat)
                         for count in rows}
    return results


def torch_packed_exactness(files: ModelFiles) -> dict[str, float]:
    """How far torch's packed products move the file's weights (fp32 activations): int4pack over a
    Q4_1 layer, int8pack (per channel) over the Q8_0 head."""
    layer, head = _served(files, "gate_up 3072x576").source, _served(files, "lm_head 49152x576").source
    return {
        "torch int4pack over Q4_1 (gate_up)": torch_packed.weight_error(
            torch_packed.int4pack(layer, torch.float32), layer, torch.float32),
        "torch int8pack over Q8_0 requantized per channel (lm_head)": torch_packed.weight_error(
            torch_packed.int8pack(head, torch.float32), head, torch.float32),
    }


def _decode_step_ms(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """Median time of the steps in which every prompt decodes one token (after their prefills)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"decode-{len(prompts)}-{index}", prompt, params)
    while engine.last_step_tokens.decode < len(prompts):
        engine.step()
    clock, times = _clock(), []
    while engine.has_unfinished():
        start = clock()
        engine.step()
        times.append(clock() - start)
    return 1000 * statistics.median(times)


def measure_engine(engine: Engine, batches: list[int], decode_tokens: int, prefill_tokens: int) -> dict:
    """One format's engine figures (greedy outputs included, for the agreement against fp32)."""
    prompts = document_windows(engine, max(8, *batches), PROMPT_TOKENS)
    generate(engine, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    steps = {str(batch): _decode_step_ms(engine, prompts[:batch], decode_tokens) for batch in batches}
    long_prompt = document_windows(engine, 1, prefill_tokens)[0]
    clock = _clock()
    started = clock()
    generate(engine, [long_prompt], SamplingParams(max_tokens=1, temperature=0.0))
    prefill_ms = 1000 * (clock() - started)
    greedy = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
    return {
        "decode_step_ms": steps,
        "prefill_ms": prefill_ms,
        "perplexity": perplexity(engine, document_windows(engine, 8, WINDOW_TOKENS)),
        "greedy": [c.token_ids for c in generate(engine, prompts[:8], greedy)],
    }


def _print_products(results: dict) -> None:
    columns = list(next(iter(next(iter(results.values())).values())))
    print("| product | rows | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for name, per_rows in results.items():
        for count, figures in per_rows.items():
            print(f"| {name} | {count} | " + " | ".join(f"{figures[c]:.3f}" for c in columns) + " |")


def _print_engines(results: dict, batches: list[int], prefill_tokens: int) -> None:
    labels = list(results)
    print("| figure | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for batch in map(str, batches):
        print(f"| decode step, batch {batch}, ms | "
              + " | ".join(f"{results[label]['decode_step_ms'][batch]:.1f}" for label in labels) + " |")
    print(f"| prefill, one {prefill_tokens}-token prompt, ms | "
          + " | ".join(f"{results[label]['prefill_ms']:.0f}" for label in labels) + " |")
    base = results["fp32"]["perplexity"]
    print(f"| perplexity, 8 x {WINDOW_TOKENS} tokens | "
          + " | ".join(f"{results[label]['perplexity']:.3f} ({results[label]['perplexity'] / base - 1:+.2%})"
                       for label in labels) + " |")
    print(f"| greedy equal to fp32's for (of {AGREEMENT_TOKENS}) | "
          + " | ".join(str(results[label]["first_difference"]) for label in labels) + " |")


def main(argv: Sequence[str]) -> int:
    """Measure the products, then each engine format from one load; print both tables; write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--rows", default="1,4,8,16,32,512", help="comma-separated product row counts")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per product and row count")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-engines", action="store_true", help="the products table only")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, batches = [int(r) for r in args.rows.split(",")], [int(b) for b in args.batch.split(",")]
    files = load_model_files(None, torch.float32)
    cpu = f"{platform.processor() or platform.machine()}, kernels {kernels().describe()}"
    print(f"CPU: {cpu_model()} ({cpu}), {args.threads} thread(s), load average {load_average()}")
    products = measure_products(files, rows, args.repeat)
    _print_products(products)
    exactness = torch_packed_exactness(files)
    for label, error in exactness.items():
        print(f"- {label}: max |w' - w| = {error:.3g}")
    engines: dict[str, dict] = {}
    if not args.skip_engines:
        for label, fields in ENGINES.items():
            config = EngineConfig(cache=CacheConfig(enable_prefix_caching=False), **fields)  # type: ignore[arg-type]
            engines[label] = measure_engine(Engine(config, files=files), batches, args.decode_tokens,
                                            args.prefill_tokens)
        reference = engines["fp32"]["greedy"]
        for figures in engines.values():
            figures["first_difference"] = [first_difference(r, o)
                                           for r, o in zip(reference, figures.pop("greedy"), strict=True)]
        _print_engines(engines, batches, args.prefill_tokens)
    write_results(args.out, {"command": command_line(__name__, argv), "cpu": cpu_model(), "threads": args.threads,
                             "products": products, "torch_packed_exactness": exactness,
                             "engines": engines})
    return 0

