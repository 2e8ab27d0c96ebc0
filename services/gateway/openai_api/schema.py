"""Request bodies of the OpenAI-compatible API, with vLLM's sampling extensions and Tandem's SLO fields.

Types and simple bounds are checked here (a failure is a 400 naming the field); ranges that the
engine defines are checked by engine SamplingParams. Fields not declared here are kept in
`model_extra`, so the API can log and ignore them as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.openai_api.structured import ResponseFormat, StructuredOutputsBody

# Requests one body may fan out to (n times the prompts of a batch).
MAX_CHOICES = 64
MAX_TOP_LOGPROBS = 20
# What tandem.v1.SamplingParams carries to the workers (int32 top_k, uint32 token ids): a larger
# value is refused here, naming its field, rather than failing its conversion later.
_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1


class StreamOptions(BaseModel):
    """`stream_options`: whether the stream ends with a usage-only chunk."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class SamplingBody(BaseModel):
    """The fields both endpoints share: sampling, stopping, streaming and the request's objectives."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_UINT32_MAX)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's: token id (as a string) -> bias added to its logit, in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # Structured outputs (services.gateway.openai_api.structured).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's: hashed into the prompt's first KV block, so that only requests with the same salt (one
    # tenant's) share cached prefixes.
    cache_salt: str | None = Field(None, min_length=1, strict=True)
    # Tandem: per-request latency objectives (milliseconds: uint32 on the wire) and priority (higher first).
    ttft_ms: int | None = Field(None, gt=0, lt=2**32)
    tpot_ms: int | None = Field(None, gt=0, lt=2**32)
    priority: int = Field(0, ge=-2**31, lt=2**31)  # int32 on the wire

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(SamplingBody):
    """POST /v1/completions: a prompt (text, token ids, or a batch of either)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # each choice's text starts with its prompt


class TextPart(BaseModel):
    """One part of a message's content; only text parts are served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str = ""


class FunctionCallBody(BaseModel):
    """A call's function: its name and arguments (a JSON string)."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str = "{}"


class ToolCallBody(BaseModel):
    """One call an assistant message made."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallBody


class MessageBody(BaseModel):
    """One chat turn: an assistant's may hold `tool_calls`, a `tool` one answers `tool_call_id`."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None


class FunctionBody(BaseModel):
    """A tool's function: `parameters` is its arguments' JSON schema (none: it takes no arguments)."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # served either way: the arguments of a constrained call always match


class ToolBody(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionBody


class NamedFunction(BaseModel):
    """`tool_choice.function`."""

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class PredictionBody(BaseModel):
    """OpenAI's `prediction`: the reply's expected text (a string or text parts)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["content"]
    content: str | list[TextPart]


class ChatBody(SamplingBody):
    """POST /v1/chat/completions: a conversation."""

    messages: list[MessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prediction: PredictionBody | None = None
    # Tool calling (services.gateway.tools.choice).
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
