"""The gateway's one check of a prompt (ServedModel.checked_prompt), shared by the gRPC and HTTP APIs."""

from __future__ import annotations

import pytest

from services.gateway.model import ServedModel
from services.gateway.request import ChatMessage, ChatPrompt, CheckedPrompt, TextPrompt, TokenPrompt


@pytest.fixture(scope="module")
def model(tokenizer) -> ServedModel:
    return ServedModel("smollm2", 8192, tokenizer)


@pytest.mark.parametrize(("ids", "bad", "position"), [((1, 49152, 2), 49152, 1), ((-1,), -1, 0)])
def test_a_token_id_outside_the_vocabulary_is_named_with_its_position(model, ids, bad, position):
    with pytest.raises(ValueError) as refused:
        model.checked_prompt(TokenPrompt(ids))
    assert str(refused.value) == (f"token_ids: id {bad} at position {position} is outside the vocabulary "
                                  f"of 49152 tokens")


def test_every_prompt_form_becomes_token_ids(model, tokenizer):
    assert model.checked_prompt(TokenPrompt((0, 49151))) == CheckedPrompt((0, 49151))
    assert model.checked_prompt(TextPrompt("Hello")) == CheckedPrompt(tuple(tokenizer.encode("Hello")))
    chat = [{"role": "user", "content": "Hi"}]
    expected = CheckedPrompt(tuple(tokenizer.encode_chat(chat)))
    assert model.checked_prompt(ChatPrompt((ChatMessage("user", "Hi"),))) == expected


@pytest.mark.parametrize(("prompt", "field"), [(TextPrompt(""), "text"), (TokenPrompt(()), "token_ids")])
def test_an_empty_prompt_is_refused_naming_its_field(model, prompt, field):
    with pytest.raises(ValueError, match=rf"^{field}: the prompt is empty$"):
        model.checked_prompt(prompt)


def test_a_checked_prompt_is_not_checked_again(model):
    # The HTTP API checks a prompt at its edge and hands the core the result for each of its choices.
    checked = model.checked_prompt(TokenPrompt((5, 6)))
    assert model.checked_prompt(checked) is checked
