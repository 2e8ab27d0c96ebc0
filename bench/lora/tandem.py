"""Tandem's side of the lora suite: `python -m bench.lora.tandem --workload PATH --setup NAME` starts
one Engine (engine.offline.generate, every request submitted at once) as engine_throughput does:
the workload's model at its `dtype` (engine_throughput's: the defaults, "auto"), prefix caching off,
the same KV budget; with LoRA (`max_loras` > 0) it serves the setup's first `max_loras` adapters with
as many slots, rank up to 16 and as many kept in memory, so a row's adapters all fit one step.
It times the setup's rows, then, where the setup asks, the adapters' load times, and prints one
`BENCH-RESULT {json}` line.

Load times, each the median over the workload's adapters: cold is an adapter read from its files
and checked against the base (engine.lora.serving's read: what a worker does for
/v1/load_lora_adapter, and again for an adapter dropped from memory), its files in the page cache;
from the CPU set is the copy of an adapter already read into a slot (LoraSlots.load, what the runner
does before the step that first runs a request for an adapter not in a slot).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common.call_timer import median_call_s
from bench.lora.rows import time_row, worker_main
from bench.throughput.systems import KV_CACHE_GIB, pin_to_cores, revision

if TYPE_CHECKING:
    from engine.lora.serving import ServedAdapters


def measure(workload: dict, setup_name: str) -> dict:
    """The setup's rows on Tandem (and its load times where it asks for them)."""
    import torch

    from bench.common.engine_formats import engine_formats
    from engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    setup = workload["setups"][setup_name]
    pin_to_cores(workload)
    torch.set_num_threads(workload["threads"])
    count = setup["max_loras"]
    adapters = [(name, path) for name, path in workload["adapters"]]
    lora = None if not count else LoraConfig(max_loras=count, max_lora_rank=workload["max_lora_rank"],
                                             max_cpu_loras=count, modules=tuple(adapters[:count]))
    engine = Engine(EngineConfig(
        model=workload["model_dir"], dtype=workload["dtype"], max_model_len=workload["max_model_len"],
        cache=CacheConfig(memory_bytes=KV_CACHE_GIB << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=workload["max_num_seqs"]), lora=lora,
    ))

    def run(prompts: list[list[int]], max_tokens: int, names: list[str]) -> tuple[int, float, list[list[int]]]:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=name)
                  for name in names]
        completions = generate(engine, prompts, params)
        return (sum(len(c.token_ids) for c in completions), sum(c.tpot_s for c in completions) / len(completions),
                [c.token_ids for c in completions])

    rows = {name: time_row(workload, name, k, run) for name, k in setup["rows"].items()}
    result = {"system": "tandem", "version": revision(), "engine": engine_formats(engine), "rows": rows}
    if setup.get("load_times") and engine.adapters is not None:
        result["load_s"] = _load_times(engine.adapters, adapters[:count])
    return result


def _load_times(served: ServedAdapters, adapters: list[tuple[str, str]]) -> dict[str, float]:
    """Median seconds of an adapter read cold and of one copied from the CPU set into a slot. Run
    after the rows: the slots' copies bypass the registry, so the engine serves nothing after them."""
    read = [served.read(name, Path(path)) for name, path in adapters]  # every one once, so files are cached
    files, slotted = itertools.cycle(adapters), itertools.cycle(enumerate(read))

    def read_next() -> None:
        name, path = next(files)
        served.read(name, Path(path))

    def load_next() -> None:
        index, adapter = next(slotted)
        served.slots.load(index % served.slots.count, adapter.rank, adapter.weights)

    cold, from_cpu = median_call_s(read_next, len(adapters)), median_call_s(load_next, len(read))
    return {"cold": cold, "from_cpu_set": from_cpu}


if __name__ == "__main__":
    sys.exit(worker_main(measure, __doc__))
