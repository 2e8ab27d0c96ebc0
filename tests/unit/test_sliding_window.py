"""A model that declares a sliding window (Mistral's), against transformers' own class on the same
random weights, served by the engine with the blocks that leave the window freed; and the window as
a serving option (--kv-sliding-window, --kv-sink-tokens) on the shipped model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from disaggregated import run_disaggregated
from transformers import MistralConfig, Qwen2Config

from engine.attention.reference import TorchPagedAttention
from engine.config import CacheConfig, EngineConfig, Role, SchedulerConfig
from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.window import KVWindow, check_window_served
from engine.model.hf_loader import config_from_hf
from engine.model.loader import build_model, load_model_files
from engine.offline import generate
from engine.outputs import KVReservation
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from kvtransfer.descriptor import KVLayout
from tests.reference import check_runs, reference_greedy
from tests.unit.test_model_hf import VOCAB, random_prompt, run_chunks, save_random_model, save_word_tokenizer

WINDOW, BLOCK, CHUNK = 16, 8, 16
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1)
EXACT = dict(dtype="float32", quantization="none", cpu_weights="fp32")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (5, 37, 60)]


def save_mistral(directory: Path) -> torch.nn.Module:
    """A random Mistral of window WINDOW with a word tokenizer; transformers' copy, attending eagerly."""
    reference = save_random_model(MistralConfig(**_SHAPE, sliding_window=WINDOW, attn_implementation="eager"),
                                  directory)
    save_word_tokenizer(directory, VOCAB)
    assert reference.config._attn_implementation == "eager"
    return reference


def windowed_engine(directory: Path, num_blocks: int = 64, role: Role = "colocated") -> Engine:
    """An engine on the saved Mistral whose cache starts as NaN: a read of any page the request did
    not write (a freed block, a row past its context) poisons its logits."""
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks)
    engine = Engine(EngineConfig(model=str(directory), role=role, **EXACT, cache=cache,
                                 scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK)))
    for k_cache, v_cache in engine.runner.cache.kv_caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    return engine


