"""IncrementalDetokenizer: streamed text equals one-shot decoding, characters split across tokens are held.

Runs on SmolLM2's byte-level BPE (from its GGUF) and on tiny SentencePiece-style tokenizers (byte
fallback, leading-space marker) built here with the `tokenizers` library, in the two layouts Llama 2
tokenizer.json files use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a streaming detokenizer must hold back bytes until a character is complete",
    "prefill and decode run on different engines and the cache moves between them",
    "café crème and a naïve résumé",
    "numbers like 42 and 1999 show up in text too",
] * 20

LLAMA2_STYLE_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)

# Text pieces to glue into hypothesis inputs: multi-byte characters, spaces at odd places, special tokens.
PIECES = ["the", " quick", "  ", "\n", "日本語", "🤖", "👩\u200d👧", "é", " 42", "龘", "<s>", "</s>", "<|im_end|>", "x"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=12).map("".join)


def build_sentencepiece_style_dir(directory: Path, layout: str) -> Path:
    """A Llama-2-like tokenizer directory: BPE pieces with a '▁' space marker and <0xNN> byte fallback.

    `layout` "normalizer" prepends/replaces '▁' in a normalizer and strips the first space in the decoder
    (legacy Llama 2); "metaspace" uses the Metaspace pre-tokenizer and decoder.
    """
    trainer_tokenizer = BackendTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer_tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=250, show_progress=False))
    learned = json.loads(trainer_tokenizer.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [*specials, *(f"<0x{byte:02X}>" for byte in range(256))]
    pieces += [piece for piece in sorted(learned["vocab"], key=learned["vocab"].get) if piece not in pieces]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in learned["merges"]]

    vocab = {piece: index for index, piece in enumerate(pieces)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                          fuse_unk=True))
    if layout == "normalizer":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(
            [decoders.Metaspace(prepend_scheme="first", split=False), decoders.ByteFallback(), decoders.Fuse()]
        )
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])

    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "add_eos_token": False, "chat_template": LLAMA2_STYLE_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def smollm(tokenizer: Tokenizer) -> Tokenizer:
    """SmolLM2's tokenizer, read from its GGUF by the session fixture."""
    return tokenizer


