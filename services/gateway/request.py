"""A generation request as the gateway's core sees it, whichever API (gRPC or HTTP) it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from services.gateway.caller import Caller


@dataclass(frozen=True)
class TextPrompt:
    """Plain text, tokenized by the gateway."""

    text: str


@dataclass(frozen=True)
class TokenPrompt:
    """Token ids as the client sent them, checked against the vocabulary by the served model."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatMessage:
    """A chat turn: role "system", "user" or "assistant", and its text."""

    role: str
    content: str


@dataclass(frozen=True)
class ChatPrompt:
    """Chat turns, rendered with the model's chat template (which adds the generation prompt)."""

    messages: tuple[ChatMessage, ...]


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
