"""A long-context retrieval check for KV formats: a planted fact ("The secret code is 4817.") at a
varying depth of a long filler prompt, then a question; a prompt is a hit when the greedy answer
contains the code.

It shows what perplexity over short windows can hide: a KV format that blurs one far-back key
among many. The filler is the fidelity suite's fixed text (bench/texts/README.md), cut at sentence
ends; the prompt is a plain completion that ends by starting the answer ("... The secret code is"),
which the shipped 135M model follows where a chat question often gets a chatty answer without the
code. Prompts are a function of (length, index) alone, so every row of a table answers the same ones.

`retrieval_hits` takes a row's EngineConfig (the suite's, with prefix caching off), so a KV format, a
sliding window or an eviction policy is a row as soon as its field exists.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine
from engine.offline import generate
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

QUESTION = "\n\nWhat is the secret code? The secret code is"
ANSWER_TOKENS = 8  # a 4-digit code is 4 tokens (one a digit), with room for a space and a quote


@dataclass(frozen=True)
class PlantedPrompt:
    """One prompt of `len(token_ids)` tokens whose fact sits at fraction `depth` of the filler."""

    token_ids: list[int]
    code: str
    depth: float


def planted_prompts(tokenizer: Tokenizer, filler: str, length: int, count: int) -> list[PlantedPrompt]:
    """`count` prompts of exactly `length` tokens: prompt i takes its filler from its own offset of
    the text, plants its own 4-digit code after the sentence end nearest depth (i + 0.5) / count,
    and ends with the question."""
    filler_ids = tokenizer.encode(filler, add_special_tokens=False)
    rng = random.Random(length)
    prompts = []
    for index in range(count):
        code = str(rng.randrange(1000, 10000))
        fact = tokenizer.encode(f" The secret code is {code}.", add_special_tokens=False)
        question = tokenizer.encode(QUESTION, add_special_tokens=False)
        room = length - len(fact) - len(question)
        if room <= 0 or room > len(filler_ids):
            raise ValueError(f"length: {length} tokens leave no room for filler (or need more than the text's "
                             f"{len(filler_ids)})")
        start = (len(filler_ids) - room) * index // max(count - 1, 1)
        body = filler_ids[start:start + room]
        depth = (index + 0.5) / count
        cut = _sentence_end_near(tokenizer, body, round(depth * room))
        prompts.append(PlantedPrompt(body[:cut] + fact + body[cut:] + question, code, cut / room))
    return prompts


def _sentence_end_near(tokenizer: Tokenizer, ids: Sequence[int], position: int) -> int:
    """The position just after the token ending a sentence ('.', '!' or '?') nearest `position`
    (`position` itself where the filler has none)."""
    ends = [i + 1 for i, token in enumerate(ids) if tokenizer.decode([token]).rstrip().endswith((".", "!", "?"))]
    return min(ends, key=lambda end: abs(end - position), default=position)


def answers(engine: Engine, prompts: Sequence[PlantedPrompt]) -> list[str]:
    """The engine's greedy answer to each prompt."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    return [engine.tokenizer.decode(c.token_ids) for c in generate(engine, [p.token_ids for p in prompts], params)]


def hits(engine: Engine, prompts: Mapping[int, Sequence[PlantedPrompt]]) -> dict[int, list[bool]]:
    """Whether the engine answers each prompt of each length with its code."""
    return {length: [p.code in answer for p, answer in zip(batch, answers(engine, batch), strict=True)]
            for length, batch in prompts.items()}


def retrieval_hits(config: EngineConfig, prompts: Mapping[int, Sequence[PlantedPrompt]]) -> dict[int, list[bool]]:
    """`hits` of an engine of `config` (prefix caching off, so every prompt computes its own pages);
    the engine is released afterwards."""
    engine = Engine(config)
    try:
        return hits(engine, prompts)
    finally:
        del engine
        gc.collect()
