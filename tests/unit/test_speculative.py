"""Speculative decoding's torch-free parts: the flag, the n-gram proposer, the accept rule, and the
scheduler's handling of drafts (slots, rollback, hashing, stops)."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.kv_cache.manager import KVCacheManager
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from engine.speculative.drafter import Drafter
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftRequest
from engine.speculative.verify import num_accepted

BLOCK = 4


# ---- the flag ----------------------------------------------------------------------------------
def test_vllm_keys_parse():
    config = SpeculativeConfig.from_json(json.dumps(
        {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 5,
         "disable_by_batch_size": None, "gate": "off"}))
    assert config == SpeculativeConfig("ngram", 6, 1, 5, None, gate="off")
    assert config.speculates(1000)
    assert SpeculativeConfig(disable_by_batch_size=4).speculates(3)
    assert not SpeculativeConfig(disable_by_batch_size=4).speculates(4)


@pytest.mark.parametrize(("text", "names"), [
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    (f'{{"num_speculative_tokens": {MAX_SPECULATIVE_TOKENS + 1}}}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": "4"}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "eagle"}', "method"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_max"),
    ('{"prompt_lookup_min": 0}', "prompt_lookup_min"),
    ('{"disable_by_batch_size": 1}', "disable_by_batch_size"),
    ('{"num_lookahead": 3}', "num_lookahead"),
    ('{"gate": "sometimes"}', "gate"),
    ('{"gate": false}', "gate"),
    ("[4]", "JSON object"),
    ("{method: ngram}", "not JSON"),
])
def test_bad_configs_name_the_flag_and_key(text, names):
    with pytest.raises(ValueError, match="--speculative-config") as error:
        SpeculativeConfig.from_json(text)
    assert names in str(error.value)


def test_the_prefill_role_refuses_to_speculate():
    with pytest.raises(ValueError, match="--speculative-config: the prefill role"):
        EngineConfig(role="prefill", speculative=SpeculativeConfig())
    assert EngineConfig(role="decode", speculative=SpeculativeConfig()).speculative is not None


# ---- the proposer ------------------------------------------------------------------------------
def test_ngram_continues_the_longest_then_most_recent_match():
    proposer = NgramProposer(1, 3)
    # The suffix [7, 8, 9] occurred once (followed by 1, 2); the shorter [8, 9] also occurs later
    # (followed by 5), but the longest match wins.
    tokens = [7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 7, 8, 9]
    assert proposer.propose(tokens, 3) == [1, 2, 3]
    # Two occurrences of [4, 5]: the most recent one's continuation.
    assert NgramProposer(2, 2).propose([4, 5, 1, 4, 5, 2, 0, 4, 5], 2) == [2, 0]
    # Falls back to shorter n-grams, down to min_n.
    assert proposer.propose([3, 1, 2, 9, 9, 3], 2) == [1, 2]
    assert NgramProposer(2, 3).propose([3, 1, 2, 9, 9, 3], 2) == []


def test_ngram_edges():
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert proposer.propose([1, 2], 4) == []  # too short to recur
    assert proposer.propose([1, 2, 1, 2], 0) == []
    # The continuation stops where the tokens end.
    assert proposer.propose([5, 1, 2, 1, 2], 4) == [1, 2]
    # An id whose bytes straddle two others' (0x0100 then 0x0001 holds 0x00 0x01 0x00 0x00...) is no match.
    straddle = [256, 1, 65536, 1, 256]
    assert NgramProposer(1, 1).propose(straddle, 2) == [1, 65536]
    assert NgramProposer(2, 2).propose([1 << 8, 1 << 16, 7, 0, 1, 0, 1 << 8, 1 << 16], 1) == [7]


def test_accept_rule():
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert num_accepted([], [4]) == 0
    with pytest.raises(ValueError, match="3 drafts need 4"):
        num_accepted([5, 6, 7], [5, 6, 7])


# ---- the scheduler -----------------------------------------------------------------------------
def _scheduler(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), kv)


def _decoding(s: Scheduler, rid: str = "a", prompt: int = 6, **params) -> Request:
    """A request past its prompt step, one output token in."""
    request = Request(rid, list(range(100, 100 + prompt)), SamplingParams(**{"max_tokens": 32, **params}), 1024)
    s.add(request)
    s.update(s.schedule(), {rid: [1]})
    return request


def test_drafts_ride_with_the_decode_token_and_rejected_slots_go_back():
    s = _scheduler()
    request = _decoding(s)  # 7 tokens: 2 blocks, 6 computed
    request.draft_token_ids = [2, 3, 4, 5, 6]
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft_token_ids) == (6, 6, (2, 3, 4, 5, 6))
    assert chunk.samples and chunk.num_sampled_rows == 6
    assert len(s.kv.block_table("a")) == 3  # slots for 12 tokens
    assert request.draft_token_ids == []  # a draft is verified once
    # Two drafts accepted, then a correction: 10 tokens, 9 computed; the third block held only
    # rejected drafts' slots and is free again.
    s.update(out, {"a": [2, 3, 9]})
    assert request.output_token_ids == [1, 2, 3, 9]
    assert request.num_computed_tokens == 9
    assert len(s.kv.block_table("a")) == 3
    s.kv.check_invariants()
    assert (s.spec_stats.num_drafts, s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (1, 5, 2)
    assert s.spec_stats.accepted_per_position == [1, 1]
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (5, 2)


def test_a_block_of_rejected_drafts_is_freed_and_never_hashed():
    s = _scheduler()
    request = _decoding(s, prompt=7)  # 8 tokens, 7 computed, 2 blocks
    request.draft_token_ids = [2, 3, 4, 5, 6, 7]
    out = s.schedule()
    assert len(s.kv.block_table("a")) == 4  # 14 slots
    cached_before = s.kv.num_cached_blocks
    s.update(out, {"a": [8]})  # the first draft is rejected
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    assert len(s.kv.block_table("a")) == 2  # blocks 3 and 4 held only rejected drafts
    # Only the verified block (tokens 4..7) was hashed; no hash covers a draft.
    assert s.kv.num_cached_blocks == cached_before + 1
    assert s.kv.find_cached_prefix([*request.token_ids, 0])[1] == 8
    s.kv.check_invariants()


def test_drafts_never_preempt_and_fit_the_budget():
    s = _scheduler(num_blocks=3)
    for rid, prompt in (("a", 6), ("b", 2)):
        s.add(Request(rid, list(range(100, 100 + prompt)), SamplingParams(max_tokens=32), 1024))
    s.update(s.schedule(), {"a": [1], "b": [1]})  # a holds 2 blocks, b the third
    s.requests["a"].draft_token_ids = [2, 3, 4, 5, 6, 7]
    out = s.schedule()
    assert [(c.request.request_id, c.draft_token_ids) for c in out.chunks] == [("a", ()), ("b", ())]
    assert s.num_running == 2 and not out.preempted

    s = _scheduler(budget=3)
    request = _decoding(s, prompt=2)
    request.draft_token_ids = [2, 3, 4, 5]
    (chunk,) = s.schedule().chunks
    assert chunk.draft_token_ids == (2, 3)


def test_a_stop_inside_an_accepted_run_drops_the_tokens_after_it():
    s = _scheduler()
    request = _decoding(s, stop_token_ids=(3,))
    request.draft_token_ids = [2, 3, 4]
    out = s.schedule()
    (finished,) = s.update(out, {"a": [2, 3, 4, 5]})
    assert finished is request and request.finish_reason is FinishReason.STOP
    assert request.output_token_ids == [1, 2, 3]
    assert not s.kv.has_request("a") and s.kv.usage == 0
    s.kv.check_invariants()

    s = _scheduler()
    request = _decoding(s, max_tokens=3)
    request.draft_token_ids = [2, 3]
    s.update(s.schedule(), {"a": [2, 3, 4]})
    assert request.output_token_ids == [1, 2, 3] and request.finish_reason is FinishReason.LENGTH

    # A stop string found by the engine at the second of three new tokens.
    s = _scheduler()
    request = _decoding(s)
    request.draft_token_ids = [2, 3]
    s.update(s.schedule(), {"a": [2, 3, 4]})
    s.stop_inside_run("a", 2)
    assert request.output_token_ids == [1, 2] and request.finish_reason is FinishReason.STOP
    assert not s.kv.has_request("a") and s.kv.usage == 0


def test_draft_model_keys():
    config = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m", "quantization": "gguf", '
                                         '"draft_layers": 10, "num_speculative_tokens": 3}')
    assert (config.model, config.quantization, config.draft_layers) == ("/m", "gguf", 10)
    assert SpeculativeConfig.from_json('{"method": "draft_model"}').model is None  # a self-draft
    for text, key in (('{"model": "/m"}', "model"), ('{"draft_layers": 3}', "draft_layers"),
                      ('{"method": "draft_model", "draft_layers": 0}', "draft_layers"),
                      ('{"method": "draft_model", "quantization": "fp4"}', "quantization")):
        with pytest.raises(ValueError, match=f"--speculative-config: {key}"):
            SpeculativeConfig.from_json(text)


def test_the_drafter_takes_the_proposals_it_has_room_for():
    s = _scheduler()
    request = Request("a", [7, 8, 9, 7, 8], SamplingParams(max_tokens=32), 1024)
    s.add(request)
    s.update(s.schedule(), {"a": [9]})  # 7 8 9 7 8 9: the last token recurs
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), NgramProposer(1, 1), None)
    drafter.draft(s.running)
    assert request.draft_token_ids == [7, 8, 9]
    request.params = SamplingParams(max_tokens=3)  # room for the step's own token and one draft
    drafter.draft(s.running)
    assert request.draft_token_ids == [7]


def test_the_ngram_proposer_drafts_from_the_clients_prediction_first():
    proposer = NgramProposer(1, 3)
    predicted = [10, 11, 12, 13, 14, 15]
    # The output so far ends with 11 12: the prediction continues it with 13 14 15.
    assert proposer.propose_batch([DraftRequest("r", [1, 2, 11, 12], 3, predicted)]) == [[13, 14, 15]]
    # Nothing in the prediction matches: the request's own tokens are searched, as without one.
    assert proposer.propose_batch([DraftRequest("r", [5, 6, 7, 5, 6], 2, predicted)]) == [[7, 5]]
    assert proposer.propose([1, 2, 15], 2, predicted) == []  # its last token: nothing follows it
