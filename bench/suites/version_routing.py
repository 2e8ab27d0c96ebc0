"""What version-aware routing costs the gateway per request at 100 queued, against today's routing.

One run times, round after round (interleaved, so that a shared machine's drift hits every
configuration alike), the gateway's real per-request path before a worker is chosen:
`ModelCatalog.resolve` (the name, and for a repository the sticky split's version), then
`WorkerRegistry.route_request` (prefix lookups over the registry's workers) and `Admission.admit`
(two `WorkerRegistry.decide` calls, the request queued), for 100 requests; then one drain of the
admission queue holding them (every waiter re-decided, none placed). Tokenizing is left out: it is
the same work either way. Configurations:

- today: one model, no repository, 2 prefill + 2 decode workers;
- versions: a repository of 2 models x 2 versions (splits 90/10 and 50/50), each version on its own
  2 prefill + 2 decode workers (16 in the registry); the requests name the two models alternately,
  each with its own caller, so the split picks per caller and `decide` filters by `version_key`.
  Each request is routed over the same 2 + 2 workers as today: everything else is the overhead.
- one model on 16: today's gateway over the same 16 workers (context: routing over more workers).

The workers are the registry's own RemoteWorker objects holding load reports (no process behind
them), loaded so that no decision meets the TPOT objective while an idle one would: every request
waits. Target: versions <= 1.2x today per request.

    python -m bench version_routing [--rounds 30] [--repeats 2000]

Prints the medians and writes bench/results/version_routing.json.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.v1 import common_pb2

from bench.common.call_timer import drain_s, median_call_s
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.kv_cache.block_hash import PROBE_TEXT, prompt_block_hashes
from harness.repository_files import two_versions
from services.gateway.admission import Admission
from services.gateway.block_index import TierEvent
from services.gateway.catalog import CatalogEntry, ModelCatalog
from services.gateway.hash_probe import ProbeReport
from services.gateway.model import ServedModel
from services.gateway.registry import WorkerRegistry
from services.gateway.router import SloTargets
from services.repository.config import load_repository

QUEUED = 100
TARGET_RATIO = 1.2
SLO = SloTargets(ttft_s=2.0, tpot_s=0.1)
PROMPT = tuple(range(1000, 2000))  # 1,000 tokens, a 512-token prefix of it cached on one prefill worker
SALT = b"fingerprint"  # the workers' block-hash salt
PROBE = tuple(ord(c) for c in PROBE_TEXT)  # the probe text by a stand-in tokenizer (code points)
MAX_TOKENS = 64
BLOCK_SIZE = 16
TOTAL_BLOCKS = 4000
# Each step of a loaded decode worker (3 or 6 sequences) takes over the 100 ms TPOT objective, an
# idle one's does not: admission queues every request and a drain places none.
STEP = common_pb2.StepModel(base_s=0.06, per_prompt_token_s=0.0005, per_sequence_s=0.015, per_context_token_s=1e-6)
PREFILL_QUEUES = (900, 300)  # queued prompt tokens of a version's two prefill workers
DECODE_LOADS = ((6, 3000, 900), (3, 1500, 2000))  # sequences, context tokens, free blocks of its decode workers
REPOSITORY = two_versions("q4 = 90, fp32 = 10", name="chat") + two_versions("q4 = 50, fp32 = 50", name="code")


@dataclass
class Setup:
    """One configuration: the catalog and registry the gateway would hold, and what each of the
    queued requests names (its `model`, its caller)."""

    name: str
    catalog: ModelCatalog
    registry: WorkerRegistry
    requests: list[tuple[str, str]]


def _fleet(groups: int, port: int) -> tuple[list[str], list[str]]:
    """Addresses of `groups` x (2 prefill + 2 decode) workers; nothing listens there."""
    prefill = [f"127.0.0.1:{port + 4 * g + i}" for g in range(groups) for i in range(2)]
    decode = [f"127.0.0.1:{port + 4 * g + 2 + i}" for g in range(groups) for i in range(2)]
    return prefill, decode


def _load(registry: WorkerRegistry, keys: Sequence[tuple[str, str]]) -> None:
    """Give every worker a report (group g of 2 prefill + 2 decode serving keys[g]), hashes the
    gateway accepts, and the prompt's prefix on each group's first prefill worker's device, as that
    worker's block events would have said."""
    hashes = prompt_block_hashes(PROMPT, BLOCK_SIZE, SALT)[:512 // BLOCK_SIZE]
    registry.probe.probe_tokens = lambda version_key: PROBE
    prefill = [w for w in registry.workers if w.role == "prefill"]
    decode = [w for w in registry.workers if w.role == "decode"]
    for group, (name, version) in enumerate(keys):
        layout = f"pages-{name}-{version}"  # a version's prefill and decode workers pair
        common = {"block_size": BLOCK_SIZE, "block_hash_salt": SALT, "total_kv_blocks": TOTAL_BLOCKS,
                  "step_model": STEP, "max_num_batched_tokens": 2048, "kv_layout": layout, "model_name": name,
                  "model_version": version}
        for worker, queued in zip(prefill[2 * group:2 * group + 2], PREFILL_QUEUES, strict=True):
            worker.report = common_pb2.LoadReport(role="prefill", queued_prompt_tokens=queued,
                                                  free_kv_blocks=TOTAL_BLOCKS, **common)
        for worker, (sequences, context, free) in zip(decode[2 * group:2 * group + 2], DECODE_LOADS, strict=True):
            worker.report = common_pb2.LoadReport(role="decode", running_requests=sequences, context_tokens=context,
                                                  free_kv_blocks=free, **common)
        registry.blocks.apply(prefill[2 * group].address, "", [TierEvent("device", True, hashes)], reset=True)
    probe = tuple(prompt_block_hashes(PROBE, BLOCK_SIZE, SALT))
    for worker in registry.workers:
        worker.serving = True
        registry.probe.check(worker.address, ProbeReport(worker.version_key, BLOCK_SIZE, SALT, probe))


def setups(folder: Path) -> list[Setup]:
    """The three configurations (see the module docstring); call on the event loop (channels)."""
    served = ServedModel.load(None)
    callers = [f"user-{i}" for i in range(QUEUED)]
    today = WorkerRegistry(*_fleet(1, 20000))
    _load(today, [(served.id, "")])
    wide = WorkerRegistry(*_fleet(4, 20100))
    _load(wide, [(served.id, "")] * 4)
    path = folder / "models.toml"
    path.write_text(REPOSITORY)
    repository = load_repository(str(path))
    versioned = WorkerRegistry(*_fleet(4, 20200))
    _load(versioned, [(v.model, v.name) for v in repository.versions])
    # ModelCatalog.load's entries, with the tokenizer read once (a read takes seconds; every version
    # here is the shipped model's).
    catalog = ModelCatalog([CatalogEntry(ServedModel(v.model, served.max_model_len, served.tokenizer), v)
                            for v in repository.versions], repository)
    return [
        Setup("today", ModelCatalog.single(served), today, [(served.id, caller) for caller in callers]),
        Setup("versions", catalog, versioned,
              [(("chat", "code")[i % 2], caller) for i, caller in enumerate(callers)]),
        Setup("one model on 16", ModelCatalog.single(served), wide, [(served.id, caller) for caller in callers]),
    ]


async def fill_and_drain(setup: Setup) -> tuple[float, float]:
    """Seconds to take the 100 requests into the admission queue, and to drain it once."""
    admission = Admission(setup.registry, max_queued=QUEUED)
    arrived_at = time.monotonic() + 3600  # no deadline passes during the drain
    waiting = []
    started = time.perf_counter()
    for requested, caller in setup.requests:
        target = setup.catalog.resolve(requested, caller)
        request = setup.registry.route_request(PROMPT, MAX_TOKENS, SLO, target.version_key)
        waiting.append(asyncio.create_task(admission.admit(request, arrived_at=arrived_at)))
    await asyncio.sleep(0)  # each admit runs to its wait here
    filled = time.perf_counter() - started
    if admission.queued != QUEUED:
        raise RuntimeError(f"{setup.name}: {admission.queued} of {QUEUED} requests queued; the loads must "
                           "make every decision miss the SLO")
    return filled, await drain_s(admission, waiting)


def components(setup: Setup, repeats: int) -> dict[str, float]:
    """Median seconds of each step alone over `repeats` calls (the requests taken in turn)."""
    turns = itertools.cycle(setup.requests)
    keyed = itertools.cycle([setup.catalog.resolve(*request).version_key for request in setup.requests])
    requests = itertools.cycle([setup.registry.route_request(PROMPT, MAX_TOKENS, SLO, next(keyed))
                                for _ in setup.requests])
    return {"resolve": median_call_s(lambda: setup.catalog.resolve(*next(turns)), repeats),
            "route_request": median_call_s(
                lambda: setup.registry.route_request(PROMPT, MAX_TOKENS, SLO, next(keyed)), repeats),
            "decide": median_call_s(lambda: setup.registry.decide(next(requests)), repeats)}


async def measure(rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per configuration: the median fill and drain of `rounds` rounds, and the steps' medians."""
    with tempfile.TemporaryDirectory() as folder:
        configurations = setups(Path(folder))
    samples: dict[str, list[tuple[float, float]]] = {s.name: [] for s in configurations}
    await fill_and_drain(configurations[0])  # warm-up: first calls build caches
    for _ in range(rounds):
        for setup in configurations:
            samples[setup.name].append(await fill_and_drain(setup))
    results = {}
    for setup in configurations:
        fill = statistics.median(f for f, _ in samples[setup.name])
        drain = statistics.median(d for _, d in samples[setup.name])
        results[setup.name] = {"fill_s": fill, "drain_s": drain, "per_request_s": (fill + drain) / QUEUED,
                               **{f"{k}_s": v for k, v in components(setup, repeats).items()}}
        await setup.registry.close()
    return results


def main(argv: Sequence[str]) -> int:
    """Time the three configurations; print the medians and the ratio against the target."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--rounds", type=int, default=30, help="timed fills and drains of each configuration")
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls of each step alone")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.rounds, args.repeats))
    load = load_average()
    ratio = results["versions"]["per_request_s"] / results["today"]["per_request_s"]
    drain_ratio = results["versions"]["drain_s"] / results["today"]["drain_s"]
    print(f"load average {load}; medians, {QUEUED} queued; per request = (fill + drain) / {QUEUED}")
    print(f"{'':<18}{'fill':>10}{'drain':>10}{'per request':>13}{'resolve':>10}{'route_req':>11}{'decide':>9}")
    for name, row in results.items():
        print(f"{name:<18}{row['fill_s'] * 1e3:>8.2f}ms{row['drain_s'] * 1e3:>8.2f}ms"
              f"{row['per_request_s'] * 1e6:>11.1f}us{row['resolve_s'] * 1e6:>8.1f}us"
              f"{row['route_request_s'] * 1e6:>9.1f}us{row['decide_s'] * 1e6:>7.1f}us")
    met = ratio <= TARGET_RATIO
    print(f"versions / today per request: {ratio:.2f}x (drain alone {drain_ratio:.2f}x); target <= "
          f"{TARGET_RATIO}x: {'met' if met else 'MISSED'}")
    write_results(results_path(__name__), {
        "command": command_line(__name__, argv), "load_average": load, "queued": QUEUED, "median": results,
        "ratio_per_request": ratio, "ratio_drain": drain_ratio, "target_ratio": TARGET_RATIO, "target_met": met,
    })
    return 0
