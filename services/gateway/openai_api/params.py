"""Request bodies to the gateway core's requests: pure functions, no I/O.

A bad value raises ValueError("<field>: <what is wrong>"), which the API answers with a 400 whose
`param` is that field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from services.gateway.openai_api.field_policy import check_fields
from services.gateway.openai_api.schema import MAX_CHOICES, ChatBody, CompletionBody, NamedToolChoice, SamplingBody
from services.gateway.openai_api.structured import structured_output
from services.gateway.request import (
    ChatMessage,
    ChatPrompt,
    CheckedPrompt,
    GenerateRequest,
    Prompt,
    RequestedSlo,
    TextPrompt,
    TokenPrompt,
    ToolCall,
)
from services.gateway.tools.choice import Tool, ToolFlags, ToolUse, checked_tools, tool_use

T = TypeVar("T")

# OpenAI's and vLLM's default for /v1/completions; chat defaults to the rest of the context.
COMPLETION_MAX_TOKENS = 16


def unknown_fields(body: SamplingBody) -> list[str]:
    """Fields of the body (and of its stream_options) that the API does not know, to log and ignore;
    ValueError naming an OpenAI field this server refuses (services.gateway.openai_api.field_policy)."""
    unknown = check_fields(body.model_extra or {})
    if body.stream_options is not None:
        unknown += [f"stream_options.{name}" for name in body.stream_options.model_extra or {}]
    return unknown


def completion_prompts(body: CompletionBody) -> list[Prompt]:
    """The prompts of a completion body: one text, one token list, or a batch of either."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [TextPrompt(prompt)]
    if not prompt:
        raise ValueError("prompt: must not be empty")
    if all(isinstance(item, int) for item in prompt):
        return [TokenPrompt(tuple(prompt))]
    if len(prompt) * body.n > MAX_CHOICES:
        raise ValueError(f"prompt: {len(prompt)} prompts times n={body.n} exceeds {MAX_CHOICES} completions")
    return [TextPrompt(item) if isinstance(item, str) else TokenPrompt(tuple(item)) for item in prompt]


def chat_prompt(body: ChatBody, tools: Sequence[Tool] = ()) -> ChatPrompt:
    """The conversation of a chat body, describing `tools`; content given as parts must be text parts."""
    messages = []
    for position, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise ValueError(f"messages.{position}.content: only text parts are served, got {part.type!r}")
            content = "".join(part.text for part in content)
        if message.tool_calls and message.role != "assistant":
            raise ValueError(f"messages.{position}.tool_calls: only an assistant message makes tool calls")
        if message.role == "tool" and not message.tool_call_id:
            raise ValueError(f"messages.{position}.tool_call_id: a tool message must name the call it answers")
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ())
        messages.append(ChatMessage(message.role, content or "", calls, message.tool_call_id or ""))
    return ChatPrompt(tuple(messages), tuple(tools))


def chat_tools(body: ChatBody, flags: ToolFlags) -> tuple[ToolUse, tuple[Tool, ...]]:
    """How the body's `tools` and `tool_choice` shape its reply, and the tools its prompt describes;
    ValueError naming the field (services.gateway.tools.choice)."""
    tools = checked_tools([Tool.declared(t.function.name, t.function.description, t.function.parameters)
                           for t in body.tools or ()])
    choice = body.tool_choice
    use = tool_use(tools, choice.function.name if isinstance(choice, NamedToolChoice) else choice,
                   body.parallel_tool_calls, flags)
    if use.constraint is not None and structured_output(body.response_format, body.structured_outputs) is not None:
        raise ValueError("tool_choice: a required or named tool call constrains the reply itself; leave "
                         "response_format and structured_outputs unset")
    return use, tuple(tools) if use.render_tools else ()


def completion_requests(
    body: CompletionBody, prompts: Sequence[CheckedPrompt], request_id: str
) -> list[GenerateRequest]:
    """One core request per completion choice: `n` for each checked prompt, prompt-major."""
    if body.echo and body.logprobs is not None:
        raise ValueError("echo: with logprobs it returns the prompt's logprobs too, which this server does not "
                         "compute; ask for one or the other")
    return _requests(body, prompts, request_id, body.max_tokens, body.logprobs)