def run_holding(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, and the most blocks any running request held at once."""
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    most = 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        running = [r.request_id for r in engine.scheduler.running if r.status is RequestStatus.RUNNING]
        most = max([most, *(engine.kv.num_held_blocks(rid) for rid in running)])
    return [tokens[str(i)] for i in range(len(prompts))], most


def test_the_window_is_read_from_the_config_and_only_mistral_style_windows_are_served() -> None:
    raw = {"architectures": ["MistralForCausalLM"], **_SHAPE, "sliding_window": WINDOW}
    assert config_from_hf(raw).sliding_window == WINDOW
    assert config_from_hf({**raw, "sliding_window": None}).sliding_window is None
    qwen2 = {**Qwen2Config(**_SHAPE).to_dict(), "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
             "sliding_window": WINDOW}
    with pytest.raises(ValueError, match="sliding_window: unsupported for Qwen2ForCausalLM"):
        config_from_hf(qwen2)


def test_logits_match_transformers_past_the_window_in_one_prefill_and_in_chunks(tmp_path: Path) -> None:
    reference = save_mistral(tmp_path)
    files = load_model_files(str(tmp_path), torch.float32)
    model = build_model(files, TorchPagedAttention(window=KVWindow(WINDOW)), "cpu", cpu_weights="fp32")
    tokens = torch.tensor(random_prompt(70, seed=1))
    with torch.inference_mode():
        expected = reference(tokens[None, :]).logits[0].float()
    assert (run_chunks(model, tokens, [70]) - expected).abs().max().item() < 1e-4
    assert (run_chunks(model, tokens, [20, 21, 53, 70]) - expected).abs().max().item() < 1e-4
    # The window matters: the last position's logits over the whole context differ.
    full = build_model(files, TorchPagedAttention(), "cpu", cpu_weights="fp32")
    assert (run_chunks(full, tokens, [70])[-1] - expected[-1]).abs().max().item() > 1e-3


def test_a_continuous_batch_decodes_as_transformers_holding_only_the_window(tmp_path: Path) -> None:
    reference = save_mistral(tmp_path)
    runs = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    engine = windowed_engine(tmp_path)
    tokens, most = run_holding(engine, PROMPTS, GREEDY)
    check_runs(tokens, runs, "windowed Mistral in a continuous batch")
    # A context of 100 tokens spans 13 blocks; a request holds the window behind a chunk and the chunk.
    assert most <= KVWindow(WINDOW).max_held_blocks(BLOCK, CHUNK) < 13
    # Again on the same engine: the prompts' blocks come back from the prefix cache (those still
    # there), and the tokens are the same.
    again, _ = run_holding(engine, PROMPTS, GREEDY)
    assert again == tokens
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_preempted_and_speculating_requests_keep_their_tokens(tmp_path: Path) -> None:
    from engine.compose import build_engine
    from engine.speculative.config import SpeculativeConfig

    save_mistral(tmp_path)
    plain, _ = run_holding(windowed_engine(tmp_path), PROMPTS, GREEDY)
    tight = windowed_engine(tmp_path, num_blocks=9)
    assert run_holding(tight, PROMPTS, GREEDY)[0] == plain
    assert tight.scheduler.total_preemptions > 0
    repetitive = [[5, 6, 7, 8] * 8]
    speculative = build_engine(EngineConfig(
        model=str(tmp_path), **EXACT, cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=None,
                                      gate="off")))
    expected = [c.token_ids for c in generate(windowed_engine(tmp_path), repetitive, GREEDY)]
    assert [c.token_ids for c in generate(speculative, repetitive, GREEDY)] == expected
    assert speculative.scheduler.spec_stats.num_accepted_tokens > 0


def test_a_windowed_prompt_prefilled_in_chunks_on_one_engine_decodes_on_another(tmp_path: Path) -> None:
    """A chunk's blocks ship in the step that wrote them, before the window frees them; the decode
    engine neither holds nor receives the head its first query's window hides."""
    save_mistral(tmp_path)
    colocated, _ = run_holding(windowed_engine(tmp_path), PROMPTS, GREEDY)
    prefill, decode = windowed_engine(tmp_path, role="prefill"), windowed_engine(tmp_path, role="decode")
    reservation = decode.reserve("probe", PROMPTS[2], GREEDY)
    # 60 tokens: the query at 60 sees 45..60, so blocks 0..4 (tokens 0..39) are neither held nor sent.
    assert isinstance(reservation, KVReservation) and reservation.num_cached_tokens == 40
    assert len(reservation.blocks_to_fill) == 3 and decode.kv.usage == 3 / decode.kv.num_blocks
    decode.abort("probe")
    assert run_disaggregated(prefill, decode, PROMPTS, GREEDY) == colocated
    # Again: the decode engine's prefix hit (the blocks it still caches) ships only the rest.
    assert run_disaggregated(prefill, decode, PROMPTS, GREEDY) == colocated
    assert prefill.kv.usage == 0 and decode.kv.usage == 0


def test_combinations_not_served_are_refused_naming_option_and_model(tmp_path: Path) -> None:
    save_mistral(tmp_path)
    with pytest.raises(ValueError, match=f"kv_sliding_window: model {tmp_path.name} declares its own sliding_window"):
        Engine(EngineConfig(model=str(tmp_path), **EXACT, cache=CacheConfig(num_blocks=64, sliding_window=32)))
    config = EngineConfig(model=str(tmp_path), prefill_context_parallel_size=2)
    model = config_from_hf({"architectures": ["MistralForCausalLM"], **_SHAPE, "sliding_window": WINDOW}, "m")
    with pytest.raises(ValueError, match="prefill_context_parallel_size: 2 is not served with model m's"):
        check_window_served(config, model, KVWindow(WINDOW))


def test_the_serving_window_keeps_sinks_frees_the_middle_and_is_its_own_kv_identity(make_engine) -> None:
    window = CacheConfig(block_size=16, num_blocks=64, sliding_window=32, sink_tokens=4)
    streaming, full = make_engine(cache=window), make_engine(cache=replace(window, sliding_window=None, sink_tokens=0))
    assert streaming.window == KVWindow(32, sink_tokens=16, cache_positions=True)  # sinks: a whole block
    assert streaming.fingerprint != full.fingerprint
    assert KVLayout.of_engine(streaming).page_fingerprint != KVLayout.of_engine(full).page_fingerprint
    short = [random_prompt(12, seed=3, vocab=1000)]
    params = replace(GREEDY, max_tokens=16)
    # Within the window every token is seen: the same tokens as full attention.
    assert run_holding(streaming, short, params)[0] == run_holding(full, short, params)[0]
    long_prompt = [random_prompt(70, seed=4, vocab=1000)]
    tokens, most = run_holding(streaming, long_prompt, replace(GREEDY, max_tokens=30))
    assert len(tokens[0]) == 30
    # 100 tokens span 7 blocks; after each step a request holds its sink block and the window's.
    assert most <= 1 + blocks_for(32, 16) + 1 < 7
