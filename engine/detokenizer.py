"""Streaming token ids -> text, one token at a time, consistent with decoding them all at once."""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals `tokenizer.decode(ids)`.

    Only a short window of recent tokens is decoded per step: the tokens since the last text was
    released plus the ones that produced it, which give the decoder the context it needs (leading
    space handling, bytes of a character split across tokens). Text is held back while it may still
    change: while it ends in U+FFFD (an incomplete UTF-8 sequence) or in a run of byte-fallback
    tokens, which the decoder converts as one unit, all to U+FFFD if any byte is invalid.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        # How many tokens at the front of the window are context whose text was already released,
        # and that text as decoded from the window's start.
        self._context_length = 0
        self._context_text = ""
        self._in_byte_run = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._window.append(token_id)
        if not (self._skip_special_tokens and self._tokenizer.is_special(token_id)):
            self._in_byte_run = token_id in self._tokenizer.byte_fallback_ids
        if self._in_byte_run:
            return ""
        text = self._decode_window()
        if len(text) <= len(self._context_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._release(text)

    def flush(self) -> str:
        """Return whatever is still held at the end of the stream; an incomplete character becomes U+FFFD."""
        self._in_byte_run = False
        text = self._decode_window()
        return self._release(text) if len(text) > len(self._context_text) else ""

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._window, skip_special_tokens=self._skip_special_tokens)

    def _release(self, text: str) -> str:
        """Return the window's text past the context, and make the tokens just released the new context."""
        delta = text[len(self._context_text):]
        self._window = self._window[self._context_length:]
        self._context_length = len(self._window)
        self._context_text = self._decode_window()
        return delta
