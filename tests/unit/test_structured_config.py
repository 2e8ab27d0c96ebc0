"""`--structured-outputs-config` in vLLM's keys: llguidance behind "auto" and "guidance", vLLM's
other backends and unserved keys refused by name, and `disable_any_whitespace` making every JSON
constraint compact on the worker."""

from __future__ import annotations

import json

import pytest

from engine.structured.config import StructuredOutputsConfig
from engine.structured.grammars import Grammars
from engine.structured.spec import StructuredOutput

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})


def test_the_flag_takes_vllms_keys():
    assert StructuredOutputsConfig.from_json("{}") == StructuredOutputsConfig()
    config = StructuredOutputsConfig.from_json('{"backend": "guidance", "disable_any_whitespace": true,'
                                               ' "disable_additional_properties": false}')
    assert config == StructuredOutputsConfig("guidance", disable_any_whitespace=True)


@pytest.mark.parametrize(("text", "words"), [
    ('{"backend": "xgrammar"}', "backend: 'xgrammar' is not served"),
    ('{"backend": "fast"}', "backend: unknown 'fast'"),
    ('{"disable_additional_properties": true}', "disable_additional_properties: not served"),
    ('{"reasoning_parser": "deepseek_r1"}', "reasoning_parser: not served"),
    ('{"backnd": "auto"}', "unknown key 'backnd'"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace: must be true or false"),
    ("[]", "must be a JSON object"),
])
def test_what_is_not_served_is_refused_naming_the_flag_and_key(text, words):
    with pytest.raises(ValueError, match=r"^--structured-outputs-config: ") as refused:
        StructuredOutputsConfig.from_json(text)
    assert words in str(refused.value)


def test_disable_any_whitespace_makes_every_json_constraint_compact(tokenizer):
    spaced, compact = tokenizer.encode('{ "name"', add_special_tokens=False), tokenizer.encode(
        '{"name"', add_special_tokens=False)
    spec = StructuredOutput("json", SCHEMA)  # whitespace flexible, as requests default to
    for config, allows_space in ((StructuredOutputsConfig(), True),
                                 (StructuredOutputsConfig(disable_any_whitespace=True), False)):
        grammars = Grammars(tokenizer.backend_json(), tokenizer.vocab_size, list(tokenizer.eos_token_ids),
                            config=config)
        grammars.compile(spec)
        state = grammars.state(spec, [])
        assert (state.valid_prefix(spaced) == len(spaced)) == allows_space
        assert state.valid_prefix(compact) == len(compact)
