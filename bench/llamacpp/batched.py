"""llama.cpp serving every prompt of a case at once through its multi-sequence batch API, greedy.

llama-cpp-python's high-level `Llama` holds one sequence; llama.cpp itself batches many: a context
made with `n_seq_max` sequences keeps each one's KV under its sequence id, and one `llama_decode`
of a `llama_batch` carrying one token per sequence (each with its own position and seq id, logits
asked for every row) advances all of them together, as llama.cpp's own batched example and server
do. Here each prompt is decoded alone under its id (its last row's logits give its first token),
then every step decodes one token for every sequence and takes each row's argmax
(`llama_get_logits_ith`): no sampler, no end-of-text stop (ignore_eos).

Imported by bench/llamacpp/offline.py in the llama.cpp venv: the standard library, numpy, llama_cpp
and bench's standard-library modules only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from bench.throughput.systems import pin_to_cores, run_cases
from harness.token_timer import tpot

N_BATCH = 512  # llama_decode's largest batch: a prompt is decoded in pieces of at most this

Row = tuple[int, int, int, bool]  # token, position, sequence id, whether its logits are wanted


class BatchedContext:
    """A llama.cpp model and a context of `sequences` sequences of `per_sequence` tokens each, on
    `threads` threads, with one reusable batch."""

    def __init__(self, gguf: str, sequences: int, per_sequence: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = sequences * per_sequence  # the KV cache of every sequence
        params.n_batch = params.n_ubatch = max(N_BATCH, sequences)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {sequences} x {per_sequence} tokens")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.capacity = int(params.n_batch)
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)

    def clear(self) -> None:
        """Drop every sequence's KV: the next run reuses no prefix."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, rows: Sequence[Row]) -> None:
        """One llama_decode of `rows` (at most the batch's capacity)."""
        batch = self.batch
        for i, (token, position, sequence, logits) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = logits
        batch.n_tokens = len(rows)
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {len(rows)} rows")

    def argmax(self, index: int) -> int:
        """The greedy token of the `index`-th row asked for logits in the last decode."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
        return int(np.argmax(logits))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def prefill(context: BatchedContext, sequence: int, prompt: list[int]) -> int:
    """Decode `prompt` as sequence `sequence`, in pieces the batch holds; its first greedy token."""
    for start in range(0, len(prompt), context.capacity):
        piece = prompt[start : start + context.capacity]
        context.decode([(token, start + i, sequence, start + i == len(prompt) - 1) for i, token in enumerate(piece)])
    return context.argmax(-1)


def generate_together(context: BatchedContext, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Every prompt as its own sequence, then `max_tokens - 1` steps of one token for each, all in one
    batch: tokens generated, and the time per output token after the first (every sequence's, as
    they advance together)."""
    context.clear()
    tokens = [prefill(context, sequence, prompt) for sequence, prompt in enumerate(prompts)]
    positions = [len(prompt) for prompt in prompts]
    first_at = time.perf_counter()
    for _ in range(max_tokens - 1):
        context.decode([(token, positions[s], s, True) for s, token in enumerate(tokens)])
        tokens = [context.argmax(s) for s in range(len(prompts))]
        positions = [p + 1 for p in positions]
    return len(prompts) * max_tokens, tpot(first_at, time.perf_counter(), max_tokens)


def llama_cpp_batched(workload: dict) -> dict:
    """The workload's cases, each case's prompts served together (see the module)."""
    import llama_cpp

    pin_to_cores(workload)
    threads = workload["threads"]
    sequences = max(len(case["prompts"]) for case in [*workload["cases"], {"prompts": workload["warmup_prompts"]}])
    context = BatchedContext(workload["gguf"], sequences, workload["max_model_len"], threads)
    try:
        cases = run_cases(workload, lambda prompts, max_tokens: generate_together(context, prompts, max_tokens))
    finally:
        context.close()
    return {"system": "llama.cpp", "version": llama_cpp.__version__,
            "mode": f"llama-cpp-python low-level batches: n_seq_max={sequences}, one token per sequence per "
                    f"llama_decode, {threads} threads, argmax decoding",
            "cases": cases}
