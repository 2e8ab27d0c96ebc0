"""Speculative decoding through the engine: output identical to decoding without it (greedy and
seeded sampling), stops and logprobs as without it, KV accounted after rejections, aborts and
preemption, the prefix cache free of unverified tokens, and the sampled rule's distribution."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from disaggregated import run_disaggregated
from engine_runs import output_tokens, run_requests
from reference import check_against

from engine.compose import build_engine
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.kv_cache.block_hash import hash_block
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer

# The gate off: these tests check what verification does, so every proposal is verified.
SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None, gate="off")
PASSAGE = ("The river Thames flows through southern England, including London. It is the longest river entirely "
           "in England and the second longest in the United Kingdom, after the Severn. The river rises at Thames "
           "Head in Gloucestershire and flows into the North Sea near Tilbury, Essex and Gravesend, Kent, via the "
           "Thames Estuary.")


@pytest.fixture(scope="module")
def engines(make_engine):
    """(without speculation, with it) on the same weights and formats."""
    return make_engine(), make_engine(speculative=SPEC)


def _prompts(tokenizer) -> dict[str, list[int]]:
    return {
        "copy": tokenizer.encode_chat([{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE}"}]),
        "chat": tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        "plain": tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
        "long": tokenizer.encode(" ".join([PASSAGE] * 6) + " In summary,"),
    }


def test_greedy_output_is_identical_in_a_mixed_batch(engines, tokenizer):
    plain, spec = engines
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    requests = {name: (ids, params) for name, ids in prompts.items()}
    # A request that cannot draft (no recurring n-gram in a two-token prompt) shares the batch.
    requests["short"] = (tokenizer.encode("Hello")[:2], params)
    reference, ours = run_requests(plain, requests), run_requests(spec, requests)
    names = sorted(requests)
    margins = [[lp.top[0][1] - lp.top[1][1] for o in reference[n] for lp in o.logprobs] for n in names]
    check_against([output_tokens(ours[n]) for n in names], [output_tokens(reference[n]) for n in names], margins,
                  "greedy")
    for name in names:
        assert [lp.token_id for o in ours[name] for lp in o.logprobs] == output_tokens(ours[name])
        if output_tokens(ours[name]) == output_tokens(reference[name]):
            ours_lp = torch.tensor([lp.logprob for o in ours[name] for lp in o.logprobs])
            ref_lp = torch.tensor([lp.logprob for o in reference[name] for lp in o.logprobs])
            torch.testing.assert_close(ours_lp, ref_lp, atol=2e-3, rtol=0)
            assert "".join(o.new_text for o in ours[name]) == "".join(o.new_text for o in reference[name])
        assert ours[name][-1].finish_reason == reference[name][-1].finish_reason
    copied = ours["copy"][-1]
    assert copied.num_accepted_tokens > 0.5 * copied.num_draft_tokens > 0
    assert len(ours["copy"]) < len(reference["copy"]) / 2  # fewer steps than tokens


def test_the_cost_gate_times_steps_at_start_up_and_leaves_the_engine_as_new(engines, make_engine, tokenizer):
    """The gate's calibration runs through the engine's own scheduler: afterwards nothing runs, no
    block is held, no draft is counted, and the gated engine's greedy tokens are the plain one's."""
    plain, _ = engines
    gated = make_engine(speculative=SpeculativeConfig(num_speculative_tokens=4))
    costs = gated._drafter.gate.costs  # type: ignore[union-attr]
    assert costs.decode.rows == (1, 2, 4) and costs.verify_steps.rows == (2, 3, 5)
    assert not gated.has_unfinished() and gated.kv.num_free_blocks == gated.kv.num_blocks
    assert gated.scheduler.spec_stats == type(gated.scheduler.spec_stats)()
    prompts = _prompts(tokenizer)
    requests = {name: (prompts[name], SamplingParams(max_tokens=24, temperature=0.0)) for name in ("copy", "chat")}
    reference, ours = run_requests(plain, requests), run_requests(gated, requests)
    assert {n: output_tokens(o) for n, o in ours.items()} == {n: output_tokens(o) for n, o in reference.items()}


def test_stops_and_penalties_behave_as_without_speculation(engines, tokenizer):
    plain, spec = engines
    ids = _prompts(tokenizer)["copy"]
    reference = run_requests(plain, {"probe": (ids, SamplingParams(max_tokens=40, temperature=0.0))})["probe"]
    text = "".join(o.new_text for o in reference)
    stop_word = text.split()[12]  # well inside the copied run
    stop_token = output_tokens(reference)[20]
    cases = {
        "stop-string": SamplingParams(max_tokens=40, temperature=0.0, stop=(stop_word,)),
        "stop-token": SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop_token,)),
        "max-tokens": SamplingParams(max_tokens=17, temperature=0.0),
        "min-tokens": SamplingParams(max_tokens=40, min_tokens=30, temperature=0.0, stop_token_ids=(stop_token,)),
        "penalties": SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    }
    requests = {name: (ids, params) for name, params in cases.items()}
    reference, ours = run_requests(plain, requests), run_requests(spec, requests)
    for name in cases:
        assert output_tokens(ours[name]) == output_tokens(reference[name]), name
        assert "".join(o.new_text for o in ours[name]) == "".join(o.new_text for o in reference[name]), name
        assert (ours[name][-1].finish_reason, ours[name][-1].num_output_tokens) == (
            reference[name][-1].finish_reason, reference[name][-1].num_output_tokens), name
    assert ours["stop-string"][-1].num_accepted_tokens > 0


def test_seeded_sampling_draws_the_same_tokens(engines, tokenizer):
    plain, spec = engines
    ids = _prompts(tokenizer)["copy"]
    requests = {f"seed-{seed}": (ids, SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=seed))
                for seed in range(6)}
    reference, ours = run_requests(plain, requests), run_requests(spec, requests)
    for rid in requests:
        assert output_tokens(ours[rid]) == output_tokens(reference[rid]), rid
    assert sum(o[-1].num_accepted_tokens for o in ours.values()) > 0


def test_resumed_requests_continue_identically(engines, tokenizer):
    """What a migration does: another engine continues after output already delivered."""
    plain, spec = engines
    ids = _prompts(tokenizer)["copy"]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    whole = output_tokens(run_requests(plain, {"whole": (ids, params)})["whole"])
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=7)
    whole_seeded = output_tokens(run_requests(spec, {"whole": (ids, seeded)})["whole"])
    resumed = run_requests(spec, {"greedy": (ids, params), "seeded": (ids, seeded)},
                   {"greedy": Resumed(tuple(whole[:13])), "seeded": Resumed(tuple(whole_seeded[:13]))})
    assert whole[:13] + output_tokens(resumed["greedy"]) == whole
    assert whole_seeded[:13] + output_tokens(resumed["seeded"]) == whole_seeded


def test_aborts_and_preemption_leak_no_block_and_cache_only_verified_tokens(make_engine, tokenizer):
    # Room for about two of the four requests at a time: the rest are preempted and recomputed.
    engine = make_engine(speculative=SPEC, cache=CacheConfig(num_blocks=24, memory_bytes=None))
    params = SamplingParams(max_tokens=48, temperature=0.0)
    # Distinct prompts of about 8 blocks each (so no prefix is shared), 11 with their output.
    requests = {f"copy-{i}": (tokenizer.encode_chat([{"role": "user", "content": f"{verb}:\n\n{PASSAGE}"}]), params)
                for i, verb in enumerate(("Repeat", "Copy", "Echo", "Restate"))}
    for rid, (prompt, p) in requests.items():
        engine.add_request(rid, prompt, p)
    finished: dict[str, list[int]] = {rid: list(prompt) for rid, (prompt, _) in requests.items()}
    aborted = False
    while engine.has_unfinished():
        for output in engine.step():
            finished[output.request_id] += output.new_token_ids
        engine.kv.check_invariants()
        if not aborted and engine.scheduler.spec_stats.num_drafts > 2:
            assert engine.abort("copy-3")  # between verification steps, its drafts' slots held
            aborted = True
    assert aborted and engine.scheduler.total_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # Every hashed block holds a prefix of some request's verified tokens.
    block = engine.kv.block_size
    verified = set()
    for tokens in finished.values():
        parent = None
        for start in range(0, len(tokens) - block + 1, block):
            parent = hash_block(parent, tokens[start:start + block], engine.fingerprint)
            verified.add(parent)
    cached = {engine.kv._pool.block_hash(b) for b in range(engine.kv.num_blocks)} - {None}
    assert cached and cached <= verified


# ---- the sampled rule's distribution on a tiny model -------------------------------------------
VOCAB = 12


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory):
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig
    from unit.test_model_hf import save_random_model

    directory: Path = tmp_path_factory.mktemp("tiny")
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  initializer_range=1.0, tie_word_embeddings=False), directory)
    backend = BackendTokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t11"}))
    formats = {"dtype": "float32", "quantization": "none", "cpu_weights": "fp32"}
    config = {"model": str(directory), **formats, "cache": CacheConfig(num_blocks=512, memory_bytes=None)}
    plain = Engine(EngineConfig(**config))
    # One-token n-grams: in a vocabulary of 12 the last token nearly always recurs, so most steps draft.
    spec = build_engine(EngineConfig(**config, speculative=SpeculativeConfig(prompt_lookup_min=1,
                                                                             disable_by_batch_size=None, gate="off")))
    # A prompt that holds the model's own greedy continuation of its last tokens, so that drafts are
    # often among the likely tokens and both outcomes of verification occur.
    head = [1, 2, 3]
    greedy = run_requests(plain, {"g": (head, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))})["g"]
    return plain, spec, head + output_tokens(greedy) + head, config


def _exact_joint(engine: Engine, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(the whole output) under top-k sampling, from the model's own next-token distributions."""
    def next_probs(context: list[int]) -> dict[int, float]:
        engine.add_request("p", context, SamplingParams(max_tokens=1, temperature=0.0, logprobs=VOCAB))
        (output,) = [o for o in engine.step() if o.request_id == "p"]
        top = sorted(output.logprobs[0].top, key=lambda t: -t[1])[: params.top_k]
        weights = torch.tensor([lp for _, lp in top]).div(params.temperature).softmax(0).tolist()
        return {token: w for (token, _), w in zip(top, weights, strict=True)}

    joint = {(): 1.0}
    for _ in range(params.max_tokens):
        joint = {(*seq, t): p * q for seq, p in joint.items() for t, q in next_probs(prompt + list(seq)).items()}
    return joint


