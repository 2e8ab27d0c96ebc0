"""Structured outputs in the engine (engine.structured) on the shipped model: every kind's output
matches its constraint at temperatures 0 and 1 in one continuous batch with free requests;
constrained greedy output is the same batched or alone, with speculation, and resumed from tokens
another engine generated (what a decode worker and a migrated request do); logprobs are those of
the constrained distribution; a spec that does not compile is refused naming the field."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from engine_runs import output_tokens, run_requests

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.resume import Resumed
from engine.sampling_params import SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.structured.grammars import GrammarLimits, Grammars, GrammarsBusy
from engine.structured.spec import MAX_SPEC_BYTES, StructuredOutput

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "population": {"type": "integer"},
                                         "country": {"enum": ["France", "Italy", "Spain"]}},
        "required": ["name", "population", "country"], "additionalProperties": False}
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
TAG = {"structures": [{"begin": "<city>", "schema": CITY, "end": "</city>"}], "triggers": ["<city>"]}
SPECS = {
    "json": StructuredOutput("json", json.dumps(CITY)),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", r"[0-9]{3}-[A-Z]{2}"),
    "choice": StructuredOutput.choice(["Paris", "Lyon", "Marseille"]),
    "grammar": StructuredOutput("grammar", LARK),
    "structural_tag": StructuredOutput("structural_tag", json.dumps(TAG)),
}
QUESTIONS = ["Describe the largest city of France as JSON.", "Name a city in Italy.",
             "Answer with a code.", "Is the sea salty?"]


def matches(kind: str, text: str) -> bool:
    """Whether `text` is what SPECS[kind] allows."""
    if kind in ("json", "json_object"):
        value = json.loads(text)
        if kind == "json":
            jsonschema.validate(value, CITY)
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[A-Z]{2}", text) is not None
    if kind == "choice":
        return text in ("Paris", "Lyon", "Marseille")
    if kind == "grammar":
        return re.fullmatch(r"The answer is (yes|no|maybe)\.", text) is not None
    for body in re.findall(r"<city>(.*?)</city>", text, flags=re.S):
        jsonschema.validate(json.loads(body), CITY)
    return text.count("<city>") == text.count("</city>")


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outputs)


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_every_kind_matches_its_constraint_in_a_batch_with_free_requests(engine, prompts):
    requests = {}
    for kind, spec in SPECS.items():
        for temperature in (0.0, 1.0):
            for i, prompt in enumerate(prompts):
                requests[f"{kind}-{temperature}-{i}"] = (prompt, SamplingParams(
                    max_tokens=96, temperature=temperature, seed=i, structured=spec))
    requests |= {f"free-{i}": (prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=i))
                 for i, prompt in enumerate(prompts)}
    outputs = run_requests(engine, requests)
    for rid, outs in outputs.items():
        kind = rid.split("-")[0]
        if kind == "free":
            continue
        if kind == "structural_tag" or outs[-1].finish_reason == "stop":
            assert matches(kind, _text(outs)), (rid, _text(outs))
        else:  # out of tokens inside a long value: what came is still a prefix the grammar allows
            assert kind in ("json", "json_object") and outs[-1].finish_reason == "length", rid


def test_constrained_greedy_output_is_the_same_alone_batched_speculating_and_resumed(engine, make_engine, prompts):
    params = SamplingParams(max_tokens=48, temperature=0.0, structured=SPECS["json"])
    alone = output_tokens(run_requests(engine, {"a": (prompts[0], params)})["a"])
    batched = run_requests(engine, {"a": (prompts[0], params), "b": (prompts[1], params),
                            "c": (prompts[2], SamplingParams(max_tokens=30, temperature=0.0))})
    assert output_tokens(batched["a"]) == alone
    speculating = make_engine(speculative=SpeculativeConfig(num_speculative_tokens=4, gate="off"))
    assert output_tokens(run_requests(speculating, {"a": (prompts[0], params)})["a"]) == alone
    # Copying a JSON text the prompt holds: n-gram drafts, verified under the grammar.
    record = '{"name": "Lyon", "population": 522250, "country": "France"}'
    copy = engine.tokenizer.encode_chat([{"role": "user", "content": f"Repeat exactly: {record} {record}"}])
    reference = output_tokens(run_requests(engine, {"c": (copy, params)})["c"])
    assert output_tokens(run_requests(speculating, {"c": (copy, params)})["c"]) == reference
    assert speculating.scheduler.spec_stats.num_accepted_tokens > 0
    # A decode worker (or a migrated request's new worker) continues from the tokens already out.
    resumed = run_requests(engine, {"a": (prompts[0], params)}, {"a": Resumed(tuple(alone[:7]))})
    assert alone[:7] + output_tokens(resumed["a"]) == alone


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_kind_resumes_its_grammar_from_the_tokens_already_out(engine, prompts, kind):
    """What a decode worker and a migrated request's new worker do: rebuild the grammar from the spec
    and the output so far, then continue as the request would have."""
    prompt = prompts[QUESTIONS.index("Describe the largest city of France as JSON.")]
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=SPECS[kind])
    alone = output_tokens(run_requests(engine, {"a": (prompt, params)})["a"])
    assert len(alone) >= 2, (kind, alone)
    cut = len(alone) // 2
    resumed = run_requests(engine, {"a": (prompt, params)}, {"a": Resumed(tuple(alone[:cut]))})
    assert alone[:cut] + output_tokens(resumed["a"]) == alone


def test_drafts_the_grammar_forbids_are_cut_before_verification(engine, prompts):
    state = engine.grammars.state(SPECS["regex"], [])
    digits = engine.tokenizer.encode("123", add_special_tokens=False)
    assert state.valid_prefix([*digits, *engine.tokenizer.encode("abc", add_special_tokens=False)]) == len(digits)
    masks = state.allowed(digits)
    assert masks.shape[0] == len(digits) + 1
    assert state.valid_prefix(digits) == len(digits), "computing the masks leaves the state where it was"


def test_logprobs_are_of_the_constrained_distribution(engine, prompts):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, structured=SPECS["choice"])
    outputs = run_requests(engine, {"a": (prompts[1], params)})["a"]
    first = outputs[0].logprobs[0]
    finite = [(token, logprob) for token, logprob in first.top if logprob > -math.inf]
    # Every token the grammar allows first is the start of a choice.
    assert finite and all(any(choice.startswith(engine.tokenizer.decode([token])) for choice in
                              ("Paris", "Lyon", "Marseille")) for token, _ in finite)
    free = run_requests(engine, {"a": (prompts[1], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))})["a"]
    assert free[0].logprobs[0].top != first.top  # the constrained distribution, not the model's
    whole = math.fsum(math.exp(logprob) for _, logprob in first.top)
    assert 0 < whole <= 1 + 1e-6 and first.logprob == dict(first.top)[first.token_id]


def test_penalties_stop_strings_and_min_tokens_keep_the_constraint(engine, prompts):
    params = SamplingParams(max_tokens=96, temperature=0.7, seed=3, repetition_penalty=1.3, frequency_penalty=0.5,
                            min_tokens=4, structured=SPECS["json"])
    text = _text(run_requests(engine, {"a": (prompts[0], params)})["a"])
    jsonschema.validate(json.loads(text), CITY)
    stopped = SamplingParams(max_tokens=96, temperature=0.0, stop=('"population"',), structured=SPECS["json"])
    outputs = run_requests(engine, {"a": (prompts[0], stopped)})["a"]
    assert outputs[-1].finish_reason == "stop" and '"population"' not in _text(outputs)


@pytest.mark.parametrize(("spec", "reason"), [
    (StructuredOutput("regex", "(a"), "[^$]*unclosed group"),
    (StructuredOutput("grammar", "start: missing"), "[^$]*unknown name"),
    (StructuredOutput("json", '{"type": "nope"}'), ".*nope"),
    (StructuredOutput("json", "{not json"), "key must be a string"),
    (StructuredOutput("structural_tag", '{"structures": []}'), ".*triggers"),
])
def test_a_spec_that_does_not_compile_is_refused_naming_the_field_and_the_reason(engine, prompts, spec, reason):
    with pytest.raises(ValueError, match=f"{re.escape(spec.field)}: {reason}"):
        engine.add_request("bad", prompts[0], SamplingParams(max_tokens=8, structured=spec))
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_blocks
    with pytest.raises(ValueError, match=re.escape(spec.field)):
        engine.grammars.compile(spec)


def test_specs_are_bounded_in_size_and_compile_time(engine):
    with pytest.raises(ValueError, match="more than the"):
        StructuredOutput("regex", "a" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(ValueError, match="one of"):
        StructuredOutput("xml", "x")  # type: ignore[arg-type]
    nested: dict = {"type": "string"}
    for _ in range(11):  # 231 KB: 0.2 s of compiling on an AMD EPYC core (grammar_backends)
        nested = {"type": "object", "properties": {"a": nested, "b": {"type": "array", "items": nested}}}
    slow = StructuredOutput("json", json.dumps(nested))
    grammars = Grammars(engine.tokenizer.backend_json(), engine.model_config.vocab_size, [2])
    with pytest.raises(ValueError, match=r"did not compile within 0\.002 s"):
        grammars.compile(slow, timeout_s=0.002)
    with pytest.raises(ValueError, match="did not compile within"):
        grammars.compile(slow)  # remembered: refused at once, not compiled again
    grammars.compile(SPECS["regex"])  # another spec compiles while the slow one may still run
    busy = Grammars(engine.tokenizer.backend_json(), engine.model_config.vocab_size, [2],
                    GrammarLimits(max_compiling=1))
    with pytest.raises(ValueError, match="did not compile within"):
        busy.compile(slow, timeout_s=0.002)
    with pytest.raises(GrammarsBusy, match="1 grammars are compiling"):
        busy.compile(SPECS["choice"])
