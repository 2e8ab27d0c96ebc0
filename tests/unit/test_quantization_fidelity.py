"""Each weight format's logits against the fp32 model's on the shipped model, and greedy agreement.

Four prompts: three short ones (whole prefill through the kernels) and one of 200 tokens (its
prefill through the dequantized GEMM path); the last 8 tokens of each are fed one at a time,
teacher-forced, so decode-sized products are covered too.
"""

from __future__ import annotations

import pytest
import torch
from parity_prompts import PLAIN
from reference import check_against, first_divergence

from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import TorchPagedAttention
from engine.config import CacheConfig
from engine.model.kernels import kernels
from engine.model.loader import build_model
from engine.offline import generate
from engine.sampling_params import SamplingParams

STEPPED = 8
GREEDY_TOKENS = 16
BLOCK_SIZE = 16
SMALL_CACHE = CacheConfig(num_blocks=96, memory_bytes=None, enable_prefix_caching=False)
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"

# gguf serves the very weights the fp32 model dequantizes (Q4_1 and Q8_0 map exactly), so the two
# differ only in the order fp32 sums are taken; test_model_gguf allows 5e-4 between this engine and
# transformers on the same weights for the same reason. Measured here: 1.1e-4 (AMD EPYC, AVX2).
GGUF_LOGIT_BOUND = 5e-4
# int8 re-rounds each (Q4_1) weight to 255 levels over its output channel's range, moving it by up
# to max|row| / 254; over 30 layers that moved a logit by at most 1.83 here (logits span about 40;
# perplexity +0.4%, docs/benchmarks.md). The bound leaves 2x room: a wrong scale or row order
# moves logits by tens.
INT8_LOGIT_BOUND = 4.0
# 16-bit activations and weights (--dtype bfloat16/float16 --quantization none): every weight,
# activation and intermediate rounds to 8 (bf16) or 11 (fp16) significant bits instead of 24, so a
# logit moves by roughly 2^-8 or 2^-11 of the sum of magnitudes behind it, over 30 layers. Measured
# here (AMD EPYC, AVX2; torch emulates both dtypes on this CPU): 1.3 for bf16, 0.28 for fp16. The
# bounds leave 2-3x room; a wrong cast (weights left in fp32 beside bf16 activations, a norm in
# 16 bits) shows as a mismatch of dtypes or moves logits by tens.
BF16_LOGIT_BOUND = 4.0
FP16_LOGIT_BOUND = 1.0
# The file's blocks with bf16 activations quantized to int8 blocks of 32 for every product
# (--activation-quantization int8): bf16's roundings plus each activation moved by up to amax/254 of
# its block. Measured here: 1.36, and 2.14 with two parts (Intel Xeon, AVX512-VNNI; bf16 alone 1.33).
# Same bound as bf16: a misplaced scale, offset or block moves logits by tens.
A8_LOGIT_BOUND = 4.0
needs_int8_gemm = pytest.mark.skipif(kernels().int8_gemm is None,
                                     reason="int8 activations need the avx512bf16 build (avx512_vnni) and no AMX")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in (PLAIN[1], PLAIN[2], STORY)] + [tokenizer.encode(PLAIN[3])[:200]]


def _logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits at every position: the prompt but its last STEPPED tokens in one chunk, then those one at a time."""
    config = model.config
    blocks = -(-len(prompt) // BLOCK_SIZE)
    shape = (blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    dtype = model.norm.dtype  # the KV cache holds what the model computes in
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_layers)]
    tokens, table = torch.tensor(prompt), torch.arange(blocks, dtype=torch.int32)[None]
    first = len(prompt) - STEPPED
    logits, start = [], 0
    with torch.inference_mode():
        for end in [first, *range(first + 1, len(prompt) + 1)]:
            meta = AttentionMetadata(
                slot_mapping=torch.arange(start, end),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                query_lens_list=(end - start,), seq_lens_list=(end,))
            logits.append(model.compute_logits(model(tokens[start:end], torch.arange(start, end), kv_caches, meta)))
            start = end
    return torch.cat(logits)


@pytest.fixture(scope="module")
def fp32_logits(model_files, prompts) -> list[torch.Tensor]:
    model = build_model(model_files, TorchPagedAttention(), "cpu", quantization="none")
    return [_logits(model, prompt) for prompt in prompts]


@pytest.mark.parametrize(("quantization", "dtype", "bound", "parts"), [
    ("gguf", torch.float32, GGUF_LOGIT_BOUND, 0),
    ("int8", torch.float32, INT8_LOGIT_BOUND, 0),
    ("none", torch.bfloat16, BF16_LOGIT_BOUND, 0),
    ("none", torch.float16, FP16_LOGIT_BOUND, 0),
    pytest.param("gguf", torch.bfloat16, A8_LOGIT_BOUND, 1, marks=needs_int8_gemm),
    pytest.param("gguf", torch.bfloat16, BF16_LOGIT_BOUND, 2, marks=needs_int8_gemm),
], ids=["gguf", "int8", "bf16", "fp16", "gguf-a8", "gguf-a16"])
def test_logits_stay_within_the_formats_bound_of_fp32(model_files, prompts, fp32_logits, quantization, dtype, bound,
                                                      parts):
    model = build_model(model_files, TorchPagedAttention(), "cpu", quantization=quantization, dtype=dtype,
                        int8_parts=parts)
    worst = max(float((_logits(model, prompt).float() - ref).abs().max())
                for prompt, ref in zip(prompts, fp32_logits, strict=True))
    print(f"{quantization} {dtype}, {parts} int8 parts: max |logit - fp32 logit| = {worst:.2e}")
    assert worst < bound


@pytest.fixture(scope="module")
def fp32_greedy(make_engine, prompts):
    """fp32's greedy tokens and, per step, its top-2 logit margin."""
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = generate(make_engine(quantization="none", cpu_weights="plain", cache=SMALL_CACHE), prompts, params)
    return [run.token_ids for run in runs], [[lp.top[0][1] - lp.top[1][1] for lp in run.logprobs] for run in runs]


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_greedy_agreement_with_fp32_is_reported(make_engine, prompts, fp32_greedy, quantization):
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    # The shipped file's default ("auto") is its own blocks.
    engine = make_engine(quantization="auto" if quantization == "gguf" else quantization, cache=SMALL_CACHE)
    assert engine.formats.quantization == quantization
    ours = [run.token_ids for run in generate(engine, prompts, params)]
    reference, margins = fp32_greedy
    divergences = [first_divergence(o, r) for o, r in zip(ours, reference, strict=True)]
    agreement = [GREEDY_TOKENS if at is None else at for at in divergences]
    print(f"{quantization}: greedy tokens equal to fp32's before the first difference (of {GREEDY_TOKENS}): "
          f"{agreement}")
    if quantization == "gguf":
        # The same weights: tokens may differ only where fp32's own top two nearly tie.
        check_against(ours, reference, margins, "gguf vs fp32")
    else:
        # Other weights: at least each prompt's first token (the bound above keeps logits close).
        assert all(o[0] == r[0] for o, r in zip(ours, reference, strict=True))
