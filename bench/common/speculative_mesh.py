"""The speculative suite through the mesh: one prefill worker, two decode workers (without and with
`--speculative-config`), a gateway in front of each, every request a streamed `/v1/completions`
call (greedy, ignore_eos) through a gateway's OpenAI API, the two gateways alternated per case.

Batch 1 reports decode tok/s (each request's tokens after the first over the time after its
first, summed); higher concurrency (closed loop) output tok/s. Drafted and accepted tokens come
from the speculating worker's vLLM counters.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence

from harness.load_clients import HTTP, OK, LoadRequest, LoadRunner
from harness.worker import WorkerProcess, start_worker

WORKER_FLAGS = ("--threads", "1")
COUNTERS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")


class SpeculativeMesh:
    """The processes; `runners` and their gateways' `http_addresses` by system ("default", "ngram");
    `stop()` ends them."""

    def __init__(self, spec_json: str, env: dict[str, str] | None = None) -> None:
        self.processes: list[WorkerProcess] = []
        try:
            starts = [["prefill"], ["decode"], ["decode", "--speculative-config", spec_json]]
            workers = [start_worker([args[0], "--port", "0", *WORKER_FLAGS, *args[1:]], wait=False, env=env)
                       for args in starts]
            self.processes += workers
            prefill, *decodes = (worker.wait_ready() for worker in workers)
            self.speculating = workers[2]
            self.runners = {}
            self.http_addresses: dict[str, str] = {}
            for system, decode in zip(("default", "ngram"), decodes, strict=True):
                gateway = start_worker(["gateway", "--port", "0", "--http-port", "0", "--prefill", prefill,
                                        "--decode", decode, "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"])
                self.processes.append(gateway)
                self.runners[system] = LoadRunner(str(gateway.address), str(gateway.http_address))
                self.http_addresses[system] = str(gateway.http_address)
        except BaseException:
            self.stop()
            raise

    def counters(self) -> tuple[float, float]:
        """Draft tokens and accepted tokens the speculating worker counted so far."""
        text = urllib.request.urlopen(f"http://{self.speculating.metrics_address}/metrics", timeout=10).read()
        values = dict.fromkeys(COUNTERS, 0.0)
        for line in text.decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
        return values[COUNTERS[0]], values[COUNTERS[1]]

    def run(self, system: str, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int) -> dict:
        """Every prompt once through `system`'s gateway, `concurrency` in flight."""
        requests = [LoadRequest(tuple(prompt), max_tokens, api=HTTP) for prompt in prompts]
        before = self.counters()
        start = time.perf_counter()
        outcomes = self.runners[system].run_all(requests, concurrency)
        elapsed = time.perf_counter() - start
        after = self.counters()
        failed = [o for o in outcomes if o.status != OK or o.tpot_s is None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outcomes)} requests failed: {failed[0]}")
        tokens = sum(o.tokens for o in outcomes)
        decode_s = sum(o.tpot_s * (o.tokens - 1) for o in outcomes)  # type: ignore[operator]
        return {"output_tok_s": tokens / elapsed, "decode_tok_s": (tokens - len(outcomes)) / decode_s,
                "output_tokens": tokens, "draft_tokens": after[0] - before[0],
                "accepted_tokens": after[1] - before[1]}

    def stop(self) -> None:
        for runner in getattr(self, "runners", {}).values():
            runner.close()
        for process in reversed(self.processes):
            process.stop()
