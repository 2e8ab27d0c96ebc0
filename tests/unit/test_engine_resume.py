"""A request resumed from output another engine already streamed (the gateway's migration) continues
that stream exactly: the same tokens, and text that joins the client's text with no gap and no
duplicate, across multi-byte characters and stop strings that span the boundary."""

from __future__ import annotations

import pytest
from disaggregated import import_all, prefill_into

from engine.engine import Engine
from engine.offline import generate
from engine.outputs import KVReservation, RequestOutput
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStringMatcher

# Greedy continuations of these hold text back often: accented letters, CJK characters split over
# byte tokens, an emoji.
PROMPTS = {
    "mixed": "Café, naïve, Grüße, Ærø, 日本語, 🙂.\nRepeat the list: Café,",
    "japanese": "東京は日本の首都です。東京",
}


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine()


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams, Resumed | None]]
         ) -> dict[str, list[RequestOutput]]:
    """Every request added at once, stepped to the end; each one's outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    for request_id, (prompt, params, resumed) in requests.items():
        engine.add_request(request_id, prompt, params, resumed)
        outputs[request_id] = []
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


@pytest.mark.parametrize(("prompt", "stop"), [
    ("mixed", ()),
    ("mixed", ("üße",)),  # completes one token after the split that holds "üß" back
    ("mixed", (", 日本",)),  # spans a character the detokenizer holds back
    ("japanese", ()),  # ends in an unfinished character, flushed as U+FFFD
    ("japanese", ("の首",)),
])
def test_resumed_stream_joins_the_delivered_text(engine, tokenizer, prompt, stop):
    ids = tokenizer.encode(PROMPTS[prompt])
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=stop)
    whole = _run(engine, {f"{prompt}-{stop}": (ids, params, None)})[f"{prompt}-{stop}"]
    tokens = [o.new_token_ids[0] for o in whole]
    texts = [o.new_text for o in whole]
    splits = range(1, len(tokens))
    assert len(tokens) > 3, "the request must run long enough to be split"
    # What the client holds after k tokens, and the same split where the engine works out the text.
    delivered = {k: "".join(texts[:k]) for k in splits}
    requests = {f"told-{k}": (ids, params, Resumed(tuple(tokens[:k]), len(delivered[k]))) for k in splits}
    requests |= {f"replayed-{k}": (ids, params, Resumed(tuple(tokens[:k]))) for k in splits}
    resumed = _run(engine, requests)
    for name, outputs in resumed.items():
        k = int(name.rsplit("-", 1)[1])
        assert [t for o in outputs for t in o.new_token_ids] == tokens[k:], name
        assert delivered[k] + "".join(o.new_text for o in outputs) == "".join(texts), name
        last = outputs[-1]
        assert (last.finish_reason, last.num_output_tokens, last.num_prompt_tokens) == (
            whole[-1].finish_reason, len(tokens), len(ids)), name
    # The splits include ones where the first engine held text back (so the test can fail).
    assert any(len(delivered[k]) < len(tokenizer.decode(tokens[:k])) for k in splits)
    assert not engine.scheduler.requests and engine.kv.usage == 0


@pytest.mark.parametrize("stop", [(), ("xyz",)], ids=["no-stop-strings", "stop-strings"])
def test_held_text_comes_first_in_the_next_feed(stop):
    matcher = StopStringMatcher(stop)
    matcher.hold("ab")
    assert matcher.feed("c") == ("abc", False)


def _disaggregated_resume(prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams,
                          resumed: Resumed) -> list[int]:
    """A resumed request's path through a prefill and a decode engine: the prefill computes the
    prompt and the delivered output, its KV moves, the decode engine generates the rest."""
    reservation = decode.reserve("moved", prompt, params, resumed)
    assert isinstance(reservation, KVReservation)
    first, pages = prefill_into(prefill, "moved", prompt, params, reservation.num_cached_tokens, resumed)
    import_all(decode, reservation, pages, prefill.model_config.num_layers)
    output = decode.start_decode("moved", first)
    tokens = list(output.new_token_ids)
    while not output.finished:
        [output] = decode.step()
        tokens.extend(output.new_token_ids)
    assert output.num_output_tokens == len(resumed.output_token_ids) + len(tokens)
    assert output.num_prompt_tokens == len(prompt)
    return tokens


@pytest.mark.parametrize("params", [
    # The penalties must see the delivered output, or the continuation would differ.
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
    # The generator must be advanced past the delivered tokens' draws.
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
], ids=["greedy-penalised", "seeded"])
def test_resumed_request_continues_in_every_role(make_engine, engine, tokenizer, params):
    prompt = tokenizer.encode("The history of paged attention in inference servers")
    [whole] = generate(engine, [prompt], params)
    resumed = Resumed(tuple(whole.token_ids[:9]))
    [local] = _run(engine, {"local": (prompt, params, resumed)}).values()
    assert [t for o in local for t in o.new_token_ids] == whole.token_ids[9:]
    prefill, decode = make_engine(role="prefill"), make_engine(role="decode")
    assert _disaggregated_resume(prefill, decode, prompt, params, resumed) == whole.token_ids[9:]
    assert prefill.kv.usage == 0 and decode.kv.usage == 0


def test_a_resume_that_cannot_be_served_is_refused_by_field(engine, tokenizer):
    prompt = tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="output_token_ids: 4 tokens already reach max_tokens=4"):
        engine.add_request("full", prompt, params, Resumed((1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"output_token_ids: token id \d+ is outside the vocabulary"):
        engine.add_request("bad", prompt, params, Resumed((10**7,)))
    hello = tuple(tokenizer.encode(" Hello", add_special_tokens=False))
    with pytest.raises(ValueError, match="output_text_length: 99 characters"):
        engine.reserve("long", prompt, params, Resumed(hello, 99))
    with pytest.raises(ValueError, match="output_text_length: must be >= 0"):
        Resumed(hello, -1)
    assert not engine.scheduler.requests and engine.kv.usage == 0
