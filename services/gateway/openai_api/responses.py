"""Response bodies of the OpenAI-compatible API, built from the core's chunks.

Logprobs are clamped to -9999 as in vLLM: JSON has no -Infinity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from services.common.chunk import Chunk, TokenLogprob, Usage
from services.gateway.tools.parsers import ToolCallParser
from services.gateway.tools.stream import ToolCallStream, call_id, finish_reason, message

_LOWEST_LOGPROB = -9999.0


@dataclass
class Choice:
    """One completion choice, accumulated chunk by chunk (for a non-streaming reply)."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, chunk: Chunk) -> None:
        """Append what a chunk adds."""
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage


class ReplyFormat(ABC):
    """How one endpoint words its replies, streaming and not."""

    def __init__(self, object_: str, reply_id: str, model: str, created: int, tokenizer: Tokenizer,
                 logprobs: bool, fingerprint: str) -> None:
        # `model` is what the client asked for; `fingerprint` names the version that served it.
        self._head = {"id": reply_id, "object": object_, "created": created, "model": model,
                      "system_fingerprint": fingerprint}
        self._tokenizer = tokenizer
        self._logprobs = logprobs

    @abstractmethod
    def delta(self, index: int, chunk: Chunk) -> dict[str, Any] | None:
        """The stream event of a chunk of choice `index` (None: nothing to send yet)."""

    @abstractmethod
    def complete(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming reply."""

    def opening(self, choices: int) -> list[dict[str, Any]]:
        """Stream events sent before any token."""
        return []

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The stream's closing usage-only event."""
        return {**self._head, "choices": [], "usage": usage}


class CompletionFormat(ReplyFormat):
    """/v1/completions replies (object "text_completion" whether streamed or not, as OpenAI does)."""

    def __init__(self, reply_id: str, model: str, created: int, tokenizer: Tokenizer, logprobs: bool,
                 fingerprint: str, echoes: Sequence[str] = ()) -> None:
        """`echoes`: per choice, the prompt text its reply starts with (`echo`; "" for none)."""
        super().__init__("text_completion", reply_id, model, created, tokenizer, logprobs, fingerprint)
        self._offsets: dict[int, int] = {}  # per choice: text length streamed so far, for text_offset
        self._echoes = list(echoes)

    def delta(self, index: int, chunk: Chunk) -> dict[str, Any]:
        offset = self._offsets.get(index)
        # A choice's first event carries its echoed prompt before its first tokens, as vLLM streams it.
        text = chunk.text if offset is not None else self._echo(index) + chunk.text
        offset = offset or 0
        self._offsets[index] = offset + len(text)
        return {**self._head, "choices": [self._choice(index, text, chunk.logprobs, chunk.finish_reason, offset)]}

    def complete(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._head,
            "choices": [self._choice(index, self._echo(index) + c.text, c.logprobs, c.finish_reason, 0)
                        for index, c in enumerate(choices)],
            "usage": usage,
        }

    def _echo(self, index: int) -> str:
        return self._echoes[index] if index < len(self._echoes) else ""

    def _choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None,
                offset: int) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(self._tokenizer, logprobs, offset) if self._logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }


class ChatFormat(ReplyFormat):
    """/v1/chat/completions replies: "chat.completion", or "chat.completion.chunk" events. With a
    tool-call parser (services.gateway.tools), each choice's text is read into content and
    `tool_calls`, streamed as OpenAI's deltas."""

    def __init__(self, reply_id: str, model: str, created: int, tokenizer: Tokenizer, logprobs: bool,
                 fingerprint: str, tools: ToolCallParser | None = None) -> None:
        super().__init__("chat.completion.chunk", reply_id, model, created, tokenizer, logprobs, fingerprint)
        self._tools = tools
        self._streams: dict[int, ToolCallStream] = {}

    def opening(self, choices: int) -> list[dict[str, Any]]:
        # Each choice's stream starts by naming the speaker, as OpenAI's does.
        return [
            {**self._head, "choices": [
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
            ]}
            for index in range(choices)
        ]

    def delta(self, index: int, chunk: Chunk) -> dict[str, Any] | None:
        finish = chunk.finish_reason
        if self._tools is None:
            delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
        else:
            stream = self._streams.setdefault(index, ToolCallStream(self._tools))
            delta, reading = stream.feed(chunk.text, final=finish is not None)
            finish = finish_reason(self._tools, reading, finish)
            if not delta and not chunk.logprobs and finish is None:
                return None
        return {**self._head, "choices": [{
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(self._tokenizer, chunk.logprobs) if self._logprobs else None,
            "finish_reason": finish,
        }]}

    def complete(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        replies = []
        for index, c in enumerate(choices):
            body: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if self._tools is not None:
                reading = self._tools.read(c.text, final=True)
                body = message(reading, [call_id() for _ in reading.calls])
                finish = finish_reason(self._tools, reading, finish)
            replies.append({
                "index": index,
                "message": body,
                "logprobs": chat_logprobs(self._tokenizer, c.logprobs) if self._logprobs else None,
                "finish_reason": finish,
            })
        return {**self._head, "object": "chat.completion", "choices": replies, "usage": usage}


def usage_body(usages: Sequence[Usage], n: int) -> dict[str, Any]:
    """The usage of a reply whose choices come prompt-major in blocks of `n`: each prompt counted
    once, every choice's completion tokens."""
    firsts = usages[::n]
    prompt_tokens = sum(usage.prompt_tokens for usage in firsts)
    completion_tokens = sum(usage.completion_tokens for usage in usages)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(usage.cached_tokens for usage in firsts)},
    }


def completion_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """/v1/completions `logprobs`: tokens, their logprobs, top alternatives and text offsets."""
    tokens, offsets = [], []
    for lp in logprobs:
        token = _token_text(tokenizer, lp.token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_clamped(lp.logprob) for lp in logprobs],
        # The sampled token is always among the alternatives listed, as in vLLM.
        "top_logprobs": [
            {_token_text(tokenizer, token_id): _clamped(value)
             for token_id, value in ((lp.token_id, lp.logprob), *lp.top)}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """/v1/chat/completions `logprobs`: per token its text, bytes, logprob and top alternatives."""
    return {
        "content": [
            {
                **_chat_token(tokenizer, lp.token_id, lp.logprob),
                "top_logprobs": [_chat_token(tokenizer, token_id, value) for token_id, value in lp.top],
            }
            for lp in logprobs
        ]
    }


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": _token_text(tokenizer, token_id),
        "logprob": _clamped(logprob),
        "bytes": list(tokenizer.id_to_bytes(token_id)),
    }


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _clamped(logprob: float) -> float:
    return max(logprob, _LOWEST_LOGPROB)
