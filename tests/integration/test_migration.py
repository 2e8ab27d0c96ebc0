"""A decode worker killed (SIGKILL) mid-stream: the gateway resumes the request on the other decode
worker from what the client already has, and the client's stream goes on as if nothing happened,
through the gRPC API and the OpenAI HTTP API, a structured output of every kind still matching its
constraint; with `--max-migrations 0` the client gets UNAVAILABLE.

Real processes on loopback: one prefill worker, two decode workers, and three gateways in front of
them: the default limit, none, and one that knows the decode workers as colocated, so they compute
the prompt and the delivered tokens themselves (the router's local prefill). Each test kills the
decode worker running its request, and a fresh one takes its place (same port) before the next test.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import jsonschema
import openai
import pytest
from constrained_replies import TAG, TAGGED, tagged_records
from reference import PINNED_FLAGS, ReferenceRun, check_runs, check_text, margins_of

from engine.offline import Completion, generate
from engine.sampling_params import SamplingParams
from harness.leak_check import assert_no_leaks, load_report
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from services.client import TandemClient

WORKER_FLAGS = ["--threads", "1", "--kv-cache-mib", "256", *PINNED_FLAGS]
DEADLINE_S = 60.0  # generous bound for conditions polled below; no test asserts elapsed time
RPC_TIMEOUT_S = 300.0
# Multi-byte characters early in the answer, so the split may fall where text is held back.
PROMPT = "Café, naïve, Grüße, Ærø, 日本語, 🙂.\nRepeat the list: Café,"
MAX_TOKENS = 150
KILL_AFTER_TOKENS = 5
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
# The resumed request's generator must be advanced past the draws of the tokens already streamed.
SEEDED = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 7, "ignore_eos": True}


@dataclass
class Mesh:
    prefill: WorkerProcess
    decode: list[WorkerProcess]
    gateway: WorkerProcess  # resumes a request at most twice (the default)
    strict: WorkerProcess  # --max-migrations 0
    local: WorkerProcess  # --colocated: every attempt is prefilled on its decode worker

    @property
    def gateways(self) -> list[WorkerProcess]:
        return [self.gateway, self.strict, self.local]

    @property
    def workers(self) -> list[WorkerProcess]:
        return [self.prefill, *self.decode]


def _address(args: list[str]) -> str:
    return f"127.0.0.1:{args[args.index('--port') + 1]}"


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    # Ports known before the start, so that the gateways can start with the workers.
    prefill, *decode = [[role, "--port", str(free_port()), *WORKER_FLAGS] for role in ("prefill", "decode", "decode")]
    gateway = ["gateway", "--port", "0", "--http-port", "0", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"]
    pools = ["--prefill", _address(prefill), "--decode", ",".join(_address(args) for args in decode)]
    local = [*gateway, "--colocated", ",".join(_address(args) for args in decode)]
    processes = [start_worker(args, wait=False) for args in (
        prefill, *decode, [*gateway, *pools], [*gateway, *pools, "--max-migrations", "0"], local)]
    for process in processes:
        process.wait_ready()
    mesh = Mesh(processes[0], processes[1:3], *processes[3:])
    yield mesh
    codes = [process.stop() for process in (*mesh.gateways, *mesh.workers)]
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def reference(make_engine, tokenizer) -> Callable[[dict], Completion]:
    """The no-fault run of PROMPT with these sampling fields, on one in-process colocated engine, with
    its top-2 logprobs (for the near-tie rule of greedy runs: the mesh computes in other batch shapes)."""
    engine = make_engine()

    def run(sampling: dict) -> Completion:
        [completion] = generate(engine, [tokenizer.encode(PROMPT)], SamplingParams(**sampling, logprobs=2))
        return completion

    return run


@pytest.fixture
def kill(mesh: Mesh) -> Iterator[Callable[[], WorkerProcess]]:
    """`kill()` SIGKILLs the decode worker running a request now and returns it; after the test a
    fresh decode worker takes its port, and every gateway routes to it again."""
    killed: list[WorkerProcess] = []

    def kill_the_running_one() -> WorkerProcess:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            running = [worker for worker in mesh.decode if load_report(worker).running_requests]
            if running:
                running[0].proc.kill()
                running[0].proc.wait()
                killed.append(running[0])
                return running[0]
            assert time.monotonic() < deadline, "no decode worker runs the request"
            time.sleep(0.05)

    yield kill_the_running_one
    for worker in killed:
        _replace(mesh, worker)


def _replace(mesh: Mesh, killed: WorkerProcess) -> None:
    """Restart the killed decode worker on its port; return once every gateway routes to it: SERVING
    and its load reports arriving (the gateway's watch of them reconnects with a backoff, and a
    request migrated off the other worker before that finds no worker to go to)."""
    address = _address(killed.args)
    seen = {gateway: _serving_lines(gateway, address) for gateway in mesh.gateways}
    mesh.decode[mesh.decode.index(killed)] = start_worker(killed.args)
    killed.log_path.unlink(missing_ok=True)
    deadline = time.monotonic() + DEADLINE_S
    while any(_serving_lines(gateway, address) <= count or not _routable(gateway, address)
              for gateway, count in seen.items()):
        assert time.monotonic() < deadline, "a gateway does not route to the restarted decode worker"
        time.sleep(0.1)


def _routable(gateway: WorkerProcess, address: str) -> bool:
    """Whether the gateway's tandem:worker_routable is 1 for the worker at `address`."""
    with urllib.request.urlopen(f"http://{gateway.http_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return re.search(rf'^tandem:worker_routable{{[^}}]*worker="{re.escape(address)}"[^}}]*}} 1\.0$', text,
                     re.MULTILINE) is not None


