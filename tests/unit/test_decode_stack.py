"""The decode stack (engine.model.decode_stack): a small decode batch's layers as one kernel call
(a speculative verification's rows too) compute the same bits and write the same pages as the layers
one op at a time in fp32, stay as close to fp32 as the layers in bf16, and it steps aside for every
step it does not serve."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import SHORT_QUERY, TorchPagedAttention
from engine.config import ModelConfig, MoEConfig
from engine.model.decode_stack import DecodeStack
from engine.model.kernels import kernels
from engine.model.kernels.build import cpu_flags, runnable
from engine.model.llama import LlamaForCausalLM, ModelPlan
from engine.model.product_plan import BF16_MIN_ROWS, FP16_MIN_ROWS
from engine.model.quantized import QuantizedWeight
from engine.model.weight_formats import WeightFormat
from engine.sampling_params import SamplingParams

VARIANTS = [variant.name for variant in runnable(cpu_flags())]
BLOCK_SIZE = 4
NUM_BLOCKS = 32
# Small shapes of the shipped model's kind (GQA, head_dim a multiple of 8), with Qwen2's QKV bias.
CONFIG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, attention_bias=True)
# The same with a mixture of experts in every layer (Mixtral's and Qwen3-MoE's kind: no shared expert).
MOE_CONFIG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64,
                                                                    normalize_top_k=True))


def _q4_1(rows: int, cols: int, gen: torch.Generator) -> QuantizedWeight:
    # GGUF Q4_1's shape: groups of 32 unsigned 4-bit values with a scale and an offset.
    groups = cols // 32
    return QuantizedWeight(q=torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
                           scale=torch.rand(rows, groups, generator=gen) * 0.02,
                           offset=-torch.rand(rows, groups, generator=gen) * 0.15, bits=4, group_size=32)


def _random_model(variant: str, dtype: torch.dtype = torch.float32, stacked: bool = True,
                  config: ModelConfig = CONFIG) -> LlamaForCausalLM:
    """The same random weights in either dtype (fp32: with the fp16 copy, as --dtype auto serves it
    on a CPU without native bf16), the products on the same build as the stack, so that both round
    alike; with `stacked`, small decode steps run as the stack."""
    ops = kernels(variant)
    gen = torch.Generator().manual_seed(0)
    fp32 = dtype == torch.float32
    stack = functools.partial(DecodeStack.build, ops=ops) if stacked else None
    plan = ModelPlan(ops.rms_norm, ops.rotary, ops.silu_mul, stack) if fp32 else ModelPlan(decode_stack=stack)
    model = LlamaForCausalLM(config, TorchPagedAttention(dense_decode=ops.decode_attention), plan)
    model.to(dtype=dtype)
    weights = {}
    for name, shape in model._weight_shapes().items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = _q4_1(*shape, gen)
    model.load_weights(weights, WeightFormat("gguf", dtype, "cpu", "fp16" if fp32 else "plain", ops=ops))
    return model


def _decode_batch(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One new token for each of `batch` sequences of 5 to 14 cached tokens, on disjoint blocks."""
    lens = torch.randint(6, 15, (batch,), generator=gen).tolist()
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = -(-max(lens) // BLOCK_SIZE)
    tables = [[blocks.pop() for _ in range(width)] for _ in range(batch)]
    slots = [tables[b][(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for b, n in enumerate(lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_list=(1,) * batch, seq_lens_list=tuple(lens))
    ids = torch.randint(0, CONFIG.vocab_size, (batch,), generator=gen)
    return ids, torch.tensor([n - 1 for n in lens]), meta


def _query_of(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """`rows` new tokens of one sequence after 3 cached ones, and a decode row of another after 9:
    a speculative verification (or a prompt chunk) batched with a plain decode."""
    lens = [3 + rows, 10]
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = -(-max(lens) // BLOCK_SIZE)
    tables = [[blocks.pop() for _ in range(width)] for _ in lens]
    positions = [*range(3, 3 + rows), 9]
    owners = [0] * rows + [1]
    slots = [tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for b, p in zip(owners, positions, strict=True)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, rows, rows + 1], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_list=(rows, 1), seq_lens_list=tuple(lens))
    return torch.randint(0, CONFIG.vocab_size, (rows + 1,), generator=gen), torch.tensor(positions), meta


def _caches(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(CONFIG.num_layers)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("batch", [1, 3, FP16_MIN_ROWS - 1])
def test_the_stack_computes_the_layers_bits_and_writes_the_same_pages(variant, batch):
    model, layers = _random_model(variant), _random_model(variant, stacked=False)
    stack = model.stacked
    assert stack is not None and stack.max_rows == FP16_MIN_ROWS - 1 and layers.stacked is None
    gen = torch.Generator().manual_seed(batch)
    ids, positions, meta = _decode_batch(batch, gen)
    caches = _caches(gen)
    copies = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        stacked = model(ids, positions, caches, meta)
        layered = layers(ids, positions, copies, meta)
    assert torch.equal(stacked, layered)
    for (k, v), (k_layered, v_layered) in zip(caches, copies, strict=True):
        assert torch.equal(k, k_layered) and torch.equal(v, v_layered)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_mixture_of_experts_runs_as_the_stack_at_one_row_with_the_layers_bits(variant):
    model = _random_model(variant, config=MOE_CONFIG)
    layers = _random_model(variant, stacked=False, config=MOE_CONFIG)
    stack = model.stacked
    assert isinstance(stack, DecodeStack) and stack.max_rows == 1
    gen = torch.Generator().manual_seed(7)
    ids, positions, meta = _decode_batch(1, gen)
    caches = _caches(gen)
    copies = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        assert torch.equal(model(ids, positions, caches, meta), layers(ids, positions, copies, meta))
        two = _decode_batch(2, gen)
        assert stack(model.embed(two[0]), *model.rotary.forward(two[1]), caches, two[2]) is None  # rows > 1
    for (k, v), (k_layered, v_layered) in zip(caches, copies, strict=True):
        assert torch.equal(k, k_layered) and torch.equal(v, v_layered)
    shared = replace(MOE_CONFIG, moe=replace(MOE_CONFIG.moe, shared_intermediate_size=64, shared_gate=True))
    assert _random_model(variant, config=shared).stacked is None  # a shared expert: the layers run


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_speculative_verification_runs_as_the_stack_with_the_layers_bits(variant):
    # Each verification row attends over its own prefix, this step's earlier rows included.
    model, layers = _random_model(variant), _random_model(variant, stacked=False)
    gen = torch.Generator().manual_seed(11)
    ids, positions, meta = _query_of(FP16_MIN_ROWS - 2, gen)
    caches = _caches(gen)
    copies = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        assert model.stacked(model.embed(ids), *model.rotary(positions), caches, meta) is not None
        stacked = model(ids, positions, caches, meta)
        layered = layers(ids, positions, copies, meta)
    assert torch.equal(stacked, layered)
    for (k, v), (k_layered, v_layered) in zip(caches, copies, strict=True):
        assert torch.equal(k, k_layered) and torch.equal(v, v_layered)


@pytest.mark.parametrize("batch", [1, BF16_MIN_ROWS - 1])
def test_in_bf16_the_stack_stays_as_close_to_fp32_as_the_layers_and_writes_only_the_steps_rows(batch):
    model, layers = _random_model(VARIANTS[0], torch.bfloat16), _random_model(VARIANTS[0], torch.bfloat16, False)
    stack = model.stacked
    assert stack is not None and stack.max_rows == BF16_MIN_ROWS - 1
    reference = _random_model(VARIANTS[0], stacked=False)
    gen = torch.Generator().manual_seed(batch)
    ids, positions, meta = _decode_batch(batch, gen)
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in _caches(gen)]
    stacked_pages = [(k.clone(), v.clone()) for k, v in caches]
    layered_pages = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        want = reference(ids, positions, [(k.float(), v.float()) for k, v in caches], meta)
        stacked = model(ids, positions, stacked_pages, meta)
        layered = layers(ids, positions, layered_pages, meta)
    # bf16 keeps 8 significant bits: each rounding (the embedding, the pages, the layers' ops in the
    # layer path, the final norm and the output) moves a value by at most 2^-9 of itself, and a few
    # of them stay well under 1% of the largest output; a misread page or weight moves it by 10% or more.
    bound = 0.01 * want.abs().max().item()
    stack_error = (stacked.float() - want).abs().max().item()
    assert stacked.dtype == torch.bfloat16 and stack_error < bound
    assert stack_error <= (layered.float() - want).abs().max().item() * 1.1  # no further from fp32 than the layers
    written = meta.slot_mapping
    for (k, v), (k_before, v_before) in zip(stacked_pages, caches, strict=True):
        for page, before in ((k, k_before), (v, v_before)):
            rows, rows_before = page.view(-1, *page.shape[2:]).clone(), before.view(-1, *before.shape[2:]).clone()
            assert not torch.equal(rows[written], rows_before[written])
            rows[written] = rows_before[written]
            assert torch.equal(rows, rows_before)  # nothing but this step's rows


def test_the_stack_steps_aside_for_large_batches_prompt_chunks_and_per_layer_callbacks():
    model = _random_model(VARIANTS[0])
    stack = model.stacked
    gen = torch.Generator().manual_seed(7)
    caches = _caches(gen)
    with torch.inference_mode():
        ids, positions, meta = _decode_batch(FP16_MIN_ROWS, gen)  # the fp16 copy's size: not the kernels'
        hidden = model.embed(ids)
        cos, sin = model.rotary(positions)
        assert stack(hidden, cos, sin, caches, meta) is None
        bf16_stack = _random_model(VARIANTS[0], torch.bfloat16).stacked
        bf16_caches = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
        ids, positions, meta = _decode_batch(BF16_MIN_ROWS, gen)  # in bf16 the bf16 copy's size
        assert bf16_stack(model.embed(ids).bfloat16(), *model.rotary(positions), bf16_caches, meta) is None
        ids, positions, meta = _query_of(SHORT_QUERY + 1, gen)  # a prompt chunk: the layers' prompt path
        assert stack(model.embed(ids), *model.rotary(positions), caches, meta) is None
        ids, positions, meta = _decode_batch(2, gen)
        done: list[int] = []
        model(ids, positions, caches, meta, on_layer_done=done.append)  # a prefill worker's layer-by-layer push
        assert done == list(range(CONFIG.num_layers))


def test_formats_without_the_kernels_products_have_no_stack(make_engine):
    # The pinned formats hold unquantized weights: their products are not the kernels'.
    assert make_engine().runner.model.stacked is None
    # Products on another build of the kernels would round differently from the stack's.
    model = _random_model(VARIANTS[0])
    other = kernels("scalar") if VARIANTS[0] != "scalar" else None
    if other is not None:
        assert DecodeStack.build(model, other) is None


def test_the_shipped_model_decodes_the_same_tokens_with_and_without_the_stack(make_engine):
    engine = make_engine(quantization="gguf")
    model = engine.runner.model
    stack = model.stacked
    assert stack is not None

    def greedy(stacked: DecodeStack | None) -> list[list[int]]:
        model.stacked = stacked  # the one model both ways: the same weights and pages
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i in range(2):
            engine.add_request(f"{stacked is not None}-{i}", list(range(300 + 9 * i, 340 + 9 * i)), params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        return [tokens[key] for key in sorted(tokens)]

    assert greedy(stack) == greedy(None)
