"""vLLM's CPU build scored as the gptq_awq suite scores Tandem: teacher-forced log-likelihood of
fixed windows and greedy outputs on fixed prompts, offline `LLM.generate`, eager mode.

Runs inside bench/.cache/vllm-venv (see bench/setup_vllm.sh), from the repository's root:
`python -m bench.vllm.quality --workload PATH` prints one `BENCH-RESULT {json}` line. The workload
names model_dir, dtype, windows, prompts, tokens, max_model_len and max_num_seqs. The environment must
already hold VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_KVCACHE_SPACE.

A checkpoint vLLM refuses, at start-up or on its first forward pass, is a result too: `refused` holds
the innermost error of the chain (the reason, where the outer ones only say that start-up failed).
"""

from __future__ import annotations

from bench.vllm.version import install_version_lookup

# Before any vLLM import: its modules bind `version` at import time.
install_version_lookup()

import sys  # noqa: E402

from bench.throughput.systems import worker_main  # noqa: E402


def score(workload: dict) -> dict:
    """The windows' summed next-token negative log-likelihood (from `prompt_logprobs=0`: the logprob
    of each actual prompt token after the first) and the prompts' greedy token ids."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    settings = {"model": workload["model_dir"], "dtype": workload["dtype"], "enforce_eager": True,
                "enable_prefix_caching": False, "max_model_len": workload["max_model_len"],
                "max_num_seqs": workload["max_num_seqs"], "seed": 0}
    chosen: dict = {"version": vllm.__version__}
    try:
        # The dtype and method vLLM resolves, read before it loads the model: a refused run names them too.
        config = EngineArgs(**settings).create_model_config()
        chosen |= {"dtype": str(config.dtype).removeprefix("torch."), "quantization": config.quantization}
        llm = vllm.LLM(**settings)
        windows = llm.generate([TokensPrompt(prompt_token_ids=w) for w in workload["windows"]],
                               vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
        greedy = llm.generate([TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]],
                              vllm.SamplingParams(max_tokens=workload["tokens"], temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    except Exception as error:  # the refusal is the row's result, whatever vLLM raises it as
        return {**chosen, "refused": _reason(error)}
    nll, predictions = 0.0, 0
    for ids, output in zip(workload["windows"], windows, strict=True):
        for position, logprobs in enumerate(output.prompt_logprobs[1:], start=1):
            nll -= logprobs[ids[position]].logprob
            predictions += 1
    return {**chosen, "nll_sum": nll, "predictions": predictions,
            "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


def _reason(error: BaseException) -> str:
    """The innermost error of `error`'s chain, as its type and the last line of its message that says
    something (pydantic's validation errors follow the reason with its input and a help link)."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    lines = [line.split(" [type=", 1)[0].strip() for line in str(error).splitlines()
             if line.strip() and "errors.pydantic.dev" not in line]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


if __name__ == "__main__":
    sys.exit(worker_main(score, __doc__))
