"""Request handling on the real model: bad input, aborts, stop strings, seeds and roles' edges."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.offline import generate
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_model_len=512, cache=CacheConfig(num_blocks=64, memory_bytes=None))


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 600, SamplingParams(), "prompt"),
        ([1, 2, 3], SamplingParams(max_tokens=510), "max_tokens"),
        ([1, 2, 49152], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
    ],
    ids=["empty", "too-long", "max-tokens-beyond-context", "oov", "negative-id"],
)
def test_bad_requests_are_refused_by_field(engine, prompt, params, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished() and engine.kv.usage == 0
    # The engine keeps serving.
    [done] = generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(done.token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"^request_id:"):
        engine.add_request("dup", [4, 5], SamplingParams(max_tokens=1))
    engine.abort("dup")
    assert engine.kv.usage == 0


def test_abort_at_every_stage_frees_all_blocks(engine, tokenizer):
    prompt = tokenizer.encode("The history of the printing press " * 30)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("queued", prompt, params)
    assert engine.abort("queued")  # before its first schedule
    engine.add_request("mid", prompt, params)
    engine.add_request("other", tokenizer.encode("Hello"), SamplingParams(max_tokens=3, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.kv.usage > 0
    assert engine.abort("mid")  # mid-decode
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.usage == 0
    assert not engine.abort("mid")  # unknown now


def test_stop_string_spanning_tokens(engine, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [full] = generate(engine, [prompt], greedy)
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the tail of token 3 and the head of token 4 spans two tokens.
    stop = pieces[3][-2:] + pieces[4][:2]
    assert len(stop) >= 3 and stop in full.text
    [stopped] = generate(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def test_same_seed_same_tokens_whatever_the_batch(engine, tokenizer):
    prompt = tokenizer.encode("Write a story about a dragon:")
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    [alone] = generate(engine, [prompt], seeded)
    others = [tokenizer.encode(t) for t in ("Hi", "Tell me a joke", "1, 2, 3,")]
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = generate(engine, [*others, prompt], [unseeded] * 3 + [seeded])
    assert batch[-1].token_ids == alone.token_ids
    [different] = generate(engine, [prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True))
    assert different.token_ids != alone.token_ids


def test_max_tokens_and_eos_finish(engine, tokenizer):
    [done] = generate(engine, [tokenizer.encode("Count: 1, 2, 3,")], SamplingParams(max_tokens=5, temperature=0.0))
    assert done.finish_reason in ("length", "stop") and len(done.token_ids) <= 5
    eos = tokenizer.eos_token_ids[0]
    [first] = generate(engine, [[1, 2]], SamplingParams(max_tokens=8, temperature=0.0))
    # Make the first greedy token a stop token id: generation ends on it with reason "stop".
    [stopped] = generate(engine, [[1, 2]], SamplingParams(max_tokens=8, temperature=0.0,
                                                          stop_token_ids=(first.token_ids[0], eos)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == first.token_ids[:1]
