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

from bench.throughput.systems import run_cases, worker_main  # noqa: E402
from harness.token_timer import tpot  # noqa: E402


def vllm_generate(workload: dict) -> dict:
    """vLLM's LLM on the workload's model at its `vllm_dtype` (default float32; "auto" is vLLM's own
    default), eager, prefix caching off like the other systems."""
    import vllm
    from vllm.inputs import TokensPrompt

    dtype = workload.get("vllm_dtype", "float32")
    llm = vllm.LLM(
        model=workload["model_dir"],
        dtype=dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=workload["max_model_len"],
        max_num_seqs=workload["max_num_seqs"],
        seed=0,
        disable_log_stats=False,  # fills each output's metrics with first and last token times
    )

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tpots = [tpot(o.metrics.first_token_ts, o.metrics.last_token_ts, len(o.outputs[0].token_ids))
                 for o in outputs]
        return sum(len(o.outputs[0].token_ids) for o in outputs), sum(tpots) / len(tpots)

    try:
        chosen = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    except AttributeError:  # another vLLM's layout: the figure stands, the dtype it chose goes unnamed
        chosen = "unknown"
    return {"system": "vllm", "version": vllm.__version__, "dtype": f"{dtype} ({chosen})",
            "mode": f"LLM.generate, dtype={dtype} ({chosen}), enforce_eager=True, V1 engine in-process, "
                    f"max_num_seqs={workload['max_num_seqs']}",
            "cases": run_cases(workload, run)}


if __name__ == "__main__":
    sys.exit(worker_main(vllm_generate, __doc__))