def _chi2_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile for a false alarm rate of 1e-3 (z is the normal's), by Wilson and
    Hilferty's approximation (within 1% from 3 degrees of freedom)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_tokens_follow_the_targets_distribution(tiny_engines):
    """Chi-square of 4,000 unseeded draws of four tokens (top-k 2: at most 16 outcomes) against their
    exact distribution, outcomes expected fewer than 5 times pooled into one cell; false alarm 1e-3."""
    plain, spec, prompt, _ = tiny_engines
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    expected = _exact_joint(plain, prompt, params)
    total, batch = 4000, 80
    counts: Counter[tuple[int, ...]] = Counter()
    for first in range(0, total, batch):
        outputs = run_requests(spec, {f"r{first + i}": (prompt, params) for i in range(batch)})
        counts.update(tuple(output_tokens(o)) for o in outputs.values())
    assert set(counts) <= set(expected)
    cells = [(counts[c], total * p) for c, p in expected.items() if total * p >= 5]
    rare = [(counts[c], total * p) for c, p in expected.items() if total * p < 5]
    if rare:
        cells.append((sum(n for n, _ in rare), sum(e for _, e in rare)))
    chi2 = sum((n - e) ** 2 / e for n, e in cells)
    assert len(cells) >= 4
    print(f"chi-square {chi2:.2f} over {len(cells)} cells, critical {_chi2_critical(len(cells) - 1):.2f}; "
          f"{spec.scheduler.spec_stats}")
    assert chi2 < _chi2_critical(len(cells) - 1), (chi2, counts, expected)
    stats = spec.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes were exercised


def test_seeded_draws_match_on_the_tiny_model(tiny_engines):
    plain, spec, prompt, _ = tiny_engines
    requests = {f"s{seed}": (prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True))
                for seed in range(40)}
    reference, ours = run_requests(plain, requests), run_requests(spec, requests)
    assert {rid: output_tokens(o) for rid, o in ours.items()} == {rid: output_tokens(o) for rid, o in reference.items()}


