"""vLLM's CPU build on the benchmark workload: offline `LLM.generate`, eager mode.

Runs inside bench/.cache/vllm-venv (see bench/setup_vllm.sh), from the repository's root:
`python -m bench.vllm.offline --workload PATH` prints one `BENCH-RESULT {json}` line.
The environment must already hold VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_KVCACHE_SPACE.
"""

from __future__ import annotations

from bench.vllm.version import install_version_lookup

# Before any vLLM import: its modules bind `version` at import time.
install_version_lookup()

import sys  # noqa: E402
from typing import Any  # noqa: E402

from bench.throughput.systems import run_cases, worker_main  # noqa: E402
from harness.token_timer import tpot  # noqa: E402


def load_llm(workload: dict, **options: object) -> Any:
    """vLLM's LLM on the workload's model at its `vllm_dtype` (default float32; "auto" is vLLM's own
    default), eager, prefix caching off like the other systems; `options`: more of LLM's arguments."""
    import vllm

    return vllm.LLM(
        model=workload["model_dir"],
        dtype=workload.get("vllm_dtype", "float32"),
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=workload["max_model_len"],
        max_num_seqs=workload["max_num_seqs"],
        seed=0,
        disable_log_stats=False,  # fills each output's metrics with first and last token times
        **options,
    )


def chosen_dtype(llm: Any) -> str:
    """The dtype the LLM resolved its `dtype` argument to."""
    try:
        return str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    except AttributeError:  # another vLLM's layout: the figure stands, the dtype it chose goes unnamed
        return "unknown"


def generate_greedy(llm: Any, prompts: list[list[int]], max_tokens: int,
                    **options: object) -> tuple[int, float, list[list[int]]]:
    """Greedy, ignore_eos: the output tokens generated in all, the mean time per output token after
    the first, and each request's output token ids; `options`: more of LLM.generate's arguments."""
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, **options)
    tpots = [tpot(o.metrics.first_token_ts, o.metrics.last_token_ts, len(o.outputs[0].token_ids)) for o in outputs]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, tokens)), sum(tpots) / len(tpots), tokens


def vllm_generate(workload: dict) -> dict:
    """Every case of the workload on vLLM's LLM (load_llm)."""
    import vllm

    dtype = workload.get("vllm_dtype", "float32")
    llm = load_llm(workload)
    chosen = chosen_dtype(llm)
    return {"system": "vllm", "version": vllm.__version__, "dtype": f"{dtype} ({chosen})",
            "mode": f"LLM.generate, dtype={dtype} ({chosen}), enforce_eager=True, V1 engine in-process, "
                    f"max_num_seqs={workload['max_num_seqs']}",
            "cases": run_cases(workload, lambda prompts, max_tokens: generate_greedy(llm, prompts, max_tokens)[:2])}


if __name__ == "__main__":
    sys.exit(worker_main(vllm_generate, __doc__))
