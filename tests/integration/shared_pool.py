"""The standard workers that integration modules share: two prefill and two decode worker processes,
started once per session (tests/integration/conftest.py), each module putting its own gateway in front.

Every worker process loads the model before it serves, and most modules need the same few workers,
so starting them once saves that load per module. A module shares them only if its tests leave the
workers as they found them: no fault injected, none killed, no flag of its own on a worker (a tiny
KV cache, TLS, a fault hook). The pool fixture checks at the end of each module that no request or
KV block is left behind, so that no module depends on what ran before it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import openai
from reference import PINNED_FLAGS

from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker

# The pinned formats, so that modules comparing with an in-process engine compute the same numbers on
# any CPU; a KV cache large enough for two modules' ~1,000-token prompts at once.
POOL_FLAGS = ["--threads", "1", "--kv-cache-mib", "256", *PINNED_FLAGS]
# decode[1] speculates, so that requests routed to it check that speculation leaves greedy output alone.
SPECULATION = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None,
                          "gate": "off"})
# Four loads at once, which the first module to ask waits for: longer than one worker's start may take.
READY_TIMEOUT_S = 900.0
# Objectives no request can miss, for gateways whose tests are not about admission.
NO_SLO = ["--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"]


@dataclass
class Pool:
    """The shared workers; `decode[1]` speculates (n-gram drafts)."""

    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.prefill, *self.decode]


def worker_args(role: str, *extra: str) -> list[str]:
    """A worker's arguments with the pool's flags and a port known before the start (so that a gateway
    can start beside it)."""
    return [role, "--port", str(free_port()), *POOL_FLAGS, *extra]


def start_pool() -> Pool:
    """Start the pool's workers together (their loads overlap); return once every one serves."""
    arg_lists = [worker_args("prefill"), worker_args("prefill"), worker_args("decode"),
                 worker_args("decode", "--speculative-config", SPECULATION)]
    workers = [start_worker(args, wait=False) for args in arg_lists]
    try:
        for worker in workers:
            worker.wait_ready(timeout=READY_TIMEOUT_S)
    except BaseException:
        for worker in workers:
            worker.stop(timeout=10.0)
        raise
    return Pool(workers[:2], workers[2:])


def gateway_args(prefill: list[list[str]], decode: list[list[str]], *flags: str) -> list[str]:
    """A gateway's arguments over workers given by their arguments (`--port` among them)."""

    def addresses(arg_lists: list[list[str]]) -> str:
        return ",".join(f"127.0.0.1:{args[args.index('--port') + 1]}" for args in arg_lists)

    return ["gateway", "--port", "0", "--http-port", "0", "--prefill", addresses(prefill),
            "--decode", addresses(decode), *flags]


def start_gateway(prefill: list[WorkerProcess], decode: list[WorkerProcess], *flags: str) -> WorkerProcess:
    """A gateway process over these workers, once it serves."""
    return start_worker(gateway_args([w.args for w in prefill], [w.args for w in decode], *flags))


@contextlib.contextmanager
def pair_gateways(pool: Pool, *flags: Sequence[str]) -> Iterator[list[WorkerProcess]]:
    """A gateway in front of each (prefill[i], decode[i]) pair, started together: (plain,
    speculating), the i-th with `flags[i]` added (objectives no request misses)."""
    processes = [start_worker(["gateway", "--port", "0", "--http-port", "0", "--prefill", str(pool.prefill[i].address),
                               "--decode", str(pool.decode[i].address), *NO_SLO,
                               *(flags[i] if i < len(flags) else ())], wait=False) for i in (0, 1)]
    try:
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        assert [process.stop() for process in processes] == [0, 0]


def openai_client(gateway: WorkerProcess, timeout_s: float = 300.0) -> openai.OpenAI:
    """The official SDK's client of a gateway's HTTP API."""
    return openai.OpenAI(base_url=f"http://{gateway.http_address}/v1", api_key="unused", max_retries=0,
                         timeout=timeout_s)
