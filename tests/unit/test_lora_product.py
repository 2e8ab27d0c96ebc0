"""LoRA adapters at the level of one layer's products: PEFT adapters (built by peft with random A
and B: `init_lora_weights=False`, since peft's default zeroes B and no test could then fail) read by
engine.lora.adapter, held in slots, and added per row group by engine.lora.product, against peft's
own modules on a random Llama; and every adapter the loader refuses, with the reason named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import LlamaConfig

from engine.attention.reference import TorchPagedAttention
from engine.lora import batch
from engine.lora.adapter import AdapterError, load_adapter
from engine.lora.batch import LoraBatch
from engine.lora.serving import attach_lora
from engine.lora.slots import LoraSlots
from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable
from engine.model.loader import build_model, load_model_files
from tests.unit.test_model_hf import save_random_model

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("llama")
    return directory, save_random_model(CONFIG, directory)


def _adapter(base_model: torch.nn.Module, directory: Path, rank: int, seed: int, **config) -> torch.nn.Module:
    """A PEFT adapter of `rank` with random A and B saved in `directory`; the peft model."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(base_model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES,
                                                       init_lora_weights=False, **config))
    peft_model.save_pretrained(directory)
    return peft_model


@pytest.mark.parametrize("form", ["masked", "grouped-by-index", "grouped-by-runs",
                                  *(f"kernel-{variant.name}" for variant in runnable(cpu_flags()))])
def test_mixed_rows_of_the_base_and_two_adapters_match_peft_module_by_module(base, tmp_path, monkeypatch, form):
    if form.startswith("grouped"):
        monkeypatch.setattr(batch, "MASKED_ROWS", 0)
    if form == "grouped-by-runs":
        monkeypatch.setattr(batch, "RUN_ROWS", 1)
    directory, reference = base
    files = load_model_files(directory, torch.float32)
    model = build_model(files, TorchPagedAttention(), "cpu", dtype=torch.float32)
    adapters = {}
    expected_modules = {}
    for name, rank, seed in (("eight", 8, 1), ("sixteen", 16, 2)):
        peft_model = _adapter(save_random_model(CONFIG, tmp_path / f"base-{name}"), tmp_path / name, rank, seed)
        adapters[name] = load_adapter(name, tmp_path / name, files.config, max_rank=16, dtype=torch.float32)
        expected_modules[name] = {m: peft_model.base_model.model.model.layers[1].self_attn.get_submodule(m)
                                  if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                                  else peft_model.base_model.model.model.layers[1].mlp.get_submodule(m)
                                  for m in MODULES}
    step = model.lora_step
    slots = LoraSlots(files.config, count=3, max_rank=16, dtype=torch.float32,
                      products=tuple(model.layers[0].linears))
    slots.load(0, adapters["sixteen"].rank, adapters["sixteen"].weights)
    slots.load(2, adapters["eight"].rank, adapters["eight"].weights)
    attach_lora(model, slots)
    assert step.lora_add == kernels().lora_add_  # a CPU model's plan hands its kernels' op to every step
    kernel = form.startswith("kernel-")
    step.lora_add = kernels(form.removeprefix("kernel-")).lora_add_ if kernel else None
    # Rows: base, sixteen, eight, sixteen (its rows in two runs), base.
    row_slots = [(None, 2), (0, 3), (2, 2), (0, 1), (None, 1)]
    which = ["base"] * 2 + ["sixteen"] * 3 + ["eight"] * 2 + ["sixteen"] + ["base"]
    step.batch = LoraBatch.of(row_slots, slots.width, slots.dtype, kernel)
    assert (step.batch.mask is not None) == (form == "masked")
    assert (step.batch.order is not None) == kernel
    assert not form.startswith("grouped") or [isinstance(g.rows, slice) for g in step.batch.groups] == (
        [True, True, True] if form == "grouped-by-runs" else [False, True])  # slot 0's two runs, then slot 2's
    layer = model.layers[1]
    torch.manual_seed(3)
    x_attn, x_mlp = torch.randn(9, CONFIG.hidden_size), torch.randn(9, CONFIG.intermediate_size)
    ours = {"qkv": layer.linears["qkv"](x_attn), "o": layer.linears["o"](x_attn),
            "gate_up": layer.linears["gate_up"](x_attn), "down": layer.linears["down"](x_mlp)}
    base_layer = reference.model.layers[1]
    for row, adapter in enumerate(which):
        def module(name: str, adapter: str = adapter) -> torch.nn.Module:
            if adapter == "base":
                block = base_layer.self_attn if name in MODULES[:4] else base_layer.mlp
                return block.get_submodule(name)
            return expected_modules[adapter][name]

        with torch.no_grad():
            qkv = torch.cat([module(m)(x_attn[row]) for m in ("q_proj", "k_proj", "v_proj")])
            gate_up = torch.cat([module(m)(x_attn[row]) for m in ("gate_proj", "up_proj")])
            expected = {"qkv": qkv, "o": module("o_proj")(x_attn[row]), "gate_up": gate_up,
                        "down": module("down_proj")(x_mlp[row])}
        for product, value in expected.items():
            torch.testing.assert_close(ours[product][row], value, rtol=1e-5, atol=1e-5,
                                       msg=f"row {row} ({adapter}) {product}")
    # The terms differ from the base's (a test that could not fail otherwise).
    step.batch = LoraBatch.of([(None, 9)], slots.width, slots.dtype)
    assert not torch.allclose(layer.linears["qkv"](x_attn)[2:5], ours["qkv"][2:5])


