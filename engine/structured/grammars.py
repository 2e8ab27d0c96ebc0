"""Compiled grammars, one cache per engine: a spec compiles once (by content), and each request
gets its own copy of the compiled matcher.

The library is llguidance, chosen by measurement on this CPU against xgrammar and outlines-core
(`python -m bench grammar_backends`, docs/benchmarks.md): it compiled every spec tried faster, by
orders of magnitude on large enums and bounded repeats; it serves Lark grammars (vLLM's `grammar`)
and structural tags; it drops the GIL while it compiles and bounds its own work (LLParserLimits).
xgrammar computes a token's mask faster, but both take a small part of a step; outlines-core has no
context-free grammars.

Compiling may take long for a pathological spec, so a worker compiles on a thread of its own
(`compile`, from a request handler), never on the engine's loop, and stops waiting after
`timeout_s`: the request is refused naming the field, the compile finishes in the background (it
holds no GIL) and the spec is remembered as refused. At most `max_compiling` compiles run at once,
so runaway specs cannot take every core; past that a compile is refused as busy (GrammarsBusy).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

from engine.structured.config import StructuredOutputsConfig
from engine.structured.spec import StructuredOutput
from engine.structured.state import GrammarError, GrammarState

# The library's own bounds on a grammar's lexer and parser work, below its defaults where those let
# a runaway spec run for many seconds.
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, initial_lexer_fuel=1_000_000)


@dataclass(frozen=True)
class GrammarLimits:
    """How long a worker waits for one compile, how many run at once and how many compiled specs it keeps."""

    timeout_s: float = 10.0
    cache_size: int = 256
    max_compiling: int = 4

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.cache_size < 1 or self.max_compiling < 1:
            raise ValueError(f"grammar limits must be positive: {self}")


class GrammarsBusy(RuntimeError):
    """Every compile slot is taken (by specs still compiling): try again later."""


class Grammars:
    """Specs compiled against one tokenizer (its byte-level vocabulary and end-of-sequence ids)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits = GrammarLimits(),
                 config: StructuredOutputsConfig | None = None) -> None:
        self.limits = limits
        self.config = config or StructuredOutputsConfig()
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.max_compiling)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def compile(self, spec: StructuredOutput, timeout_s: float | None = None) -> None:
        """Compile `spec` (if not cached) on a thread of its own, waiting at most the time limit (or
        `timeout_s`, a request's remaining deadline, where shorter); ValueError naming the field if
        it does not compile (the library's reason) or in time, GrammarsBusy if no slot is free."""
        spec = self.config.applied(spec)
        if self._cached(spec) is None:
            if not self._slots.acquire(blocking=False):
                raise GrammarsBusy(f"{spec.field}: {self.limits.max_compiling} grammars are compiling; try again")
            wait_s = self.limits.timeout_s if timeout_s is None else min(timeout_s, self.limits.timeout_s)
            thread = threading.Thread(target=self._build_in_slot, args=(spec,), name="grammar-compile", daemon=True)
            thread.start()
            thread.join(wait_s)
            if thread.is_alive():
                self._store(spec, f"did not compile within {wait_s:g} s")
        result = self._cached(spec)
        if isinstance(result, str):
            raise ValueError(f"{spec.field}: {result}")

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request (compiling here, on the caller's thread, if no handler
        compiled the spec first: the offline engine's case); ValueError as `compile`."""
        spec = self.config.applied(spec)
        result = self._cached(spec)
        if result is None:
            result = self._build(spec)
        if isinstance(result, str):
            raise ValueError(f"{spec.field}: {result}")
        return result.deep_copy()

    def state(self, spec: StructuredOutput, output_token_ids: list[int]) -> GrammarState:
        """A request's grammar state after the output it already has (a resumed or migrated
        request's); ValueError naming the field if the spec does not compile or the output does
        not match it."""
        try:
            return GrammarState.resume(self.matcher(spec), self.vocab_size, output_token_ids)
        except GrammarError as error:
            raise ValueError(f"{spec.field}: the output already generated does not match: {error}") from None

    def _build_in_slot(self, spec: StructuredOutput) -> None:
        try:
            self._build(spec)
        finally:
            self._slots.release()

    def _build(self, spec: StructuredOutput) -> llguidance.LLMatcher | str:
        try:
            grammar = spec.grammar()
        except ValueError as error:
            return self._store(spec, str(error).removeprefix(f"{spec.field}: "))
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
        return self._store(spec, matcher.get_error() if matcher.is_error() else matcher)

    def _cached(self, spec: StructuredOutput) -> llguidance.LLMatcher | str | None:
        with self._lock:
            result = self._compiled.get(spec)
            if result is not None:
                self._compiled.move_to_end(spec)
            return result

    def _store(self, spec: StructuredOutput, result: llguidance.LLMatcher | str) -> llguidance.LLMatcher | str:
        with self._lock:
            self._compiled[spec] = result
            self._compiled.move_to_end(spec)
            while len(self._compiled) > self.limits.cache_size:
                self._compiled.popitem(last=False)
        return result
