"""GPTQ and AWQ checkpoints of the shipped model load into exactly the weights packed into them,
and the engine serves them as an fp32 engine serves those weights dequantized.

One checkpoint packs every layer and is served. The other layouts pack the seven linear layers of
three of the 30 blocks (the same seven shapes, a tenth of the time) and hold nothing else: their
test reads the tensors and builds no model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import check_against
from safetensors.torch import save_file

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.loader import ModelFiles, load_model_files
from engine.model.quantized import QuantizedWeight
from engine.model.quantized_linear import QuantizedLinear
from engine.offline import generate
from engine.sampling_params import SamplingParams
from harness.quant_checkpoints import Layout, input_seed, is_linear, quantize, write_checkpoint

SERVED = "gptq_actorder_g64"
LAYOUTS = {
    SERVED: Layout("gptq", 64, act_order=True),
    "gptq_sym_g32": Layout("gptq", 32, sym=True, zero_biases=True),
    "gptq_v2_actorder_g32": Layout("gptq", 32, act_order=True, checkpoint_format="gptq_v2"),
    "awq_g64": Layout("awq", 64),
    "awq_g32": Layout("awq", 32),
}
SOME_LAYERS = (0, 15, 29)  # what the layouts other than SERVED pack
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
TEXTS = ("The capital of France is", "def add(a, b):\n", "Water boils at", "Once upon a time, in a small village,")


@pytest.fixture(scope="module")
def float_weights(model_files) -> dict[str, torch.Tensor]:
    """The shipped model's weights as fp32 tensors (its GGUF blocks dequantized)."""
    return {name: weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
            for name, weight in model_files.weights.items()}


@pytest.fixture(scope="module")
def shared(float_weights, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The served checkpoint's float tensors (embedding, norms) and tokenizer.json, written once."""
    directory = tmp_path_factory.mktemp("shared")
    floats = {name: weight for name, weight in float_weights.items() if not is_linear(name)}
    save_file(floats, str(directory / "float.safetensors"))
    tokenizer._backend.save(str(directory / "tokenizer.json"))  # any tokenizer.json of the vocabulary will do
    return {"float": directory / "float.safetensors", "tokenizer": directory / "tokenizer.json"}


@pytest.fixture(scope="module")
def checkpoint(model_files, float_weights, shared, tmp_path_factory):
    """`checkpoint(name)`: (layout, directory, the QuantizedWeights packed into it), built once."""
    built = {}

    def build(name: str) -> tuple[Layout, Path, dict[str, QuantizedWeight]]:
        if name not in built:
            layout = LAYOUTS[name]
            every_layer = name == SERVED
            linears = {layer: weight for layer, weight in float_weights.items()
                       if is_linear(layer) and (every_layer or _in_some_layer(layer))}
            packed = {layer: quantize(weight, layout, input_seed(layer)) for layer, weight in linears.items()}
            floats = [shared["float"]] if every_layer else []
            directory = tmp_path_factory.mktemp(name) / "model"
            write_checkpoint(directory, model_files.config, floats, packed, layout, shared["tokenizer"])
            built[name] = layout, directory, packed
        return built[name]

    return build


def _in_some_layer(name: str) -> bool:
    return any(name.startswith(f"model.layers.{index}.") for index in SOME_LAYERS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_packed_layer_loads_as_the_weight_packed_into_it(name, checkpoint, model_files):
    layout, directory, packed = checkpoint(name)
    files = load_model_files(str(directory), torch.float32)
    assert files.quantized_as == layout.method and files.stored_format == layout.method
    layers = model_files.config.num_layers if name == SERVED else len(SOME_LAYERS)
    assert files.quantized.keys() == packed.keys() and len(packed) == 7 * layers
    # Zero biases beside packed layers (gptq_sym_g32) are dropped: the model has none there.
    floats = model_files.weights.keys() - packed.keys() if name == SERVED else set()
    assert files.weights.keys() - files.quantized.keys() == floats
    for layer, expected in packed.items():
        loaded = files.quantized[layer]
        assert (loaded.bits, loaded.group_size) == (4, layout.group_size), layer
        assert torch.equal(loaded.q, expected.q), layer
        assert torch.equal(loaded.scale, expected.scale), layer
        assert torch.equal(loaded.offset, expected.offset), layer
        if layout.act_order:
            assert torch.equal(loaded.perm, expected.perm), layer
        else:
            assert loaded.perm is None, layer
    one = "model.layers.15.mlp.down_proj.weight"
    assert torch.equal(files.quantized[one].dequantize(), packed[one].dequantize())


def test_the_engine_serves_the_checkpoint_as_fp32_serves_its_dequantized_weights(checkpoint, model_files,
                                                                                  float_weights, tokenizer):
    _, directory, packed = checkpoint(SERVED)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    config = EngineConfig(dtype="float32", cpu_weights="plain", cache=CacheConfig(num_blocks=16, memory_bytes=None))
    served = Engine(replace(config, model=str(directory), quantization="gptq"))
    # Served as packed: every layer product goes through the quantized kernels, none dequantized.
    assert all(isinstance(linear, QuantizedLinear)
               for layer in served.runner.model.layers for linear in layer.linears.values())
    dequantized = {name: weight.dequantize() for name, weight in packed.items()}
    floats = {name: w for name, w in float_weights.items() if name not in packed}
    reference = Engine(config, files=ModelFiles(model_files.config, floats | dequantized, str(directory), "hf",
                                                torch.float32))
    ours = [run.token_ids for run in generate(served, prompts, GREEDY)]
    runs = generate(reference, prompts, GREEDY)
    margins = [[lp.top[0][1] - lp.top[1][1] for lp in run.logprobs] for run in runs]
    check_against(ours, [run.token_ids for run in runs], margins, "gptq vs fp32 on its dequantized weights")