def _serving_lines(gateway: WorkerProcess, address: str) -> int:
    """How often the gateway logged the worker at `address` as SERVING."""
    return gateway.log_path.read_text(errors="replace").count(f" worker {address} is SERVING")


def _survivors(mesh: Mesh, killed: WorkerProcess) -> list[WorkerProcess]:
    return [worker for worker in mesh.workers if worker is not killed]


def _migrations(gateway: WorkerProcess) -> float:
    """The gateway's tandem:request_migrations_total."""
    with urllib.request.urlopen(f"http://{gateway.http_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    match = re.search(r"^tandem:request_migrations_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match is not None, "the gateway exports no migration counter"
    return float(match.group(1))


@pytest.mark.parametrize(("through", "sampling"), [
    ("prefill-worker", GREEDY), ("local-prefill", GREEDY), ("prefill-worker", SEEDED),
], ids=["greedy-prefill-worker", "greedy-local-prefill", "seeded-prefill-worker"])
def test_grpc_stream_goes_on_when_its_decode_worker_is_killed(mesh, kill, reference, tokenizer, through, sampling):
    gateway = mesh.gateway if through == "prefill-worker" else mesh.local
    expected = reference(sampling)
    prompt = tokenizer.encode(PROMPT)
    migrations = _migrations(gateway)
    chunks, killed = [], None
    with TandemClient(str(gateway.address)) as client:
        for chunk in client.generate(token_ids=prompt, **sampling, timeout=RPC_TIMEOUT_S):
            chunks.append(chunk)
            if killed is None and sum(len(c.token_ids) for c in chunks) >= KILL_AFTER_TOKENS:
                killed = kill()
    assert killed is not None
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    if sampling is GREEDY:
        check_runs([tokens], [ReferenceRun(expected.token_ids, margins_of(expected))], "migrated stream")
    else:  # a seeded sample has no near-tie rule: the same seed draws the same tokens
        assert tokens == expected.token_ids
    if tokens == expected.token_ids:
        assert "".join(chunk.text for chunk in chunks) == expected.text
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(prompt), MAX_TOKENS)
    assert last.timings is not None and 0 < last.timings.ttft_s <= last.timings.e2e_s
    assert _migrations(gateway) == migrations + 1
    assert_no_leaks(_survivors(mesh, killed))


def test_openai_stream_goes_on_when_its_decode_worker_is_killed(mesh, kill, reference, tokenizer):
    expected = reference(GREEDY)
    client = openai.OpenAI(base_url=f"http://{mesh.gateway.http_address}/v1", api_key="unused", max_retries=0,
                           timeout=RPC_TIMEOUT_S)
    [model] = client.models.list().data
    texts, usage, killed = [], None, None
    stream = client.completions.create(
        model=model.id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for event in stream:
        if event.choices:
            texts.append(event.choices[0].text)
        usage = event.usage or usage
        if killed is None and len(texts) >= KILL_AFTER_TOKENS:
            killed = kill()
    assert killed is not None
    if "".join(texts) != expected.text:
        check_text("".join(texts), ReferenceRun(expected.token_ids, margins_of(expected)), tokenizer.decode,
                   "migrated OpenAI stream")
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        len(tokenizer.encode(PROMPT)), MAX_TOKENS)
    assert_no_leaks(_survivors(mesh, killed))


