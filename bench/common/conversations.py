"""Multi-turn chat from a real corpus, for the suites that resend a conversation's history (kv_tiers,
and the goodput suite's multiturn workload): ShareGPT V3's human turns, each cut to a bound, as the
user's messages, and the prompt of a turn as the model's chat template over the history so far.

A longer human turn is cut: the model's context is 8192 tokens and a CPU's prefill is slow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

MAX_TURN_TOKENS = 400


class ChatTokenizer(Protocol):
    """What these functions need of engine.tokenizer.Tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            ) -> str: ...


def cut_turn(tokenizer: ChatTokenizer, text: str, max_tokens: int = MAX_TURN_TOKENS) -> str:
    """`text` cut to its first `max_tokens` tokens."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:max_tokens])


def human_turns(conversations: Sequence[Sequence[str]], turns: int, tokenizer: ChatTokenizer) -> list[list[str]]:
    """Per conversation (alternating turns, human first), its first `turns` human messages, each cut to
    MAX_TURN_TOKENS."""
    return [[cut_turn(tokenizer, text) for text in conversation[:2 * turns - 1:2]] for conversation in conversations]


def history(users: Sequence[str], replies: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages of a conversation up to its latest user message: users[0], replies[0], users[1],
    ... (one more user message than replies)."""
    if len(users) != len(replies) + 1:
        raise ValueError(f"a turn's history has one more user message than replies, got {len(users)} and "
                         f"{len(replies)}")
    messages = []
    for index, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if index < len(replies):
            messages.append({"role": "assistant", "content": replies[index]})
    return messages