def test_an_engine_takes_a_proposer_exactly_when_its_config_speculates():
    """Refused before any load: an engine built without build_engine cannot lose its speculation unnoticed."""
    with pytest.raises(ValueError, match="speculative: a proposer goes with --speculative-config"):
        Engine(EngineConfig(speculative=SPEC))
    with pytest.raises(ValueError, match="speculative: a proposer goes with --speculative-config"):
        Engine(EngineConfig(), proposer=NgramProposer(1, 1))


# ---- a draft model -------------------------------------------------------------------------------
DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, disable_by_batch_size=None, gate="off")


def test_a_self_draft_changes_no_token_and_holds_no_block(tiny_engines):
    """The tiny model drafting for itself in the formats `auto` picks (bf16 here where the CPU has it)."""
    plain, _, prompt, config = tiny_engines
    spec = build_engine(EngineConfig(**config, speculative=DRAFT))
    requests = {f"g{i}": (prompt[i:], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i in range(4)}
    requests |= {f"s{seed}": (prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True))
                 for seed in range(8)}
    reference, ours = run_requests(plain, requests), run_requests(spec, requests)
    assert {rid: output_tokens(o) for rid, o in ours.items()} == {rid: output_tokens(o) for rid, o in reference.items()}
    stats = spec.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens > 0
    draft = spec._drafter.proposer.draft  # type: ignore[union-attr]
    assert draft.kv.num_free_blocks == draft.kv.num_blocks


