"""Reading an OpenAI-API stream's server-sent events, as every streaming client of the tests and the
benchmarks does (the load clients' HTTP path here, the benchmarks' goodput client)."""

from __future__ import annotations

DONE = "[DONE]"  # the data of the last event of a stream


def event_data(line: str) -> str | None:
    """The data of an SSE `data:` line (DONE included); None for any other line."""
    return line[len("data:"):].strip() if line.startswith("data:") else None


def carries_text(event: dict) -> bool:
    """Whether a completion chunk carries generated text."""
    return any(choice.get("text") for choice in event.get("choices") or ())