def echoed_prompts(body: CompletionBody, prompts: Sequence[Prompt],
                   decode: Callable[[Sequence[int]], str]) -> list[str]:
    """Each choice's prompt text with `echo` (a token prompt decoded), in the requests' order; "" without."""
    if not body.echo:
        return [""] * (len(prompts) * body.n)
    texts = [prompt.text if isinstance(prompt, TextPrompt) else decode(prompt.ids) for prompt in prompts]
    return [text for text in texts for _ in range(body.n)]


def chat_requests(
    body: ChatBody, prompt: CheckedPrompt, max_total_tokens: int, request_id: str, prediction: Sequence[int] = (),
    tool_constraint: StructuredOutput | None = None,
) -> list[GenerateRequest]:
    """One core request per chat choice. Without max_tokens (or max_completion_tokens) a reply may
    fill the rest of the context (`max_total_tokens`: the model's, or a lower limit), as in vLLM.
    `prediction`: the tokens of the body's `prediction` (prediction_text); `tool_constraint`: the
    grammar of a required or named tool call (chat_tools), in place of the body's own."""
    if body.top_logprobs and not body.logprobs:
        raise ValueError("top_logprobs: requires logprobs to be true")
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, max_total_tokens - len(prompt.ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if len(prediction) > max_total_tokens:
        raise ValueError(f"prediction: {len(prediction)} tokens, more than a reply may have ({max_total_tokens})")
    return _requests(body, [prompt], request_id, max_tokens, logprobs, tuple(prediction), tool_constraint)


def prediction_text(body: ChatBody) -> str:
    """The text of OpenAI's `prediction` ("" without one); its content parts must be text."""
    if body.prediction is None:
        return ""
    content = body.prediction.content
    if isinstance(content, str):
        return content
    for position, part in enumerate(content):
        if part.type != "text":
            raise ValueError(f"prediction.content.{position}: only text parts are served, got {part.type!r}")
    return "".join(part.text for part in content)


def sampling_params(body: SamplingBody, max_tokens: int, logprobs: int | None, seed: int | None,
                    prediction: tuple[int, ...] = (), constraint: StructuredOutput | None = None) -> SamplingParams:
    """The engine's SamplingParams of a body; unset fields take the engine's defaults. `constraint`
    replaces the body's structured output (a tool call's)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=_given(body.temperature, 1.0),
        top_k=_given(body.top_k, 0),
        top_p=_given(body.top_p, 1.0),
        min_p=_given(body.min_p, 0.0),
        repetition_penalty=_given(body.repetition_penalty, 1.0),
        presence_penalty=_given(body.presence_penalty, 0.0),
        frequency_penalty=_given(body.frequency_penalty, 0.0),
        seed=seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        structured=constraint or structured_output(body.response_format, body.structured_outputs),
        logit_bias=_logit_bias(body.logit_bias or {}),
        prediction=prediction,
        cache_salt=body.cache_salt or "",
    )


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as strings) as (id, bias) pairs; ValueError naming the field."""
    pairs = []
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise ValueError(f"logit_bias: {key!r} is not a token id")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _requests(
    body: SamplingBody, prompts: Sequence[CheckedPrompt], request_id: str, max_tokens: int | None,
    logprobs: int | None, prediction: tuple[int, ...] = (), constraint: StructuredOutput | None = None,
) -> list[GenerateRequest]:
    # With a seed, choice j samples with seed + j: reproducible, yet the n choices differ.
    params = [
        sampling_params(body, max_tokens or COMPLETION_MAX_TOKENS, logprobs,
                        None if body.seed is None else body.seed + choice, prediction, constraint)
        for choice in range(body.n)
    ]
    slo = RequestedSlo(ttft_ms=body.ttft_ms, tpot_ms=body.tpot_ms)
    return [
        GenerateRequest(
            prompt=prompt,
            sampling=params[choice],
            model=body.model or "",
            request_id=f"{request_id}-{index * body.n + choice}",
            slo=slo,
            priority=body.priority,
            user=body.user or "",
        )
        for index, prompt in enumerate(prompts)
        for choice in range(body.n)
    ]


def _given(value: T | None, default: T) -> T:
    return default if value is None else value
