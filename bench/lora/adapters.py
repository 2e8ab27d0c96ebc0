"""The lora suite's adapters: random PEFT LoRA adapters over the shipped base (its HF export's
shapes), saved once under bench/.cache/lora-adapters/ and reused by every later run and by both
systems. Built by harness.lora_adapters (peft, `init_lora_weights=False`, so B is not zero and
every adapter changes what the model computes), rank 16 on q, k, v, o, gate, up and down of every
layer, adapter i seeded with i."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.common.paths import CACHE_DIR, HF_EXPORT_DIR

ADAPTERS_DIR = CACHE_DIR / "lora-adapters"
RANK = 16


def adapter_name(index: int) -> str:
    """The name adapter `index` is served and cached under."""
    return f"r{RANK}-seed{index}"


def ensure_adapters(count: int, root: Path = ADAPTERS_DIR, base: Path = HF_EXPORT_DIR) -> list[tuple[str, str]]:
    """(name, directory) of adapters 0..count-1 for the HF model in `base`, each built unless a
    finished one is cached in `root` (written to a sibling folder and renamed, so an interrupted
    build never looks finished)."""
    adapters = []
    missing = []
    for index in range(count):
        directory = root / adapter_name(index)
        adapters.append((adapter_name(index), str(directory)))
        if not (directory / "adapter_model.safetensors").exists():
            missing.append((index, directory))
    if missing:
        from engine.model.hf_loader import config_from_hf
        from harness.lora_adapters import save_adapter

        model = config_from_hf(json.loads((base / "config.json").read_text()))
        for index, directory in missing:
            partial = directory.with_name(directory.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            save_adapter(partial, model, RANK, seed=index)
            partial.rename(directory)
    return adapters
