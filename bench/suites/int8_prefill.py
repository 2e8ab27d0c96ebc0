"""Would int8 linears make prefill fast enough to matter, and keep the model's answers?

A probe for issue 4's "faster prefill" lever, not a serving path: the engine stays fp32. It loads
the shipped model once (one torch thread, exact fp32 weights pre-packed for oneDNN; no prefix cache), then
swaps every decoder layer's linears for fbgemm's dynamically quantized int8 product (weights int8
per output channel; activations quantized per call), in three variants:

- `per-tensor`: one activation scale per call, what `quantize_dynamic` does;
- `per-token`: each row of the activations scaled to unit max first and the output rows scaled
  back, so that the single scale fbgemm uses amounts to one scale per token;
- `smoothed`: per token, after SmoothQuant's channel scaling, calibrated on docs/benchmarks.md
  (a document the perplexity windows do not come from).

The LM head stays fp32 in both. For each variant and for fp32 it reports the mean prefill time of
256-token prompts (fp32 measured in the same run, so the ratio is what counts) and how long greedy
decoding agrees with fp32 (the index of the first differing token over 48 tokens, per prompt) and
the perplexity of 512-token windows of text (teacher-forced, so independent of where greedy
decoding happens to fork). Prompts and windows come from this repository's README and
architecture document.

    python -m bench int8_prefill [--prompts 6] [--timed 4]
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch

from bench.common.model_quality import document_windows, first_difference, perplexity
from bench.common.suite import command_line, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.linear import Linear
from engine.offline import generate
from engine.sampling_params import SamplingParams

PROMPT_TOKENS = 256
OUTPUT_TOKENS = 48
WINDOW_TOKENS = 512
CALIBRATION_DOCUMENTS = ("docs/benchmarks.md",)  # smoothing is calibrated on text it is not scored on


class Int8Linear:
    """y = x·Wᵀ through fbgemm's dynamic int8 product (no bias: the shipped model has none)."""

    def __init__(self, weight: torch.Tensor, per_token: bool, smoothing: torch.Tensor | None = None) -> None:
        weight = weight.detach().float()
        # SmoothQuant: divide activation channels by s and multiply the weight's columns by s, with
        # s = sqrt(max |x_c| / max |w_c|), which moves outlier channels' range into the weight.
        self._smoothing = None
        if smoothing is not None:
            self._smoothing = (smoothing / weight.abs().amax(0).clamp_min(1e-5)).sqrt().clamp_min(1e-5)
            weight = weight * self._smoothing
        scales = weight.abs().amax(1).clamp_min(1e-8) / 127
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        self._per_token = per_token

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._smoothing is not None:
            x = x / self._smoothing
        if not self._per_token:
            return torch.ops.quantized.linear_dynamic(x, self._packed, True)
        rows = x.abs().amax(1, keepdim=True).clamp_min(1e-6)
        return torch.ops.quantized.linear_dynamic(x / rows, self._packed, True) * rows


class ChannelRange:
    """Passes products through to an fp32 linear and keeps each input channel's largest |x|."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear
        self.weight = linear.weight
        self.max_abs: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.abs().amax(0)
        self.max_abs = seen if self.max_abs is None else torch.maximum(self.max_abs, seen)
        return self.linear(x)


def _measure(engine: Engine, prompts: list[list[int]], timed: int) -> tuple[float, list[list[int]]]:
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    generate(engine, [prompts[0]], greedy)  # warm-up
    started = time.perf_counter()
    for prompt in prompts[:timed]:
        generate(engine, [prompt], greedy)
    prefill_s = (time.perf_counter() - started) / timed
    long = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    return prefill_s, [completion.token_ids for completion in generate(engine, prompts, long)]


def main(argv: Sequence[str]) -> int:
    """Every variant against fp32 on one engine; the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--timed", type=int, default=4, help="prompts timed for the prefill figure")
    parser.add_argument("--perplexity-windows", type=int, default=8, help=f"{WINDOW_TOKENS}-token windows scored")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # torch's quantized-tensor API warns that it is deprecated
    torch.set_num_threads(1)
    torch.backends.quantized.engine = "fbgemm"
    # No prefix cache: every variant must compute every prompt itself.
    engine = Engine(EngineConfig(cache=CacheConfig(enable_prefix_caching=False), cpu_weights="fp32",
                                 quantization="none"))
    layers = engine.runner.model.layers
    fp32 = [dict(layer.linears) for layer in layers]
    prompts = document_windows(engine, args.prompts, PROMPT_TOKENS)
    windows = document_windows(engine, args.perplexity_windows, WINDOW_TOKENS)
    ranges = [{name: ChannelRange(linear) for name, linear in linears.items()} for linears in fp32]
    for layer, layer_ranges in zip(layers, ranges, strict=True):
        layer.linears.update(layer_ranges)
    perplexity(engine, document_windows(engine, args.perplexity_windows, WINDOW_TOKENS, CALIBRATION_DOCUMENTS))
    results: dict[str, dict] = {}
    reference: list[list[int]] = []
    for variant in ("fp32", "per-tensor", "per-token", "smoothed"):
        for layer, linears, layer_ranges in zip(layers, fp32, ranges, strict=True):
            if variant == "fp32":
                layer.linears.update(linears)
                continue
            layer.linears.update({name: Int8Linear(linear.weight, per_token=variant != "per-tensor",
                                                   smoothing=layer_ranges[name].max_abs if variant == "smoothed"
                                                   else None)
                                  for name, linear in linears.items()})
        prefill_s, outputs = _measure(engine, prompts, args.timed)
        score = perplexity(engine, windows)
        reference = reference or outputs
        agreement = [first_difference(ref, out) for ref, out in zip(reference, outputs, strict=True)]
        baseline_s = results["fp32"]["prefill_s"] if results else prefill_s
        results[variant] = {"prefill_s": prefill_s, "speedup": baseline_s / prefill_s, "first_difference": agreement,
                            "perplexity": score}
        print(f"{variant:>10}: prefill {prefill_s * 1000:6.0f} ms per {PROMPT_TOKENS}-token prompt "
              f"({results[variant]['speedup']:.2f}x fp32); perplexity {score:.3f}; greedy agrees with "
              f"fp32 for {agreement} of {OUTPUT_TOKENS} tokens", flush=True)
    write_results(args.out, {"command": command_line(__name__, argv), "results": results})
    return 0

