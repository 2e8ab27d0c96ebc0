"""Importance-based eviction under a per-request KV budget (--kv-budget-tokens): the engine against a
straightforward transformers reference that applies the same rule (H2O scores, SnapKV's observation
window, whole blocks), the blocks it holds and frees, the identity of what it computes after an
eviction, and the combinations refused."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget, kv_budget
from engine.kv_cache.manager import FREED, KVCacheManager
from engine.outputs import KVReservation
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculative.config import SpeculativeConfig
from kvtransfer.descriptor import KVLayout
from tests.disaggregated import import_all, prefill_into
from tests.reference import EXACT_FORMATS
from tests.unit.test_model_hf import VOCAB, random_prompt, save_random_model, save_word_tokenizer

BLOCK, BUDGET, RECENT, OBSERVE, CHUNK = 4, 20, 6, 5, 16
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (9, 30, 45)]


def save_llama(directory: Path) -> torch.nn.Module:
    """A random Llama with a word tokenizer; transformers' copy, attending eagerly (it reports its
    attention probabilities)."""
    reference = save_random_model(LlamaConfig(**_SHAPE, attn_implementation="eager"), directory)
    save_word_tokenizer(directory, VOCAB)
    return reference


def budget_engine(directory: Path, budget: int | None = BUDGET, num_blocks: int = 64,
                  cache_observation: int = OBSERVE, **overrides) -> Engine:
    """An engine whose cache starts as NaN: a read of a page the request does not hold poisons it."""
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, budget_tokens=budget,
                        budget_recent_tokens=None if budget is None else RECENT,
                        budget_observation_tokens=cache_observation)
    engine = Engine(EngineConfig(model=str(directory), **EXACT_FORMATS, cache=cache,
                                 scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK), **overrides))
    for k_cache, v_cache in engine.runner.cache.kv_caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    return engine


@torch.inference_mode()
def reference_budgeted(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> tuple[list[int], list[set[int]]]:
    """Greedy tokens under the budget, recomputing the whole sequence each step with every row's
    mask the blocks held when that row was computed; and the blocks held after each token."""
    budget = KVBudget(BUDGET, RECENT, BLOCK, OBSERVE)
    tokens, held = list(prompt), set(range(blocks_for(len(prompt), BLOCK)))
    visible = [set(range(row + 1)) for row in range(len(prompt))]  # the prompt: full causal attention
    scores: defaultdict[int, float] = defaultdict(float)
    out, held_after = [], []
    for _ in range(max_tokens):
        length = len(tokens)
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for row, keys in enumerate(visible):
            allowed[row, sorted(keys)] = True
        mask = torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
        result = model(torch.tensor([tokens]), attention_mask=mask[None, None], output_attentions=True)
        # The rows computed in this step that score: a prompt's last OBSERVE, then each new one.
        scoring = slice(max(0, budget.score_from(length)), length) if not out else slice(length - 1, length)
        # A key's mass: its probability summed over heads, scoring rows and layers (0 where masked).
        mass = sum(probs[0, :, scoring].sum((0, 1)) for probs in result.attentions)
        padded = torch.zeros(blocks_for(length, BLOCK) * BLOCK)
        padded[:length] = mass
        for index, block_mass in enumerate(padded.view(-1, BLOCK).sum(1).tolist()):
            scores[index] += block_mass
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        tokens.append(token)
        # Evict as the engine does, then the new row sees the held blocks and its own.
        victims = budget.victims(sorted(held), scores, length)
        held -= set(victims)
        held_after.append(set(held))
        held.add(length // BLOCK)
        visible.append({p for p in range(length + 1) if p // BLOCK in held})
    return out, held_after


def run_tracking(engine: Engine, prompts: list[list[int]], params: SamplingParams, most: int | None = None
                 ) -> tuple[list[list[int]], list[list[set[int]]]]:
    """Each prompt's tokens, and after each of its tokens but the last the blocks it holds,
    checking after every step that a request past its prompt holds at most `most` blocks."""
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    held: dict[str, list[set[int]]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            if not output.finished:
                table = engine.kv.block_table(output.request_id)
                held[output.request_id].append({i for i, block in enumerate(table) if block != FREED})
        engine.kv.check_invariants()
        for request in engine.scheduler.running:
            if most is not None and request.status is RequestStatus.RUNNING and request.num_output_tokens:
                assert engine.kv.num_held_blocks(request.request_id) <= most
    return [tokens[str(i)] for i in range(len(prompts))], [held[str(i)] for i in range(len(prompts))]


def test_a_batch_decodes_as_a_reference_that_applies_the_same_kept_blocks(tmp_path: Path) -> None:
    reference = save_llama(tmp_path)
    expected = [reference_budgeted(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    engine = budget_engine(tmp_path)
    tokens, held = run_tracking(engine, PROMPTS, GREEDY, most=BUDGET // BLOCK)
    for index, (want_tokens, want_held) in enumerate(expected):
        assert held[index] == want_held[:-1], f"prompt {index}: the blocks held differ"
        assert tokens[index] == want_tokens, f"prompt {index}: the tokens differ"
    # Blocks were freed (the 45-token prompt holds 5 of its 12 blocks) and that changed what was computed.
    assert min(len(h) for h in held[2]) <= BUDGET // BLOCK < blocks_for(45, BLOCK)
    full, _ = run_tracking(budget_engine(tmp_path, budget=None), PROMPTS, GREEDY)
    # Before its first eviction (at 20 tokens) the shortest prompt computes as full attention.
    assert full[0][:10] == tokens[0][:10] and full[2] != tokens[2]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing leaked


def test_a_long_prompt_runs_its_chunks_before_the_observation_window_on_the_regular_attention(tmp_path: Path) -> None:
    """Alone, the 45-token prompt computes in chunks of 16: the two that end before its observation
    window (positions 40-44) score nothing and read no freed block, so they run the regular
    attention (here the CPU kernels' op: a 16-row chunk is short), the last one the scoring
    attention, as the engine's step counter says; the scores come from the window's queries alone,
    over keys the regular steps wrote, and tokens and held blocks are the reference's."""
    reference = save_llama(tmp_path)
    prompt = PROMPTS[2]
    engine = budget_engine(tmp_path)
    engine.add_request("r", prompt, GREEDY)
    counts = []
    for _ in range(3):
        engine.step()
        counts.append(dict(engine.stats().kv_budget_steps))
    assert counts == [{"regular": 1}, {"regular": 2}, {"regular": 2, "scored": 1}]
    with torch.inference_mode():
        attentions = reference(torch.tensor([prompt]), output_attentions=True).attentions
    # A key's mass from the window's queries only, over heads and layers, per block.
    mass = sum(probs[0, :, len(prompt) - OBSERVE:].sum((0, 1)) for probs in attentions)
    padded = torch.zeros(blocks_for(len(prompt), BLOCK) * BLOCK)
    padded[:len(prompt)] = mass
    # The scores the manager accumulated for the blocks the prompt kept (a budget of every block shows them all).
    kept, _ = engine.kv.kept("r", KVBudget(1024, RECENT, BLOCK, OBSERVE), len(prompt))
    assert len(kept.indices) == BUDGET // BLOCK
    want = padded.view(-1, BLOCK).sum(1)[list(kept.indices)]
    assert torch.allclose(torch.tensor(kept.scores), want, rtol=1e-4, atol=1e-5)
    engine.abort("r")
    colocated = budget_engine(tmp_path)
    tokens, held = run_tracking(colocated, [prompt], GREEDY, most=BUDGET // BLOCK)
    want_tokens, want_held = reference_budgeted(reference, prompt, GREEDY.max_tokens)
    assert tokens[0] == want_tokens and held[0] == want_held[:-1]
    # Every decode step scores: 23 after the prompt's, which made the first token.
    assert colocated.stats().kv_budget_steps == {"regular": 2, "scored": GREEDY.max_tokens}


def test_preempted_requests_recompute_and_finish_within_the_budget(tmp_path: Path) -> None:
    save_llama(tmp_path)
    tight = budget_engine(tmp_path, num_blocks=16)
    tokens, _ = run_tracking(tight, PROMPTS, GREEDY, most=BUDGET // BLOCK)
    assert tight.scheduler.total_preemptions > 0
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * 3
    assert tight.kv.num_free_blocks == tight.kv.num_blocks


def test_a_decode_engine_receives_only_the_kept_blocks_and_decodes_as_colocated(tmp_path: Path) -> None:
    """The prefill engine scores the prompt and ships only the blocks the decode engine's budget
    keeps, with their scores; the decode engine reserved only as many, places them at their table
    indices and holds and decodes exactly as one engine computing the prompt itself (its cache is
    NaN, so a block placed elsewhere than the colocated engine holds it poisons the tokens)."""
    save_llama(tmp_path)
    prefill, decode = budget_engine(tmp_path, role="prefill"), budget_engine(tmp_path, role="decode")
    colocated, colocated_held = run_tracking(budget_engine(tmp_path), PROMPTS, GREEDY)
    tokens: dict[str, list[int]] = {}
    held: dict[str, list[set[int]]] = {}
    page_bytes = 2 * prefill.model_config.num_layers * prefill.runner.cache.kv_caches[0][0][0].nbytes
    for index, prompt in enumerate(PROMPTS):
        reservation = decode.reserve(str(index), prompt, GREEDY)
        assert isinstance(reservation, KVReservation) and reservation.budget == decode.kv.budget
        kept_count = min(blocks_for(len(prompt), BLOCK), BUDGET // BLOCK)  # no prompt fills its last block
        assert len(reservation.blocks_to_fill) == kept_count
        first, pages = prefill_into(prefill, str(index), prompt, GREEDY, budget=reservation.budget)
        assert pages.kept_blocks is not None and len(pages.kept_blocks.indices) == kept_count
        assert pages.nbytes == kept_count * page_bytes  # the kept blocks' pages, once each
        # The recent window's blocks (all, for the prompt within the budget) went as they were computed.
        recent = kept_count if index == 0 else blocks_for(len(prompt), BLOCK) - (len(prompt) - RECENT) // BLOCK
        assert pages.blocks_before_kept == recent * prefill.model_config.num_layers
        import_all(decode, reservation, pages, prefill.model_config.num_layers)
        started = decode.start_decode(str(index), first, pages.kept_blocks)
        tokens[str(index)] = list(started.new_token_ids)
        held[str(index)] = [set(pages.kept_blocks.indices)]
        assert held[str(index)][0] == {i for i, b in enumerate(decode.kv.block_table(str(index))) if b != FREED}
    while decode.has_unfinished():
        for output in decode.step():
            tokens[output.request_id] += output.new_token_ids
            if not output.finished:
                table = decode.kv.block_table(output.request_id)
                held[output.request_id].append({i for i, block in enumerate(table) if block != FREED})
        decode.kv.check_invariants()
    for index in range(len(PROMPTS)):
        assert held[str(index)] == colocated_held[index], f"prompt {index}: the blocks held differ"
        assert tokens[str(index)] == colocated[index], f"prompt {index}: the tokens differ"
    # The 45-token prompt's 12 blocks went as 5.
    assert max(len(h) for h in held["2"]) == BUDGET // BLOCK < blocks_for(len(PROMPTS[2]), BLOCK)
    assert prefill.kv.usage == 0 and decode.kv.usage == 0


def test_kept_blocks_that_do_not_fit_or_a_worker_that_cannot_score_are_refused_and_free_everything(
        tmp_path: Path) -> None:
    save_llama(tmp_path)
    decode = budget_engine(tmp_path, role="decode")
    prompt = PROMPTS[2]
    reservation = decode.reserve("r", prompt, GREEDY)
    assert isinstance(reservation, KVReservation) and reservation.budget is not None
    # A prefill engine without a budget scores nothing; one scoring by another window would pick other blocks.
    for prefill, message in [(budget_engine(tmp_path, budget=None, role="prefill"), "kv_budget: this worker scores no"),
                             (budget_engine(tmp_path, role="prefill", cache_observation=OBSERVE + 1),
                              "kv_budget.observation_tokens: 5 differs")]:
        with pytest.raises(ValueError, match=message):
            prefill_into(prefill, "r", prompt, GREEDY, budget=reservation.budget)
        assert prefill.kv.usage == 0 and not prefill.has_unfinished()
    with pytest.raises(ValueError, match=r"kv_target\.num_cached_tokens: must be 0 under kv_budget"):
        prefill_into(budget_engine(tmp_path, role="prefill"), "r", prompt, GREEDY, BLOCK, budget=reservation.budget)
    # Kept blocks that are not one table index for each reserved block, or none at all (an older
    # prefill worker's full pages), are refused; the abort that follows frees every block.
    for kept in [None, KeptBlocks((0, 1, 2, 3), (1.0,) * 4), KeptBlocks((0, 1, 2, 3, 12), (1.0,) * 5),
                 KeptBlocks((3, 1, 2, 10, 11), (1.0,) * 5), KeptBlocks((0, 1, 2, 10, 11), (1.0,))]:
        with pytest.raises(ValueError, match="kept_blocks: "):
            decode.start_decode("r", 1, kept)
        decode.abort("r")
        assert decode.kv.usage == 0
        decode.kv.check_invariants()
        reservation = decode.reserve("r", prompt, GREEDY)
    decode.abort("r")
    assert decode.kv.usage == 0


def test_blocks_computed_after_an_eviction_are_never_hashed() -> None:
    budget = KVBudget(tokens=5 * BLOCK, recent_tokens=RECENT, block_size=BLOCK)
    manager = KVCacheManager(32, BLOCK, budget=budget)
    tokens = list(range(100, 200))
    prompt = 30  # 8 blocks, the last partly filled
    assert manager.allocate_slots("a", prompt)
    manager.cache_blocks("a", tokens, prompt)
    manager.add_scores("a", range(8), [5.0, 0.1, 3.0, 0.2, 4.0, 0.3, 9.0, 9.0])
    manager.evict_over_budget("a", prompt)
    # 5 blocks at most: the recent window (positions 24..29: blocks 6, 7) stays; the lowest go.
    held = [i for i, block in enumerate(manager.block_table("a")) if block != FREED]
    assert held == [0, 2, 4, 6, 7]
    for computed in range(prompt + 1, 60):  # decode on, evicting as it goes
        assert manager.allocate_slots("a", computed)
        manager.cache_blocks("a", tokens, computed)
        manager.add_scores("a", [computed // BLOCK - 1], [1.0])
        manager.evict_over_budget("a", computed)
        assert manager.num_held_blocks("a") + (computed % BLOCK == 0) <= 5
        manager.check_invariants()
    # A full-attention request with the same tokens finds only the 7 blocks computed before the
    # first eviction (the 8th was still filling), never one computed after it.
    assert manager.find_cached_prefix(tokens[:60])[1] == 7 * BLOCK
    manager.free("a")
    assert manager.find_cached_prefix(tokens[:60])[1] == 7 * BLOCK
    assert manager.num_free_blocks == 32
    manager.check_invariants()


def test_the_shipped_model_keeps_its_identity_and_its_blocks_within_the_budget(make_engine) -> None:
    cache = CacheConfig(block_size=16, num_blocks=64, budget_tokens=64, budget_recent_tokens=16)
    # One plain copy of the weights: packing them for the fp16 product costs more than these steps.
    budgeted = make_engine(cache=cache, cpu_weights="plain")
    full = make_engine(cache=replace(cache, budget_tokens=None, budget_recent_tokens=None), cpu_weights="plain")
    # What it hashes is full-attention KV, so the prefix cache, the tiers and the wire share it.
    assert budgeted.fingerprint == full.fingerprint
    assert KVLayout.of_engine(budgeted).page_fingerprint == KVLayout.of_engine(full).page_fingerprint
    short = [random_prompt(20, seed=3, vocab=1000)]
    params = replace(GREEDY, max_tokens=12)
    assert run_tracking(budgeted, short, params)[0] == run_tracking(full, short, params)[0]
    long_prompt = [random_prompt(100, seed=4, vocab=1000)]
    tokens, held = run_tracking(budgeted, long_prompt, replace(GREEDY, max_tokens=12), most=4)
    assert len(tokens[0]) == 12 and max(len(h) for h in held[0]) <= 4  # of its 7 blocks
    assert budgeted.kv.num_free_blocks == budgeted.kv.num_blocks


@pytest.mark.parametrize(("cache", "message"), [
    (dict(budget_tokens=0), "kv_budget_tokens: must be positive"),
    (dict(budget_tokens=64, sliding_window=32), "kv_budget_tokens: is not served with kv_sliding_window"),
    (dict(budget_recent_tokens=8), "kv_budget_recent_tokens: applies only with kv_budget_tokens"),
    (dict(budget_tokens=64, budget_observation_tokens=0), "kv_budget_observation_tokens: must be at least 1"),
])
def test_bad_budgets_are_refused_naming_the_flag(cache: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**cache)


def test_budgets_the_engine_cannot_serve_are_refused_naming_flag_and_model(tmp_path: Path) -> None:
    save_llama(tmp_path)
    with pytest.raises(ValueError, match="kv_budget_tokens: 8 leaves no block to choose beyond a recent window "
                                         "of 6 tokens; give at least 12"):
        budget_engine(tmp_path, budget=8)
    with pytest.raises(ValueError, match="kv_budget_recent_tokens: must be at least 1"):
        KVBudget(64, 0, BLOCK)
    # The combinations, against the model's shape alone.
    model = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, name="m")
    cache = CacheConfig(block_size=BLOCK, num_blocks=64, budget_tokens=BUDGET)
    assert kv_budget(EngineConfig(cache=cache), model) == KVBudget(BUDGET, BUDGET // 2, BLOCK)
    for config, message in [
        (EngineConfig(cache=cache, speculative=SpeculativeConfig(num_speculative_tokens=2)),
         "not served with speculative_config \\(model m\\)"),
        (EngineConfig(cache=cache, attention_backend="triton"), "not served with attention_backend triton \\(model m"),
        (EngineConfig(cache=cache, tensor_parallel_size=2), "not served with a world of 2 processes \\(model m\\)"),
    ]:
        with pytest.raises(ValueError, match=f"kv_budget_tokens: {message}"):
            kv_budget(config, model)
    with pytest.raises(ValueError, match="kv_budget_tokens: not served on model m, which declares its own sliding_"):
        kv_budget(EngineConfig(cache=cache), replace(model, sliding_window=32))
