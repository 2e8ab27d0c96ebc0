"""llama.cpp (llama-cpp-python) on a GGUF file: each workload case's prompts one after another, greedy,
or (a workload with `"batched": true`) all of a case's prompts at once (bench/llamacpp/batched.py).

Runs in the venv bench/llamacpp/build.py makes, from the repository's root:
`python -m bench.llamacpp.offline --workload PATH` prints one `BENCH-RESULT {json}` line. It imports
the standard library, numpy, llama_cpp and bench's standard-library modules only: that venv has no
Tandem. The default mode serves one sequence at a time, so only batch-1 cases (one prompt, or
prompts timed in turn) fit it; the batched mode serves a case's prompts as concurrent sequences.
"""

from __future__ import annotations

import sys
import time

from bench.throughput.systems import pin_to_cores, run_cases, worker_main
from harness.token_timer import tpot


def llama_cpp_generate(workload: dict) -> dict:
    """llama.cpp's own decode loop without its sampler: eval the prompt, then take the argmax of the
    last logits and eval that token, max_tokens times (greedy; no end-of-text stop, as ignore_eos)."""
    import llama_cpp
    import numpy as np

    threads = workload["threads"]
    pin_to_cores(workload)
    llm = llama_cpp.Llama(model_path=workload["gguf"], n_ctx=workload["max_model_len"], n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    vocab = llm.n_vocab()

    def next_token() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        generated, tpots = 0, []
        for prompt in prompts:
            llm.reset()  # the next eval drops every cached position: no prefix is reused
            llm.eval(prompt)
            token, first_at = next_token(), time.perf_counter()
            for _ in range(max_tokens - 1):
                llm.eval([token])
                token = next_token()
            generated += max_tokens
            tpots.append(tpot(first_at, time.perf_counter(), max_tokens))
        return generated, sum(tpots) / len(tpots)

    return {"system": "llama.cpp", "version": llama_cpp.__version__,
            "mode": f"llama-cpp-python Llama.eval, one sequence, n_batch=512, {threads} threads, argmax decoding",
            "cases": run_cases(workload, run)}


def measure(workload: dict) -> dict:
    """The workload's mode: one sequence at a time, or every prompt of a case together."""
    if workload.get("batched"):
        from bench.llamacpp.batched import llama_cpp_batched

        return llama_cpp_batched(workload)
    return llama_cpp_generate(workload)


if __name__ == "__main__":
    sys.exit(worker_main(measure, __doc__))
