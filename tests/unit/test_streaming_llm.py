"""StreamingLLM (--kv-sliding-window with --kv-sink-tokens): a conversation well beyond a random
Llama's context of 64 positions, against a token-by-token reference of the paper's definition
(tests/streaming_reference.py), with KV held bounded by the sinks and the window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine.attention.metadata import AttentionMetadata
from engine.attention.streaming import StreamingAttention
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.kv_cache.codec import kv_format
from engine.kv_cache.window import KVWindow
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import build_model, load_model_files
from engine.model.rope import RotaryAtAnyPosition
from engine.sampling_params import SamplingParams
from tests.reference import EXACT_FORMATS, ReferenceRun, check_runs
from tests.streaming_reference import streaming_greedy, streaming_logits
from tests.unit.test_model_hf import VOCAB, random_prompt, save_random_model, save_word_tokenizer
from tests.unit.test_sliding_window import run_holding

CONTEXT, WINDOW, SINKS, BLOCK, CHUNK = 64, 24, 8, 8, 16
TEXT = 160  # tokens, 2.5 contexts
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, initializer_range=0.1)
STREAMING = KVWindow(WINDOW, SINKS, cache_positions=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random Llama of context CONTEXT with a word tokenizer, and transformers' copy of it."""
    directory = tmp_path_factory.mktemp("llama64")
    reference = save_random_model(LlamaConfig(**_SHAPE), directory)
    save_word_tokenizer(directory, VOCAB)
    return directory, reference


def chunk_logits(model: LlamaForCausalLM, tokens: list[int], chunk_ends: list[int],
                 kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Logits for every token, computed in consecutive chunks over one table of enough fresh blocks
    (the attention reads only the blocks the window holds)."""
    config, kv = model.config, kv_format(kv_cache_dtype, "float32")
    num_blocks = -(-len(tokens) // BLOCK)
    shape = (num_blocks, *kv.page_shape(BLOCK, config.num_kv_heads, config.head_dim))
    caches = [(torch.zeros(shape, dtype=kv.storage_dtype), torch.zeros(shape, dtype=kv.storage_dtype))
              for _ in range(config.num_layers)]
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    logits, start = [], 0
    with torch.inference_mode():
        for end in chunk_ends:
            meta = AttentionMetadata(slot_mapping=torch.arange(start, end),
                                     query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                                     seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                                     query_lens_list=(end - start,), seq_lens_list=(end,))
            hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), caches, meta)
            logits.append(model.compute_logits(hidden))
            start = end
    return torch.cat(logits)


def streaming_model(directory: Path, kv_cache_dtype: str = "auto") -> LlamaForCausalLM:
    files = load_model_files(str(directory), torch.float32)
    codec = kv_format(kv_cache_dtype, "float32").codec
    return build_model(files, StreamingAttention(codec, STREAMING, RotaryAtAnyPosition(files.config, "cpu")), "cpu",
                       cpu_weights="fp32")


def test_logits_past_the_context_match_the_papers_definition_in_any_chunking(saved) -> None:
    directory, reference = saved
    tokens = random_prompt(TEXT, seed=7)
    expected = streaming_logits(reference, tokens, SINKS, WINDOW)
    model = streaming_model(directory)
    for ends in ([TEXT], [16, 40, 41, 100, TEXT], list(range(90, TEXT + 1))):  # the last: decode steps
        assert (chunk_logits(model, tokens, ends) - expected).abs().max().item() < 1e-4, ends
    # The comparison can fail: keys rotated at their positions in the text give other logits past
    # the window, and so does full attention within the context.
    absolute = streaming_logits(reference, tokens, SINKS, WINDOW, cache_positions=False)
    assert (absolute - expected)[SINKS + WINDOW:].abs().max().item() > 1e-2
    assert (absolute - expected)[: SINKS + WINDOW].abs().max().item() < 1e-4
    with torch.inference_mode():
        full = reference(torch.tensor([tokens[:CONTEXT]])).logits[0].float()
    assert (full - expected[:CONTEXT]).abs().max().item() > 1e-2


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_quantized_pages_hold_keys_before_the_rotary_embedding(saved, kv_cache_dtype: str) -> None:
    """Keys are encoded unrotated, and the rotary embedding turns what the codec decodes (int4's
    Hadamard rotation undone): the paper's definition over keys and values as the format rounds them."""
    directory, reference = saved
    codec = kv_format(kv_cache_dtype, "float32").codec
    tokens = random_prompt(TEXT, seed=8)
    expected = streaming_logits(reference, tokens, SINKS, WINDOW,
                                round_trip=lambda x: codec.decode(codec.encode(x), x.dtype))
    quantized = chunk_logits(streaming_model(directory, kv_cache_dtype), tokens, [40, 100, TEXT], kv_cache_dtype)
    assert (quantized - expected).abs().max().item() < 1e-4
    assert (quantized - streaming_logits(reference, tokens, SINKS, WINDOW)).abs().max().item() > 1e-3


def engine(directory: Path, num_blocks: int = 64, **fields) -> Engine:
    """An engine under the streaming window whose cache starts as NaN: a read of a page the request
    did not write (a freed block, a row past its context) poisons its logits."""
    config = EngineConfig(model=str(directory), **EXACT_FORMATS, max_model_len=4 * CONTEXT,
                          cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, sliding_window=WINDOW,
                                            sink_tokens=SINKS - 3),  # rounded up to a block: SINKS
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    served = Engine(replace(config, **fields))
    for k_cache, v_cache in served.runner.cache.kv_caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    return served


def test_a_conversation_past_the_context_decodes_as_the_reference_holding_only_sinks_and_window(saved) -> None:
    directory, reference = saved
    prompts = [random_prompt(n, seed=n) for n in (5, 50, 90)]  # the last is longer than the context
    greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    runs = [ReferenceRun(*streaming_greedy(reference, p, greedy.max_tokens, SINKS, WINDOW)) for p in prompts]
    served = engine(directory)
    assert served.window == STREAMING and served.max_model_len == 4 * CONTEXT
    tokens, most = run_holding(served, prompts, greedy)
    check_runs(tokens, runs, "StreamingLLM past the context")
    # 190 tokens span 24 blocks; a request holds its sinks, the window behind a chunk and the chunk.
    assert most <= STREAMING.max_held_blocks(BLOCK, CHUNK) < 8
    assert served.kv.num_free_blocks == served.kv.num_blocks  # nothing leaked
    # A cache of 9 blocks takes the 190-token conversation (one request at a time: preempted and resumed).
    tight, _ = run_holding(engine(directory, num_blocks=9), prompts, greedy)
    assert tight == tokens


def test_the_bound_is_max_model_len_and_the_window_must_fit_the_context(saved) -> None:
    directory, _ = saved
    served = engine(directory)
    with pytest.raises(ValueError, match=r"max_tokens: 60 plus the prompt's 200 tokens .* 256 tokens \(max_model_len"):
        served.add_request("long", random_prompt(200, seed=1), SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match=r"prompt: 256 tokens .* \(max_model_len\)"):
        served.add_request("longer", random_prompt(256, seed=1), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"kv_sliding_window: 60 plus 8 sink tokens exceed model .*context of 64"):
        engine(directory, cache=CacheConfig(block_size=BLOCK, num_blocks=64, sliding_window=60, sink_tokens=8))
    # Without the window the context bounds every request, whatever max_model_len says.
    assert engine(directory, cache=CacheConfig(block_size=BLOCK, num_blocks=64)).max_model_len == CONTEXT
    # Unrotated keys are their own KV identity.
    assert STREAMING.policy != replace(STREAMING, cache_positions=False).policy
