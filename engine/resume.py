"""A request resumed from output another engine already delivered (the gateway's migration of a
request whose decode worker died mid-stream).

The new engine takes the delivered tokens as output already generated: they count against
max_tokens and min_tokens, penalties see them, and the text state (incremental detokenizer, stop
strings) is replayed from them, so the next text delta starts exactly where the client's text
ended. Imports no torch: the gateway builds these too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class Resumed:
    """What the client already has of a request's output.

    `text_length` is how many characters (code points) of text the client received; None means
    all the text these tokens released, as this engine's own stop-string matcher would have
    split it (enough where the text goes nowhere, e.g. at a prefill worker).
    """

    output_token_ids: tuple[int, ...]
    text_length: int | None = None

    def __post_init__(self) -> None:
        if self.text_length is not None and self.text_length < 0:
            raise ValueError(f"output_text_length: must be >= 0, got {self.text_length}")


def replay_text(detokenizer: IncrementalDetokenizer, stop: StopStringMatcher, resumed: Resumed) -> None:
    """Bring a fresh text state to where the old engine's stood once it had streamed the resumed
    tokens: the detokenizer holds the bytes of an unfinished character, the matcher holds the text
    the client has not received (a possible stop-string prefix). ValueError when the client is said
    to hold more text than the tokens release."""
    released = "".join(detokenizer.push(token) for token in resumed.output_token_ids)
    if resumed.text_length is None:
        stop.feed(released)
        return
    if resumed.text_length > len(released):
        raise ValueError(f"output_text_length: {resumed.text_length} characters, but the output tokens "
                         f"release only {len(released)}")
    stop.hold(released[resumed.text_length:])


def check_resumable(resumed: Resumed, max_tokens: int, vocab_size: int) -> Sequence[int]:
    """The resumed token ids, once they are known to leave something to generate; ValueError naming
    the field otherwise."""
    tokens = resumed.output_token_ids
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"output_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(tokens) >= max_tokens:
        raise ValueError(f"output_token_ids: {len(tokens)} tokens already reach max_tokens={max_tokens}")
    return tokens
