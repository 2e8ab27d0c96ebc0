"""Export the shipped GGUF model as an HF directory (fp32 safetensors + tokenizer) for the baselines.

transformers dequantizes a GGUF on load but refuses to save a model that still carries the GGUF
quantization config, so the weights are moved into a fresh LlamaForCausalLM and saved from there.
vLLM loads the same directory, so every system in the benchmark runs identical fp32 weights.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_EXPORT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache", "smollm2-hf")


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


def main(argv: list[str] | None = None) -> int:
    """`python bench/hf_export.py [--gguf PATH] [--out DIR]`; prints the export directory."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from engine.model.loader import default_model_path

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    parser.add_argument("--out", default=DEFAULT_EXPORT_DIR)
    args = parser.parse_args(argv)
    print(export_hf(args.gguf or default_model_path(), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