@pytest.fixture(scope="module", params=["normalizer", "metaspace"])
def sentencepiece(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = build_sentencepiece_style_dir(tmp_path_factory.mktemp(request.param), request.param)
    return Tokenizer.from_path(str(directory))


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


def assert_characters_never_torn(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    torn = [tokenizer.id_to_bytes(i) for i in ids if not _is_utf8(tokenizer.id_to_bytes(i))]
    assert torn, f"precondition: some character of {text!r} must be split across tokens"
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    for char in "龘🤖日":
        assert any(char in delta for delta in deltas), f"{char!r} was cut between deltas"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_byte_level_holds_split_characters_until_complete(smollm: Tokenizer) -> None:
    assert_characters_never_torn(smollm, "Robots 龘🤖 say 日本 hi")


def test_byte_fallback_holds_split_characters_until_complete(sentencepiece: Tokenizer) -> None:
    assert sentencepiece.id_to_bytes(sentencepiece.encode("日", add_special_tokens=False)[-1]) == "日".encode()[-1:]
    assert_characters_never_torn(sentencepiece, "the fox 龘🤖 saw 日本")


def test_incomplete_character_at_the_end_is_flushed_as_replacement(smollm: Tokenizer) -> None:
    ids = smollm.encode("ok 🤖", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(smollm)
    streamed = "".join(detokenizer.push(token_id) for token_id in ids)
    assert streamed == "ok" and smollm.decode(ids) == "ok \ufffd"
    assert detokenizer.flush() == " \ufffd"


def test_byte_run_is_held_while_a_later_byte_can_invalidate_it(sentencepiece: Tokenizer) -> None:
    # The byte-fallback decoder converts a whole run of byte tokens at once: 'A' alone decodes to "A",
    # but followed by a lone lead byte the run becomes "\ufffd\ufffd", so "A" must not be released early.
    byte_a, lead_byte = sentencepiece.encode("A", False)[-1], sentencepiece.encode("日", False)[-3]
    word = sentencepiece.encode(" the", False)[-1]
    ids = [word, byte_a, lead_byte, word]
    assert sentencepiece.decode([word, byte_a]) == "theA"
    deltas = stream(sentencepiece, ids)
    assert deltas[1:3] == ["", ""]
    assert "".join(deltas) == sentencepiece.decode(ids) == "the\ufffd\ufffd the"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_or_kept(smollm: Tokenizer, skip_special_tokens: bool) -> None:
    text = "<|im_start|>assistant\nHello 🤖!<|im_end|>"
    deltas = stream(smollm, smollm.encode(text), skip_special_tokens)
    assert "".join(deltas) == (text if not skip_special_tokens else "assistant\nHello 🤖!")


def test_leading_space_follows_decode(sentencepiece: Tokenizer) -> None:
    ids = sentencepiece.encode("the quick fox")
    assert ids[0] == sentencepiece.bos_token_id
    assert stream(sentencepiece, ids)[:3] == ["", "the", " quick"]
    assert "".join(stream(sentencepiece, ids, skip_special_tokens=False)) == "<s> the quick fox"


def test_each_step_decodes_only_a_short_window(smollm: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = smollm.encode("Streaming 日本語 and 🤖 emoji, line after line.\n" * 40)
    decoded_lengths: list[int] = []
    original_decode = smollm.decode

    def spying_decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(token_ids))
        return original_decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(smollm, "decode", spying_decode)
    assert "".join(stream(smollm, ids)) == original_decode(ids)
    assert len(ids) > 400 and max(decoded_lengths) <= 8


@settings(max_examples=examples(150), deadline=None)
@given(text=texts, data=st.data(), skip_special_tokens=st.booleans())
def test_stream_equals_decode_for_slices_of_real_text(smollm: Tokenizer, sentencepiece: Tokenizer, text: str,
                                                      data: st.DataObject, skip_special_tokens: bool) -> None:
    for tokenizer in (smollm, sentencepiece):
        ids = tokenizer.encode(text)
        start = data.draw(st.integers(0, len(ids)))
        sliced = ids[start:data.draw(st.integers(start, len(ids)))]
        assert "".join(stream(tokenizer, sliced, skip_special_tokens)) == tokenizer.decode(sliced, skip_special_tokens)


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_stream_equals_decode_for_arbitrary_ids(smollm: Tokenizer, sentencepiece: Tokenizer, data: st.DataObject,
                                                skip_special_tokens: bool) -> None:
    for tokenizer in (smollm, sentencepiece):
        # Low ids are the special and byte tokens, where the decoders' corner cases live.
        token_id = st.one_of(st.integers(0, 300), st.integers(0, tokenizer.vocab_size - 1))
        ids = data.draw(st.lists(token_id, max_size=16))
        assert "".join(stream(tokenizer, ids, skip_special_tokens)) == tokenizer.decode(ids, skip_special_tokens)


def test_sentencepiece_directory_tokenizer(sentencepiece: Tokenizer) -> None:
    text = "the lazy dog: 日本 🤖 café"
    ids = sentencepiece.encode(text)
    assert ids[0] == sentencepiece.bos_token_id == 1 and sentencepiece.eos_token_ids == (2,)
    assert sentencepiece.decode(ids) == text
    assert b"".join(sentencepiece.id_to_bytes(i) for i in ids[1:]).lstrip(b" ") == text.encode()
    assert len(sentencepiece.byte_fallback_ids) == 256 and sentencepiece.special_token_ids == {0, 1, 2}
    chat = sentencepiece.encode_chat([{"role": "user", "content": "hi"}])
    assert chat.count(sentencepiece.bos_token_id) == 1 and chat[0] == sentencepiece.bos_token_id
