"""The model a gateway serves: its name, context length and tokenizer, read without torch.

The gateway never loads weights: it only tokenizes, so it reads the model file's metadata and
tokenizer and leaves the tensors to the workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.model.paths import default_model_path, served_model_id
from engine.tokenizer import Tokenizer
from services.gateway.request import CheckedPrompt, Prompt, TextPrompt, TokenPrompt


@dataclass(frozen=True)
class ServedModel:
    """What the gateway needs of its model: the id clients name, the context length, the tokenizer."""

    id: str
    max_model_len: int
    tokenizer: Tokenizer

    @classmethod
    def load(cls, path: str | None, max_model_len: int | None = None) -> ServedModel:
        """Read a .gguf file or an HF directory (None = the shipped model); `max_model_len`
        overrides the model's own context length."""
        source = path or default_model_path()
        if not os.path.exists(source):
            raise FileNotFoundError(f"model path {source!r} does not exist")
        tokenizer = Tokenizer.from_path(source)
        return cls(served_model_id(source), max_model_len or _context_length(source), tokenizer)

    def checked_prompt(self, prompt: Prompt) -> CheckedPrompt:
        """The prompt as token ids, checked: the gateway's one check of a prompt on either API.
        ValueError naming the field ("text", "token_ids" or "chat") when it is unusable. A
        CheckedPrompt is returned as it is (this checked it when it made it), so the HTTP API checks
        its prompts at its edge and the core those of the gRPC API. Its length is for
        services.gateway.limits to judge."""
        if isinstance(prompt, CheckedPrompt):
            return prompt
        if isinstance(prompt, TextPrompt):
            kind, ids = "text", self.tokenizer.encode(prompt.text)
        elif isinstance(prompt, TokenPrompt):
            kind, ids = "token_ids", list(prompt.ids)
            for position, token_id in enumerate(ids):
                if not 0 <= token_id < self.tokenizer.vocab_size:
                    raise ValueError(f"token_ids: id {token_id} at position {position} is outside the "
                                     f"vocabulary of {self.tokenizer.vocab_size} tokens")
        else:
            messages = [message.openai() for message in prompt.messages]
            try:
                kind, ids = "chat", self.tokenizer.encode_chat(messages, tools=[t.openai() for t in prompt.tools])
            except ValueError as error:
                raise ValueError(f"chat: {error}") from error
        if not ids:
            raise ValueError(f"{kind}: the prompt is empty")
        return CheckedPrompt(tuple(ids))


def _context_length(source: str) -> int:
    """The context length the model was trained for: GGUF `<arch>.context_length` or HF
    `max_position_embeddings`."""
    if os.path.isdir(source):
        with open(os.path.join(source, "config.json"), encoding="utf-8") as config:
            return int(json.load(config)["max_position_embeddings"])
    from engine.model.gguf_file import gguf_reader

    reader = gguf_reader(source)
    length = reader.get(f"{reader.get('general.architecture')}.context_length")
    if length is None:
        raise ValueError(f"{source}: GGUF metadata lacks the context length; pass --max-model-len")
    return int(length)