def _write(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


def _lora(layer: int, block: str, module: str, rank: int, out: int, inp: int) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
    return {f"{prefix}.lora_A.weight": torch.randn(rank, inp), f"{prefix}.lora_B.weight": torch.randn(out, rank)}


@pytest.mark.parametrize(("config", "tensors", "reason"), [
    ({"r": 32, "lora_alpha": 32, "target_modules": ["q_proj"]}, _lora(0, "self_attn", "q_proj", 32, 64, 64),
     "rank 32 is above --max-lora-rank 16"),
    ({"r": 8, "target_modules": ["q_proj"], "use_dora": True}, _lora(0, "self_attn", "q_proj", 8, 64, 64),
     "use_dora=True is not served"),
    ({"r": 8, "target_modules": ["embed_tokens"]}, _lora(0, "self_attn", "q_proj", 8, 64, 64),
     "target module(s) embed_tokens not served"),
    ({"r": 8, "target_modules": ["q_proj"]}, _lora(0, "self_attn", "q_proj", 8, 128, 64),
     "do not fit the base's 64x64 projection"),
    ({"r": 8, "target_modules": ["q_proj"]}, _lora(5, "self_attn", "q_proj", 8, 64, 64),
     "layer 5, but the base has 2 layers"),
    ({"r": 8, "peft_type": "PREFIX_TUNING"}, {}, "peft_type 'PREFIX_TUNING' is not LORA"),
    ({"r": 8, "target_modules": ["c_attn"]},
     {"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.randn(8, 64)},
     "target module(s) c_attn not served"),
])
def test_an_adapter_that_cannot_be_served_is_refused_naming_it_and_the_reason(base, tmp_path, config, tensors,
                                                                              reason):
    directory, _ = base
    model = load_model_files(directory, torch.float32).config
    path = _write(tmp_path / "adapter", config, tensors)
    with pytest.raises(AdapterError) as refused:
        load_adapter("tenant-a", path, model, max_rank=16, dtype=torch.float32)
    assert "'tenant-a'" in str(refused.value) and reason in str(refused.value)


def test_a_missing_weights_file_and_a_missing_directory_are_refused(base, tmp_path):
    model = load_model_files(base[0], torch.float32).config
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(AdapterError, match=r"no adapter_model\.safetensors"):
        load_adapter("a", tmp_path / "empty", model, max_rank=16, dtype=torch.float32)
    with pytest.raises(AdapterError, match="not a directory"):
        load_adapter("a", tmp_path / "nowhere", model, max_rank=16, dtype=torch.float32)


def test_the_fingerprint_follows_the_weights_not_the_name(base, tmp_path):
    model = load_model_files(base[0], torch.float32).config
    torch.manual_seed(0)
    tensors = _lora(0, "self_attn", "q_proj", 8, 64, 64)
    one = _write(tmp_path / "one", {"r": 8, "target_modules": ["q_proj"]}, tensors)
    two = _write(tmp_path / "two", {"r": 8, "target_modules": ["q_proj"], "lora_alpha": 16}, tensors)
    first = load_adapter("a", one, model, max_rank=16, dtype=torch.float32)
    assert load_adapter("b", one, model, max_rank=16, dtype=torch.float32).fingerprint == first.fingerprint
    assert load_adapter("a", two, model, max_rank=16, dtype=torch.float32).fingerprint != first.fingerprint
