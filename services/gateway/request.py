"""A generation request as the gateway's core sees it, whichever API (gRPC or HTTP) it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from services.gateway.caller import Caller
from services.gateway.tools.choice import Tool


@dataclass(frozen=True)
class TextPrompt:
    """Plain text, tokenized by the gateway."""

    text: str


@dataclass(frozen=True)
class TokenPrompt:
    """Token ids as the client sent them, checked against the vocabulary by the served model."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant made: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """A chat turn: role "system", "user", "assistant" (which may hold `tool_calls`) or "tool" (the
    result of the call `tool_call_id`), and its text."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    def openai(self) -> dict[str, Any]:
        """The message as OpenAI's message object (what chat templates render)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class ChatPrompt:
    """Chat turns, rendered with the model's chat template (which adds the generation prompt), and
    the tools it describes (services.gateway.tools.choice)."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt the served model already turned into token ids and checked
    (services.gateway.model.ServedModel.checked_prompt). An API edge that needs the ids before the
    core does (the HTTP API sizes a chat reply by them, and fans one prompt out to n choices) hands
    them on as this, so that each prompt is checked once."""

    ids: tuple[int, ...]


Prompt = TextPrompt | TokenPrompt | ChatPrompt | CheckedPrompt


@dataclass(frozen=True)
class RequestedSlo:
    """The latency objectives a client asked for, in milliseconds; None takes the deployment's default
    (the gateway resolves them into the router's SloTargets)."""

    ttft_ms: int | None = None
    tpot_ms: int | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be > 0 milliseconds, got {value}")


@dataclass(frozen=True)
class GenerateRequest:
    """One completion to generate: the prompt, how to sample it, and its objectives.

    `model` empty means the served model; `request_id` empty means the gateway makes one.
    `priority`: higher is served first when requests must wait. `user` names the caller for a
    model's A/B split (sticky per user, else per API key; neither: drawn per request). `caller`: the
    API key it came with (None where the gateway asks for none), whose rate limits it is charged to.
    """

    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""
    request_id: str = ""
    slo: RequestedSlo = field(default_factory=RequestedSlo)
    priority: int = 0
    user: str = ""
    caller: Caller | None = None
