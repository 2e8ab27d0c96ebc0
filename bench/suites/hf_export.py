"""Export the shipped GGUF model as an HF directory (fp32 safetensors + tokenizer) for the baselines.

transformers dequantizes a GGUF on load but refuses to save a model that still carries the GGUF
quantization config, so the weights are moved into a fresh LlamaForCausalLM and saved from there.
vLLM loads the same directory, so every system in the benchmark runs identical fp32 weights.
engine_throughput and goodput run this suite themselves when the export is missing.

    python -m bench hf_export [--gguf PATH] [--out bench/.cache/smollm2-hf]
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from bench.common.paths import HF_EXPORT_DIR
from bench.common.suite import suite_parser
from harness.paths import REPO


def export_hf(gguf_path: str, out_dir: str) -> str:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files) unless it already exists."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Save into a sibling folder and rename, so an interrupted export never looks finished.
    partial = out_dir + ".partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, out_dir)
    return out_dir


def ensure_export() -> None:
    """Run this suite in a process of its own (the export loads transformers and the whole model)
    unless the export is already there."""
    if not (HF_EXPORT_DIR / "config.json").exists():
        subprocess.run([sys.executable, "-m", "bench", "hf_export", "--out", str(HF_EXPORT_DIR)], cwd=REPO,
                       check=True)


def main(argv: Sequence[str]) -> int:
    """Export the model; print the export directory."""
    from engine.model.paths import default_model_path

    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    parser.add_argument("--out", default=str(HF_EXPORT_DIR))
    args = parser.parse_args(argv)
    print(export_hf(args.gguf or default_model_path(), args.out))
    return 0
