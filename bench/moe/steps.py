"""The moe suite's in-process figures, on this process's torch threads:

1. the engine's grouped MoE layer (layer 0's `SparseMoE`, as the engine builds it) against the
   per-expert reference (bench.moe.layer) on the same decode rows, at each batch;
2. the whole model's decode step, MoE against the dense model of the same active parameters.

Both at each format of FORMATS, each a fresh engine build (engine.engine_model.load_engine_model)
from the same loaded files, so the "defaults" rows are what `--dtype auto` resolves to here.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.moe.layer import ReferenceMoE, layer_input
from bench.moe.models import Checkpoints, decode_step_ms, engine_model, median_ms, q8_0_files
from engine.engine_model import EngineModel
from engine.model.loader import ModelFiles, load_model_files

# label -> (the files it loads: the HF checkpoint's or their Q8_0 blocks, EngineConfig fields)
FORMATS: dict[str, tuple[str, dict[str, str]]] = {
    "HF checkpoint, defaults": ("hf", {}),
    "GGUF Q8_0 blocks, defaults": ("q8_0", {}),
    "fp32 exact": ("hf", {"dtype": "float32", "quantization": "none", "cpu_weights": "fp32"}),
}
TARGETED = ("HF checkpoint, defaults", "GGUF Q8_0 blocks, defaults")  # the formats the layer target is for


@dataclass(frozen=True)
class StepSettings:
    batches: list[int]
    context: int  # tokens each sequence holds before the timed decode step
    repeats: int  # timed calls per figure (their median)


def _format_files(kind: str, files: ModelFiles) -> ModelFiles:
    return q8_0_files(files) if kind == "q8_0" else files


def measure_reference(files: ModelFiles, settings: StepSettings) -> dict[str, float]:
    """The reference layer's median ms at each batch (its fp32 weights, whatever the format)."""
    moe = files.config.moe
    assert moe is not None
    reference = ReferenceMoE.from_weights(moe, files.weights, 0)
    inputs = {b: layer_input(b, files.config.hidden_size, torch.float32) for b in settings.batches}
    return {str(b): median_ms(lambda b=b: reference(inputs[b]), settings.repeats) for b in settings.batches}


def measure_format(label: str, moe_files: ModelFiles, dense_files: ModelFiles, settings: StepSettings) -> dict:
    """One format's figures: its resolved formats, the grouped layer's ms and its distance from the
    reference, and both models' decode-step ms, at each batch. One model is held at a time."""
    kind, fields = FORMATS[label]
    top = max(settings.batches)
    built = engine_model(_format_files(kind, moe_files), fields, top, settings.context)
    figures: dict = {"fields": fields, **_moe_figures(built, moe_files, settings)}
    del built
    gc.collect()
    dense = engine_model(_format_files(kind, dense_files), fields, top, settings.context)
    figures["dense_step_ms"] = {str(b): decode_step_ms(dense, b, settings.context, settings.repeats)
                                for b in settings.batches}
    # The dense model's products may all run as one decode-stack call (engine.model.decode_stack),
    # which a MoE layer does not take: recorded, since it is part of what the ratio compares.
    figures["dense_decode_stack"] = dense.model.stacked is not None
    del dense
    gc.collect()
    return figures


def _moe_figures(built: EngineModel, files: ModelFiles, settings: StepSettings) -> dict:
    layer = built.model.layers[0].moe
    assert layer is not None
    inputs = {b: layer_input(b, files.config.hidden_size, built.dtype) for b in settings.batches}
    return {
        "resolved": built.formats.describe(),
        "dtype": str(built.dtype).removeprefix("torch."),
        "layer_ms": {str(b): median_ms(lambda b=b: _no_grad(layer, inputs[b]), settings.repeats)
                     for b in settings.batches},
        "layer_error": layer_error(layer, files, max(settings.batches), built.dtype),
        "moe_step_ms": {str(b): decode_step_ms(built, b, settings.context, settings.repeats)
                        for b in settings.batches},
    }


Layer = Callable[[torch.Tensor], torch.Tensor]  # the engine's MoE of one layer: [T, hidden] -> [T, hidden]


@torch.inference_mode()
def _no_grad(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def layer_error(layer: Layer, files: ModelFiles, batch: int, dtype: torch.dtype) -> float:
    """max |grouped - reference| / max |reference| over `batch` rows: the grouped layer computes the
    same function (exactly in fp32; within its format's rounding otherwise)."""
    moe = files.config.moe
    assert moe is not None
    x = layer_input(batch, files.config.hidden_size, torch.float32, seed=1)
    expected = ReferenceMoE.from_weights(moe, files.weights, 0)(x)
    got = _no_grad(layer, x.to(dtype)).float()
    return float((got - expected).abs().max() / expected.abs().max())


def measure_all(paths: Checkpoints, settings: StepSettings, labels: list[str]) -> dict:
    """The reference, then every format in `labels`: figures 1 and 2."""
    moe_files = load_model_files(str(paths.moe), torch.float32)
    dense_files = load_model_files(str(paths.dense), torch.float32)
    results: dict = {"reference_ms": measure_reference(moe_files, settings), "formats": {}}
    for label in labels:
        results["formats"][label] = measure_format(label, moe_files, dense_files, settings)
    return results


def layer_table(results: dict, target_batch: int, target: float) -> str:
    """Figure 1: the grouped layer against the reference at each format and batch."""
    lines = ["| format (dtype) | batch | per-expert reference fp32 (ms) | grouped SparseMoE (ms) | speed-up | "
             "max error / max |ref| |", "|---|---:|---:|---:|---:|---:|"]
    for label, figures in results["formats"].items():
        for batch, ms in figures["layer_ms"].items():
            speedup = results["reference_ms"][batch] / ms
            verdict = "meets" if speedup >= target else "misses"
            mark = f" ({verdict} ≥ {target:g}x)" if int(batch) == target_batch and label in TARGETED else ""
            lines.append(f"| {label} ({figures['dtype']}) | {batch} | {results['reference_ms'][batch]:.3f} | "
                         f"{ms:.3f} | {speedup:.2f}x{mark} | {figures['layer_error']:.1e} |")
    return "\n".join(lines)


def step_table(results: dict) -> str:
    """Figure 2: the MoE model's decode step against the dense model of the same active parameters."""
    lines = ["| format (dtype) | batch | MoE step (ms) | dense step (ms) | MoE / dense |", "|---|---:|---:|---:|---:|"]
    for label, figures in results["formats"].items():
        stack = ", dense in one decode-stack call" if figures["dense_decode_stack"] else ""
        for batch, ms in figures["moe_step_ms"].items():
            dense = figures["dense_step_ms"][batch]
            lines.append(f"| {label} ({figures['dtype']}{stack}) | {batch} | {ms:.2f} | {dense:.2f} | "
                         f"{ms / dense:.2f}x |")
    return "\n".join(lines)
