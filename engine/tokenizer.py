"""Text <-> token ids, from a GGUF file's metadata or a Hugging Face tokenizer directory.

The gateway tokenizes in a process that never loads the model, so this module imports no torch.
The BPE itself is the `tokenizers` library's; this module only assembles it the way the model's
files describe and adds what HF tokenizers carry around it (BOS policy, chat template, EOS set).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.chat_template import ChatTemplate
from engine.model.gguf_file import gguf_reader

logger = logging.getLogger(__name__)

# SentencePiece writes a space as this marker inside pieces.
_SPACE_MARKER = "\u2581"

# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) for vocabularies trained with one
# pre-token per numeric character (the StarCoder family, SmolLM among them).
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
# Vocabularies trained on a split regex other than GPT-2's. Llama 3's tokenizer also looks whole
# pre-tokens up in the vocabulary before merging (`ignore_merges`), as llama.cpp does for it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen"})
_GPT2_PRES = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"})

# Distinctive stand-ins rendered through the chat template to find what ends an assistant turn.
_PROBE_PROMPT = "tandem-probe-question"
_PROBE_REPLY = "tandem-probe-answer"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest take code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


_CHAR_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}


class Tokenizer:
    """A model's tokenizer: encoding, decoding, chat formatting and the ids that end generation.

    `eos_token_ids` holds the config's EOS plus any other id that ends a reply (the chat template's
    end-of-turn token, generation_config.json's extra EOS ids). `byte_fallback_ids` are the ids the
    decoder turns into one raw byte each (SentencePiece byte fallback); empty for byte-level BPE.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        vocab_size: int,
        bos_token: str | None,
        eos_token: str | None,
        bos_eos_flags: tuple[bool, bool] | None,
        chat_template: str | None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        """Wrap a `tokenizers` backend.

        `bos_eos_flags` is `(add_bos, add_eos)` for `encode`; None leaves it to the backend's post-processor.
        `extra_eos_ids` are further ids that end generation (e.g. from generation_config.json).
        """
        self._backend = backend
        self._bos_eos_flags = bos_eos_flags
        self.vocab_size = vocab_size
        special_strings = {
            name: token for name, token in (("bos_token", bos_token), ("eos_token", eos_token)) if token is not None
        }
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self._eos_token_id = backend.token_to_id(eos_token) if eos_token is not None else None
        added = backend.get_added_tokens_decoder()
        self._added_contents = {token_id: token.content for token_id, token in added.items()}
        self.special_token_ids = frozenset(token_id for token_id, token in added.items() if token.special)

        decoder_steps = _decoder_step_types(backend)
        self._byte_level = "ByteLevel" in decoder_steps
        self.byte_fallback_ids = frozenset()
        if "ByteFallback" in decoder_steps:
            candidates = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
            self.byte_fallback_ids = frozenset(token_id for token_id in candidates if token_id is not None)

        self._special_strings = special_strings
        self._chat_template = ChatTemplate(chat_template, special_strings) if chat_template else None
        eos_ids = [self._eos_token_id, *extra_eos_ids, self._turn_terminator_id()]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))

    @classmethod
    def from_path(cls, path: str) -> Tokenizer:
        """Load from a `.gguf` file (tokenizer in its metadata) or a Hugging Face tokenizer directory."""
        location = Path(path)
        if location.is_dir():
            return _load_hf_directory(location)
        if location.suffix == ".gguf" and location.is_file():
            return _load_gguf(location)
        raise FileNotFoundError(f"{path}: neither a .gguf file nor a directory with tokenizer.json")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        With `add_special_tokens`, BOS/EOS are added only where the model's tokenizer config asks for them.
        """
        if self._bos_eos_flags is None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            add_bos, add_eos = self._bos_eos_flags
            if add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if add_eos and self._eos_token_id is not None:
                ids.append(self._eos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; an invalid or incomplete UTF-8 sequence becomes U+FFFD, unknown ids are dropped."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] = ()) -> str:
        """Render a conversation with the model's chat template (sandboxed Jinja, as HF renders it).

        `messages` may hold OpenAI's assistant `tool_calls` and `tool` messages, and `tools` its tool
        objects (engine.chat_template says how they are rendered).
        Raises ValueError when there is no template, the messages are malformed or the template rejects them.
        """
        if self._chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self._chat_template.render(messages, add_generation_prompt, tools)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """Token ids of the rendered conversation; the template already wrote any BOS it wants."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer rendering chats with `source` instead of the model's template (vLLM's
        `--chat-template`); ValueError if it does not compile."""
        replaced = copy.copy(self)
        replaced._chat_template = ChatTemplate(source, self._special_strings)
        return replaced

    def backend_json(self) -> str:
        """The `tokenizers` backend serialized (what a grammar library reads the vocabulary from)."""
        return self._backend.to_str()

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether `other` maps every token to the same id (added tokens included)."""
        return self.vocab_size == other.vocab_size and \
            self._backend.get_vocab(with_added_tokens=True) == other._backend.get_vocab(with_added_tokens=True)

    def id_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; a token may hold only part of a multi-byte character."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        # Mirrors the decoder, which added tokens go through too.
        if self._byte_level:
            # A token outside the byte alphabet stands for its own text, as in the ByteLevel decoder.
            if all(char in _CHAR_TO_BYTE for char in token):
                return bytes(_CHAR_TO_BYTE[char] for char in token)
            return token.encode("utf-8")
        if token_id in self.byte_fallback_ids:
            return bytes([int(token[3:5], 16)])
        return token.replace(_SPACE_MARKER, " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special (control) token, which `decode` drops by default."""
        return token_id in self.special_token_ids

    def _turn_terminator_id(self) -> int | None:
        """The special token the chat template writes right after an assistant reply, if any.

        Chat models stop on it (ChatML's <|im_end|>, Llama 3's <|eot_id|>) even when the config's EOS differs.
        """
        if self._chat_template is None:
            return None
        probe = [{"role": "user", "content": _PROBE_PROMPT}, {"role": "assistant", "content": _PROBE_REPLY}]
        try:
            rendered = self.apply_chat_template(probe, add_generation_prompt=False)
        except ValueError:
            return None
        _, found, tail = rendered.rpartition(_PROBE_REPLY)
        if not found:
            return None
        tail = tail.lstrip()
        matches = [
            (len(self._added_contents[token_id]), token_id)
            for token_id in self.special_token_ids
            if tail.startswith(self._added_contents[token_id])
        ]
        return max(matches)[1] if matches else None


def _decoder_step_types(backend: BackendTokenizer) -> set[str]:
    """The `type` of every step in the backend's decoder, nested sequences included."""
    if backend.decoder is None:
        return set()
    types: set[str] = set()
    pending = [json.loads(backend.decoder.__getstate__())]
    while pending:
        step = pending.pop()
        types.add(step["type"])
        pending.extend(step.get("decoders", []))
    return types


def _byte_level_pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer the vocabulary was trained with, from llama.cpp's name for it."""
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_PRES:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with GPT-2's regex", pre)
    return byte_level


def _load_gguf(path: Path) -> Tokenizer:
    reader = gguf_reader(path)

    model = reader.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = reader.get("tokenizer.ggml.tokens")
    token_types: list[int] = reader.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    merges = [tuple(merge.split(" ", 1)) for merge in reader.get("tokenizer.ggml.merges", [])]
    pre = reader.get("tokenizer.ggml.pre", "default")

    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRES))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre, reader.get("tokenizer.ggml.add_space_prefix", False))
    backend.decoder = decoders.ByteLevel()
    # Both kinds are matched whole in text, as llama.cpp does; only control tokens are special.
    backend.add_tokens([
        AddedToken(token, special=kind == TokenType.CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ])

    def token_at(key: str) -> str | None:
        token_id = reader.get(key)
        return tokens[token_id] if token_id is not None else None

    end_of_turn_ids = [reader.get(key) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    return Tokenizer(
        backend,
        vocab_size=len(tokens),
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        bos_eos_flags=(reader.get("tokenizer.ggml.add_bos_token", False),
                       reader.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=reader.get("tokenizer.chat_template"),
        extra_eos_ids=[token_id for token_id in end_of_turn_ids if token_id is not None],
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(entry: str | Mapping[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    return entry.get("content") if isinstance(entry, Mapping) else entry


def _load_hf_directory(directory: Path) -> Tokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config = _read_json(directory / "tokenizer_config.json")
    special_tokens_map = _read_json(directory / "special_tokens_map.json")

    template_file = directory / "chat_template.jinja"  # where recent transformers save it
    chat_template = config.get("chat_template")
    if template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    if isinstance(chat_template, list):  # older configs keep named templates; "default" is the chat one
        chat_template = next((entry["template"] for entry in chat_template if entry.get("name") == "default"), None)

    bos_eos_flags = None
    if "add_bos_token" in config or "add_eos_token" in config:
        bos_eos_flags = (bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))

    generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id", [])
    vocabulary = backend.get_vocab(with_added_tokens=True)
    return Tokenizer(
        backend,
        vocab_size=max(vocabulary.values()) + 1,
        bos_token=_token_content(config.get("bos_token", special_tokens_map.get("bos_token"))),
        eos_token=_token_content(config.get("eos_token", special_tokens_map.get("eos_token"))),
        bos_eos_flags=bos_eos_flags,
        chat_template=chat_template,
        extra_eos_ids=[generation_eos] if isinstance(generation_eos, int) else generation_eos,
    )
