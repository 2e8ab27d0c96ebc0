"""Grammar libraries for structured outputs side by side on this CPU: llguidance (what the engine
serves with), xgrammar (vLLM's default) and outlines-core.

On the shipped model's tokenizer, one thread: for each everyday schema, the cold compile (to the
first mask) and the cached one, the mask of a token at batch 1 and of a step at batch 32 (32
matchers, each filled) along an instance of the schema, and the process's memory after; then the
compile time of pathological specs (deep nesting, a large enum, many alternatives, a long bounded
repeat), each in a fresh process killed after --timeout seconds. A library that is not installed
(xgrammar and outlines-core come with the `bench` extra) is reported as missing.

    python -m bench grammar_backends [--libraries llguidance,xgrammar,outlines] [--timeout 60]
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import psutil
from tokenizers import Tokenizer as BackendTokenizer

from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.model.paths import default_model_path
from engine.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"},
                                         "country": {"type": "string"}, "capital": {"type": "boolean"}},
        "required": ["name", "population", "country", "capital"], "additionalProperties": False}
ITEM = {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                         "kind": {"enum": ["book", "tool", "food"]}, "price": {"type": "number"}},
        "required": ["sku", "qty", "kind", "price"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                          "items": {"type": "array", "items": ITEM, "minItems": 1},
                                          "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["id", "items", "note"], "additionalProperties": False}
EVERYDAY = {
    "city": (CITY, {"name": "Lyon", "population": 522250, "country": "France", "capital": False}),
    "order": (ORDER, {"id": "ABC-1234", "items": [{"sku": "b-17", "qty": 2, "kind": "book", "price": 12.5},
                                                  {"sku": "t-3", "qty": 1, "kind": "tool", "price": 7.25}],
                      "note": None}),
}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "array", "items": schema}},
                  "required": ["a"]}
    return schema


PATHOLOGICAL = {
    "nested 8 (29 KB)": _nested(8),
    "nested 11 (231 KB)": _nested(11),
    "enum of 5,000": {"enum": [f"value-{i}-{i * 7919 % 10007}" for i in range(5000)]},
    "anyOf of 200 objects": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                        "required": [f"k{i}"]} for i in range(200)]},
    "bounded repeat": {"type": "string", "pattern": "^(a|b){0,2000}c{3,500}$"},
}
BATCH = 32


class Library:
    """One library's calls: compile a schema to a matcher factory, fill a bitmask row, take a token."""

    def __init__(self, name: str, tokenizer: Tokenizer) -> None:
        self.name = name
        vocab, eos = tokenizer.vocab_size, list(tokenizer.eos_token_ids)
        if name == "llguidance":
            import llguidance
            import llguidance.numpy as lnp
            self._tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab, eos_token=eos)
            self.compile = lambda schema: llguidance.LLMatcher(
                self._tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema))
            self.fresh = lambda compiled: compiled.deep_copy()
            self.alloc = lambda n: lnp.allocate_token_bitmask(n, vocab)
            self.fill = lambda m, mask, i: lnp.fill_next_token_bitmask(m, mask, i)
            self.take = lambda m, token: m.consume_token(token)
        elif name == "xgrammar":
            import xgrammar
            info = xgrammar.TokenizerInfo(_vocabulary(tokenizer), xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                          stop_token_ids=eos)
            compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            self.compile = lambda schema: compiler.compile_json_schema(json.dumps(schema))
            self.fresh = xgrammar.GrammarMatcher
            self.alloc = lambda n: xgrammar.allocate_token_bitmask(n, vocab)
            self.fill = lambda m, mask, i: m.fill_next_token_bitmask(mask, i)
            self.take = lambda m, token: m.accept_token(token)
        elif name == "outlines":
            import numpy as np
            import outlines_core
            from outlines_core.json_schema import build_regex_from_schema
            words: dict[str, list[int]] = {}
            for token, index in _vocabulary_map(tokenizer).items():
                if index not in eos:
                    words.setdefault(token, []).append(index)
            vocabulary = outlines_core.Vocabulary(eos[0], words)
            self.compile = lambda schema: outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
            self.fresh = outlines_core.Guide
            self.alloc = lambda n: np.zeros((n, (vocab + 31) // 32), dtype=np.int32)
            self.fill = lambda m, mask, i: m.write_mask_into(mask[i].ctypes.data, mask[i].size, 4)
            self.take = lambda m, token: m.advance(token) is not None
        else:
            raise ValueError(f"--libraries: unknown library {name!r}")


def _vocabulary_map(tokenizer: Tokenizer) -> dict[str, int]:
    """Each token's string (byte-level BPE's own spelling) and id, added tokens included."""
    return BackendTokenizer.from_str(tokenizer.backend_json()).get_vocab(with_added_tokens=True)


def _vocabulary(tokenizer: Tokenizer) -> list[str]:
    """Token strings in id order, as xgrammar reads a vocabulary."""
    by_id = {index: token for token, index in _vocabulary_map(tokenizer).items()}
    return [by_id.get(index, "") for index in range(tokenizer.vocab_size)]


def _timed(call: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def everyday(name: str) -> dict:
    """The everyday schemas on `name` (in this process): compile, masks, memory."""
    tokenizer = Tokenizer.from_path(default_model_path())
    rss = psutil.Process().memory_info().rss
    setup_s, library = _timed(lambda: Library(name, tokenizer))
    results: dict = {"setup_ms": 1e3 * setup_s}
    for case, (schema, instance) in EVERYDAY.items():
        def first_mask(compiled: object) -> object:
            matcher = library.fresh(compiled)
            library.fill(matcher, library.alloc(1), 0)
            return matcher
        cold_s, compiled = _timed(lambda schema=schema: library.compile(schema))
        first_s, _ = _timed(lambda compiled=compiled: first_mask(compiled))
        cached_s, _ = _timed(lambda schema=schema: first_mask(library.compile(schema)))
        # Separators as each library writes JSON by default: the instance's tokens must be ones it allows.
        text = json.dumps(instance, separators=(", ", ": ") if name == "xgrammar" else (",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        matcher, mask, one = library.fresh(compiled), library.alloc(1), []
        batch, masks, step = [library.fresh(compiled) for _ in range(BATCH)], library.alloc(BATCH), []
        for token in tokens:
            started = time.perf_counter()
            library.fill(matcher, mask, 0)
            filled = time.perf_counter()
            for i, m in enumerate(batch):
                library.fill(m, masks, i)
            one.append(filled - started)
            step.append(time.perf_counter() - filled)
            if not all(library.take(m, token) for m in (matcher, *batch)):
                raise RuntimeError(f"{name} refused token {token} of its own {case} instance")
        results[case] = {"tokens": len(tokens), "compile_cold_ms": 1e3 * (cold_s + first_s),
                         "compile_cached_ms": 1e3 * cached_s, "mask_b1_us": 1e6 * statistics.median(one),
                         f"mask_b{BATCH}_step_us": 1e6 * statistics.median(step)}
    results["rss_added_mib"] = (psutil.Process().memory_info().rss - rss) / 2**20
    return results


def _pathological(name: str, case: str, answer: multiprocessing.Queue) -> None:
    library = Library(name, Tokenizer.from_path(default_model_path()))
    started = time.perf_counter()
    try:
        compiled = library.compile(PATHOLOGICAL[case])
        library.fill(library.fresh(compiled), library.alloc(1), 0)
        answer.put((time.perf_counter() - started, "compiled"))
    except Exception as error:  # a library's refusal is a result too
        answer.put((time.perf_counter() - started, f"refused: {str(error)[:80]}"))


def pathological(name: str, case: str, timeout_s: float) -> dict:
    """One pathological spec on `name` in a fresh process, at most `timeout_s` seconds."""
    answer: multiprocessing.Queue = multiprocessing.Queue()
    process = multiprocessing.Process(target=_pathological, args=(name, case, answer))
    process.start()
    process.join(timeout_s + 30)  # + the tokenizer's set-up
    if process.is_alive():
        process.kill()
        return {"seconds": None, "outcome": f"still compiling after {timeout_s:g} s: killed"}
    seconds, outcome = answer.get()
    return {"seconds": seconds, "outcome": outcome}


def main(argv: Sequence[str]) -> int:
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--libraries", default="llguidance,xgrammar,outlines")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a pathological spec may compile")
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    results: dict = {"command": command_line(__name__, argv), "machine": describe(), "load": load_average(),
                     "libraries": {}}
    for name in args.libraries.split(","):
        try:
            found = everyday(name)
        except ImportError as error:
            print(f"[grammar_backends] {name}: not installed ({error}); install the bench extra", file=sys.stderr)
            continue
        found["pathological"] = {case: pathological(name, case, args.timeout) for case in PATHOLOGICAL}
        results["libraries"][name] = found
        print(f"[grammar_backends] {name}: {json.dumps(found)}", flush=True)
    _table(results["libraries"])
    write_results(args.out, results)
    return 0


def _table(found: dict) -> None:
    print("\n| library | setup ms | " + " | ".join(
        f"{c} cold / cached ms | {c} mask b1 µs | {c} b{BATCH} step µs" for c in EVERYDAY) + " | RSS MiB |")
    print("|---|---:|" + "---:|---:|---:|" * len(EVERYDAY) + "---:|")
    for name, r in found.items():
        cells = [f"{r[c]['compile_cold_ms']:.1f} / {r[c]['compile_cached_ms']:.2f} | {r[c]['mask_b1_us']:.1f} | "
                 f"{r[c][f'mask_b{BATCH}_step_us']:.0f}" for c in EVERYDAY]
        print(f"| {name} | {r['setup_ms']:.0f} | " + " | ".join(cells) + f" | {r['rss_added_mib']:.1f} |")
    print("\n| pathological spec | " + " | ".join(found) + " |")
    print("|---|" + "---|" * len(found))
    for case in PATHOLOGICAL:
        cells = []
        for name in found:
            p = found[name]["pathological"][case]
            cells.append(p["outcome"] if p["seconds"] is None else f"{p['seconds']:.2f} s {p['outcome']}")
        print(f"| {case} | " + " | ".join(cells) + " |")
