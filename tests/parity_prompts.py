"""The engine issue's parity prompts: chat and plain, short and about 1,000 tokens.

Fixed once, never tuned to make a test pass.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer


def travel_diary() -> str:
    """A ~1,000-token plain prompt that asks a question about its own content."""
    names = ["Alice", "Bob", "Chen", "Dara", "Emeka", "Farah"]
    items = ["apples", "pears", "books", "candles", "maps", "stamps", "shells"]
    places = ["market", "library", "harbour", "station", "museum"]
    lines = [
        f"Day {d}: {names[d % 6]} went to the {places[(d * 3) % 5]} and bought {(d * 7) % 11 + 1} {items[(d * 5) % 7]}."
        for d in range(1, 61)
    ]
    return "Here is a travel diary.\n" + "\n".join(lines) + "\nQuestion: Who bought the most items in total? Answer:"


PLAIN = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Translate to French: The weather is nice today and we are going to the beach.\nFrench:",
    travel_diary(),
]

CHAT = [
    [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
    [
        {"role": "system", "content": "You are a poet who answers in verse."},
        {"role": "user", "content": "Write a haiku about autumn leaves."},
    ],
    [{"role": "user", "content": "List three benefits of regular exercise."}],
    [{"role": "user", "content": "Explain what a hash table is to a ten-year-old."}],
]


def parity_prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of the eight parity prompts, plain ones first."""
    return [tokenizer.encode(p) for p in PLAIN] + [tokenizer.encode_chat(m) for m in CHAT]
