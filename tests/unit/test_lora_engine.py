"""LoRA adapters served by the engine over the real shipped base (`--dtype float32 --quantization
none`), against transformers + peft on the same base: three adapters of ranks 8 and 16 on every
projection, built by peft with random A and B (`init_lora_weights=False`: peft's default zeroes B,
and no test could fail), greedy alone and in one batch mixing the base and the three; blocks
never shared across adapters; slots reused and requests held back when every slot is busy."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from reference import EXACT_FORMATS, check_against, first_divergence, reference_greedy

from engine.config import CacheConfig, LoraConfig
from engine.lora.registry import UnknownAdapter
from engine.offline import generate
from engine.sampling_params import SamplingParams

MAX_TOKENS = 12
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"rank8-a": (8, 1), "rank16": (16, 2), "rank8-b": (8, 3)}  # name: (rank, seed)


def _greedy(lora_name: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2, lora_name=lora_name)


@pytest.fixture(scope="module")
def adapters(reference_model, tmp_path_factory) -> tuple[dict[str, Path], torch.nn.Module]:
    """The adapters saved by peft (name -> directory), and the peft model holding all three over a
    copy of transformers' own load of the shipped base."""
    root = tmp_path_factory.mktemp("adapters")
    peft_model = None
    paths = {}
    for name, (rank, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        config = PeftLoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES, init_lora_weights=False)
        if peft_model is None:
            peft_model = get_peft_model(copy.deepcopy(reference_model), config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
        paths[name] = root / name
    assert peft_model is not None
    for name, path in paths.items():
        peft_model.save_pretrained(str(root), selected_adapters=[name])  # peft puts each under root/name
        assert (path / "adapter_model.safetensors").exists()
    return paths, peft_model.eval()


@pytest.fixture(scope="module")
def make_engine(make_engine, adapters):
    paths, _ = adapters
    modules = tuple((name, str(path)) for name, path in paths.items())
    return functools.partial(make_engine, **EXACT_FORMATS,
                             lora=LoraConfig(max_loras=3, max_lora_rank=16, modules=modules))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["The three primary colours are", "Once upon a time, in a small village,",
             "A short list of prime numbers: 2, 3, 5,", "Water boils at"]
    return [tokenizer.encode(t) for t in texts]


def _expected(peft_model, prompt: list[int], name: str) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        if not name:
            with peft_model.disable_adapter():
                run = reference_greedy(peft_model, prompt, MAX_TOKENS)
        else:
            peft_model.set_adapter(name)
            run = reference_greedy(peft_model, prompt, MAX_TOKENS)
    return run.token_ids, run.margins


def test_each_adapter_alone_and_a_batch_mixing_the_base_and_three_adapters_match_peft(make_engine, adapters,
                                                                                      prompts):
    _, peft_model = adapters
    names = ["", *ADAPTERS]  # the base, then each adapter
    expected = [_expected(peft_model, prompt, name) for prompt, name in zip(prompts, names, strict=True)]
    engine = make_engine(cache=CacheConfig(enable_prefix_caching=False))
    alone = [generate(engine, [prompt], _greedy(name))[0].token_ids for prompt, name in zip(prompts, names,
                                                                                              strict=True)]
    together = [run.token_ids for run in generate(engine, prompts, [_greedy(name) for name in names])]
    for label, ours in (("alone", alone), ("in one batch", together)):
        check_against(ours, [ids for ids, _ in expected], [margins for _, margins in expected], label)
    # The adapters change the output (a test that could not fail otherwise).
    base_runs = generate(engine, prompts[1:], _greedy())
    assert all(run.token_ids != ours for run, ours in zip(base_runs, together[1:], strict=True))


def test_a_prompt_cached_under_the_base_is_computed_afresh_under_an_adapter(make_engine, adapters, prompts):
    _, peft_model = adapters
    engine = make_engine()
    prompt = prompts[1] * 4  # several full blocks
    assert generate(engine, [prompt], _greedy())[0].num_cached_tokens == 0
    assert generate(engine, [prompt], _greedy())[0].num_cached_tokens > 0  # the base reuses its own
    under_adapter = generate(engine, [prompt], _greedy("rank16"))[0]
    assert under_adapter.num_cached_tokens == 0
    ids, margins = _expected(peft_model, prompt, "rank16")
    check_against([under_adapter.token_ids], [ids], [margins], "after the base cached the prompt")
    assert generate(engine, [prompt], _greedy("rank16"))[0].num_cached_tokens > 0  # its own blocks it reuses


def test_more_adapters_than_slots_wait_for_one_and_reuse_it(make_engine, adapters, prompts):
    _, peft_model = adapters
    engine = make_engine(lora=LoraConfig(max_loras=1, max_lora_rank=16,
                                         modules=tuple((n, str(p)) for n, p in adapters[0].items())))
    names = list(ADAPTERS)
    runs = generate(engine, prompts[:3], [_greedy(name) for name in names])
    expected = [_expected(peft_model, prompt, name) for prompt, name in zip(prompts, names, strict=False)]
    check_against([r.token_ids for r in runs], [ids for ids, _ in expected], [m for _, m in expected],
                  "three adapters through one slot")
    assert engine.adapters is not None and engine.adapters.registry.slotted == ("rank8-b",)


def test_an_unknown_adapter_and_an_engine_without_adapters_are_refused(make_engine, prompts):
    with pytest.raises(UnknownAdapter, match="'nope'"):
        make_engine().add_request("r", prompts[0], _greedy("nope"))
    with pytest.raises(ValueError, match="--enable-lora"):
        make_engine(lora=None).add_request("r", prompts[0], _greedy("rank16"))


@pytest.mark.parametrize(("quantization", "dtype"), [("gguf", "float32"), ("int8", "float32"), ("none", "bfloat16")],
                         ids=["gguf-blocks", "int8", "bf16"])
def test_an_adapter_over_a_base_in_another_weight_format_tracks_fp32_with_the_adapter(make_engine, adapters, prompts,
                                                                                       quantization, dtype):
    """The adapter adds to whatever product the base runs: over the file's own blocks (the weights
    fp32 dequantizes, so tokens may differ only at fp32's near-ties), int8 or bf16 weights (other
    weights: judged as those formats are without adapters, test_quantization_fidelity, by their
    greedy agreement with fp32, printed; each prompt's first token at least)."""
    _, peft_model = adapters
    engine = make_engine(quantization=quantization, dtype=dtype, cpu_weights="plain",
                         cache=CacheConfig(enable_prefix_caching=False))
    assert engine.formats.quantization == quantization
    ours = [run.token_ids for run in generate(engine, prompts[:2], _greedy("rank16"))]
    expected = [_expected(peft_model, prompt, "rank16") for prompt in prompts[:2]]
    reference = [ids for ids, _ in expected]
    agreement = [MAX_TOKENS if at is None else at for at in map(first_divergence, ours, reference)]
    print(f"{quantization} {dtype} base under rank16: greedy tokens equal to fp32's before the first difference "
          f"(of {MAX_TOKENS}): {agreement}")
    if quantization == "gguf":
        check_against(ours, reference, [margins for _, margins in expected], "the file's blocks under rank16")
    else:
        assert all(o[0] == r[0] for o, r in zip(ours, reference, strict=True))
    # The adapter is applied over this format (a test that could not fail otherwise).
    assert [run.token_ids for run in generate(engine, prompts[:2], _greedy())] != ours