def test_a_draft_with_another_vocabulary_or_too_many_layers_is_refused(tiny_engines, tmp_path):
    from transformers import LlamaConfig
    from unit.test_model_hf import save_random_model

    _, _, _, config = tiny_engines
    other = tmp_path / "other"
    save_random_model(LlamaConfig(vocab_size=VOCAB + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), other)
    (other / "tokenizer.json").write_text((Path(config["model"]) / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match=r"--speculative-config: model: .*vocabulary \(16 tokens\) is not the target"):
        build_engine(EngineConfig(**config, speculative=replace(DRAFT, model=str(other))))
    with pytest.raises(ValueError, match="--speculative-config: draft_layers: must be in \\[1, 2\\]"):
        build_engine(EngineConfig(**config, speculative=replace(DRAFT, draft_layers=3)))
    early = build_engine(EngineConfig(**config, speculative=replace(DRAFT, draft_layers=1)))
    assert len(early._drafter.proposer.draft.runner.model.layers) == 1  # type: ignore[union-attr]


def test_the_shipped_model_drafts_for_itself_in_its_own_4_bit_blocks(engines, make_engine, tokenizer):
    """A float32 target with its GGUF file's own 4-bit blocks as the draft: the same greedy tokens."""
    plain, _ = engines
    spec = make_engine(speculative=DRAFT)
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    requests = {name: (prompts[name], params) for name in ("chat", "plain")}
    reference, ours = run_requests(plain, requests), run_requests(spec, requests)
    names = sorted(requests)
    margins = [[lp.top[0][1] - lp.top[1][1] for o in reference[n] for lp in o.logprobs] for n in names]
    check_against([output_tokens(ours[n]) for n in names], [output_tokens(reference[n]) for n in names], margins,
                  "self-draft")
    draft = spec._drafter.proposer.draft  # type: ignore[union-attr]
    assert draft.formats.quantization == "gguf"
    assert spec.scheduler.spec_stats.num_accepted_tokens > 0.5 * spec.scheduler.spec_stats.num_draft_tokens


def test_a_decode_engine_drafts_on_pages_a_prefill_engine_shipped(engines, make_engine, tokenizer):
    """The disaggregated design with a draft model: the target's prompt KV comes from the prefill
    engine, the draft computes its own on the decode side; greedy tokens as colocated without drafts."""
    plain, _ = engines
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    names = ("chat", "copy")
    reference = run_requests(plain, {name: (prompts[name], params) for name in names})
    decode = make_engine(role="decode", speculative=DRAFT)
    ours = run_disaggregated(make_engine(role="prefill"), decode, [prompts[name] for name in names], params)
    margins = [[lp.top[0][1] - lp.top[1][1] for o in reference[n] for lp in o.logprobs] for n in names]
    check_against(ours, [output_tokens(reference[n]) for n in names], margins, "self-draft on a decode engine")
    assert decode.scheduler.spec_stats.num_accepted_tokens > 0
    draft = decode._drafter.proposer.draft  # type: ignore[union-attr]
    assert decode.kv.usage == 0 and draft.kv.num_free_blocks == draft.kv.num_blocks


def test_a_prediction_of_the_output_is_drafted_from_and_leaves_the_tokens_alone(engines, tokenizer):
    """OpenAI's `prediction`: a client that sends the text it expects gets it in fewer steps, the same
    tokens. Predicting the plain engine's own greedy reply, nearly every draft is accepted."""
    plain, spec = engines
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write two sentences about the sea."}])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = output_tokens(run_requests(plain, {"p": (prompt, params)})["p"])
    stats = spec.scheduler.spec_stats
    before = stats.snapshot()
    predicted = replace(params, prediction=tuple(expected))
    assert output_tokens(run_requests(spec, {"p": (prompt, predicted)})["p"]) == expected
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert drafted >= 20 and accepted >= 0.9 * drafted
    unlike = tokenizer.encode("Nothing like the reply at all.", add_special_tokens=False)
    wrong = replace(params, prediction=tuple(unlike))
    assert output_tokens(run_requests(spec, {"p": (prompt, wrong)})["p"]) == expected
    with pytest.raises(ValueError, match="prediction: token id"):
        spec.add_request("bad", prompt, replace(params, prediction=(10**9,)))