CITY_LIST = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                      "minItems": 6, "maxItems": 6}},
             "required": ["cities"], "additionalProperties": False}
SENTENCES = ["Paris is the largest city of France, on the river Seine, with more than two million people living "
             "inside its ring road and twelve million in its region.",
             "Lyon is the third city of France, where the Rhone and the Saone meet, known for its silk, its old town "
             "and its food."]
WORDS = r"([A-Z][a-z]{2,8}, ){11}[A-Z][a-z]{2,8}\."
LIST_GRAMMAR = 'start: CITY (", " CITY)~11 "."\nCITY: /[A-Z][a-z]{2,8}/'
OBJECTS = ('{"country": "France", "capital": "Paris", "largest cities": ["Paris", "Marseille", "Lyon", "Toulouse"], '
           '"river": "Seine"}\n{"country": "Italy", "capital": "Rome", "largest cities": ["Rome", "Milan", "Naples", '
           '"Turin"], "river": "Tiber"}\n')
# Every kind with replies long enough (30 tokens and more) that the kill after KILL_AFTER_TOKENS
# finds them running: the constraint, the prompt and the check of the whole reply.
MIGRATED_KINDS = {
    "json": ({"json": CITY_LIST}, "Six cities of France, as JSON:",
             lambda text: jsonschema.validate(json.loads(text), CITY_LIST) is None),
    "json_object": ({"json_object": True}, OBJECTS, lambda text: isinstance(json.loads(text), dict)),
    "regex": ({"regex": WORDS}, "Twelve cities of France:", lambda text: re.fullmatch(WORDS, text) is not None),
    "choice": ({"choice": SENTENCES}, "The largest city of France:", lambda text: text in SENTENCES),
    "grammar": ({"grammar": LIST_GRAMMAR}, "Twelve cities of France:",
                lambda text: re.fullmatch(WORDS, text) is not None),
    "structural_tag": ({"structural_tag": json.dumps(TAG)}, TAGGED, lambda text: tagged_records(text, cut=True) >= 1),
}


@pytest.mark.parametrize("kind", list(MIGRATED_KINDS))
def test_a_structured_output_resumes_its_grammar_on_the_new_worker(mesh, kill, kind):
    """The new decode worker rebuilds the grammar from the spec and the tokens already streamed: the
    migrated reply still matches its constraint, whatever its kind (and ends when it is complete)."""
    constraint, prompt, matches = MIGRATED_KINDS[kind]
    client = openai.OpenAI(base_url=f"http://{mesh.gateway.http_address}/v1", api_key="unused", max_retries=0,
                           timeout=RPC_TIMEOUT_S)
    [model] = client.models.list().data
    texts, killed, finish = [], None, None
    stream = client.completions.create(model=model.id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                       stream=True, extra_body={"structured_outputs": constraint})
    for event in stream:
        if event.choices:
            texts.append(event.choices[0].text)
            finish = event.choices[0].finish_reason or finish
        if killed is None and len(texts) >= KILL_AFTER_TOKENS:
            killed = kill()
    text = "".join(texts)
    assert killed is not None and (finish == "stop" or kind == "structural_tag") and matches(text), (kind, text)
    assert_no_leaks(_survivors(mesh, killed))


def test_without_migrations_the_client_gets_unavailable(mesh, kill, tokenizer):
    tokens, killed = 0, None
    with TandemClient(str(mesh.strict.address)) as client, pytest.raises(grpc.RpcError) as failed:
        for chunk in client.generate(token_ids=tokenizer.encode(PROMPT), **GREEDY, timeout=RPC_TIMEOUT_S):
            tokens += len(chunk.token_ids)
            if killed is None and tokens >= KILL_AFTER_TOKENS:
                killed = kill()
    assert killed is not None
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _migrations(mesh.strict) == 0
    assert_no_leaks(_survivors(mesh, killed))
