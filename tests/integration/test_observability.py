"""Traces and metrics of a real mesh (a gateway, a prefill and a decode worker as processes, the KV
over the gRPC backend so that its Handshake and Push are traced too), exported to a real OTLP
receiver inside the test and scraped over HTTP."""

from __future__ import annotations

import json
import urllib.request
import uuid

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from vllm_dashboard import DASHBOARD_SERIES

from harness.otlp_receiver import OtlpReceiver, ReceivedSpan
from harness.ports import free_port
from harness.worker import WorkerProcess, start_worker
from services.common.server import channel_options

MODEL = "SmolLM2-135M-Instruct"
# The labels of a model served without a repository: its name, and no version.
SERVED = frozenset({"model_name": MODEL, "model_version": ""}.items())
NUM_LAYERS = 30  # SmolLM2-135M
SPANS_TIMEOUT_S = 60.0  # generous bound for the exporters' batches to arrive; no test asserts timing
RPC_TIMEOUT_S = 300.0
WORKER_FLAGS = ["--threads", "1", "--kv-cache-mib", "64"]
# The decode worker speculates (n-gram drafts, whatever the batch).
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None, "gate": "off"}
# Every span one request must leave, by service.
EXPECTED = {
    "tandem-gateway": {"/tandem.v1.Gateway/Generate", "route", "/tandem.v1.Decode/Generate"},
    "tandem-decode": {"/tandem.v1.Decode/Generate", "decode.reserve", "/tandem.v1.Prefill/Prefill", "decode.kv_wait",
                      "decode.batch_join", "/tandem.v1.KVTransfer/Push"},
    "tandem-prefill": {"/tandem.v1.Prefill/Prefill", "prefill.queue", "prefill.compute", "kv.transfer",
                       "/tandem.v1.KVTransfer/Push"},
}

@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def mesh(receiver):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        # A shared environment's name for everything; each process still names itself.
        "OTEL_SERVICE_NAME": "everything",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
    }
    prefill_port, decode_port = free_port(), free_port()
    args = [
        ["prefill", "--port", str(prefill_port), *WORKER_FLAGS],
        ["decode", "--port", str(decode_port), "--kv-backend", "grpc", *WORKER_FLAGS,
         "--speculative-config", json.dumps(SPECULATION)],
        ["gateway", "--port", "0", "--http-port", "0", "--prefill", f"127.0.0.1:{prefill_port}",
         "--decode", f"127.0.0.1:{decode_port}", "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"],
    ]
    processes = [start_worker(a, wait=False, env=env) for a in args]
    try:
        for process in processes:
            process.wait_ready()
        yield dict(zip(("prefill", "decode", "gateway"), processes, strict=True))
    finally:
        codes = {p.args[0]: p.stop() for p in reversed(processes)}
    assert all(code == 0 for code in codes.values()), codes


def _generate(gateway: WorkerProcess, request_id: str, metadata=(), slo=None) -> list[common_pb2.TokenChunk]:
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, text=f"Tell me about trace {request_id}.",
        sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), slo=slo,
    )
    with grpc.insecure_channel(gateway.address, options=channel_options()) as channel:
        stream = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=RPC_TIMEOUT_S, metadata=metadata)
        return [response.chunk for response in stream]


def _request_trace(receiver: OtlpReceiver, request_id: str) -> list[ReceivedSpan]:
    """Every span of the trace whose gateway span carries this request id, once all expected arrived."""

    def trace_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        roots = [s for s in spans if s.attributes.get("tandem.request_id") == request_id]
        return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {(s.service, s.name) for s in trace_of(spans)}
        return all((service, name) in names for service, expected in EXPECTED.items() for name in expected)

    return trace_of(receiver.wait_for(complete, SPANS_TIMEOUT_S))


def _one(spans: list[ReceivedSpan], service: str, name: str, server: bool | None = None) -> ReceivedSpan:
    [span] = [s for s in spans if s.service == service and s.name == name and (server is None or s.is_server == server)]
    return span


def test_one_trace_across_gateway_prefill_and_decode(mesh, receiver):
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    chunks = _generate(mesh["gateway"], request_id)
    usage = chunks[-1].usage
    spans = _request_trace(receiver, request_id)
    for service, names in EXPECTED.items():
        assert names <= {s.name for s in spans if s.service == service}, (service, sorted(s.name for s in spans))

    # The parent chain crosses the three processes.
    gateway = _one(spans, "tandem-gateway", "/tandem.v1.Gateway/Generate", server=True)
    to_decode = _one(spans, "tandem-gateway", "/tandem.v1.Decode/Generate")
    decode = _one(spans, "tandem-decode", "/tandem.v1.Decode/Generate", server=True)
    to_prefill = _one(spans, "tandem-decode", "/tandem.v1.Prefill/Prefill", server=False)
    prefill = _one(spans, "tandem-prefill", "/tandem.v1.Prefill/Prefill", server=True)
    push = _one(spans, "tandem-prefill", "/tandem.v1.KVTransfer/Push", server=False)
    pushed = _one(spans, "tandem-decode", "/tandem.v1.KVTransfer/Push", server=True)
    assert gateway.parent_span_id == ""  # the client sent no trace context
    assert to_decode.is_client and to_decode.parent_span_id == gateway.span_id
    assert decode.parent_span_id == to_decode.span_id
    assert to_prefill.is_client and to_prefill.parent_span_id == decode.span_id
    assert prefill.parent_span_id == to_prefill.span_id
    assert push.is_client and push.parent_span_id == prefill.span_id
    assert pushed.parent_span_id == push.span_id
    for name in ("decode.reserve", "decode.kv_wait", "decode.batch_join"):
        assert _one(spans, "tandem-decode", name).parent_span_id == decode.span_id
    assert decode.attributes["tandem.tensor_parallel_size"] == prefill.attributes["tandem.tensor_parallel_size"] == 1
    for name in ("prefill.queue", "prefill.compute", "kv.transfer"):
        assert _one(spans, "tandem-prefill", name).parent_span_id == prefill.span_id
    assert _one(spans, "tandem-gateway", "route").parent_span_id == gateway.span_id

    # The gateway's request span: GenAI attributes equal to what the client got.
    attributes = gateway.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == 1.0
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["tandem.ttft_s"] > 0 and attributes["tandem.tpot_s"] > 0
    assert attributes["tandem.decode.address"] == mesh["decode"].address
    assert attributes["tandem.prefill.address"] == mesh["prefill"].address
    assert not any(key.startswith("gen_ai.input") or key.startswith("gen_ai.output") for key in attributes)
    assert [name for name, _ in gateway.events] == ["dispatch", "first_token", "finish"]
    route = _one(spans, "tandem-gateway", "route").attributes
    # The router's decision and why: its choice, its predictions against the objectives, the options.
    assert (route["tandem.route.decode"], route["tandem.route.prefill"]) == (mesh["decode"].address,
                                                                           mesh["prefill"].address)
    assert route["tandem.route.meets_slo"] is True
    assert route["tandem.route.predicted_ttft_s"] > 0 and route["tandem.route.slo_ttft_s"] > 0
    assert route["tandem.route.options"][0].startswith(f"prefill {mesh['prefill'].address} -> decode")

    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    assert [name for name, _ in decode.events] == ["first_token", "finish"]
    compute = _one(spans, "tandem-prefill", "prefill.compute").attributes
    assert compute["tandem.prefill.computed_tokens"] + compute["tandem.prefill.cached_tokens"] == usage.prompt_tokens
    transfer = _one(spans, "tandem-prefill", "kv.transfer")
    assert transfer.attributes["tandem.kv.backend"] == "grpc" and transfer.attributes["tandem.kv.bytes"] > 0
    layers = [event["tandem.kv.layer"] for name, event in transfer.events if name == "kv.layer_queued"]
    assert sorted(set(layers)) == list(range(NUM_LAYERS))
    assert all(s.status_code != 2 for s in spans), [s.name for s in spans if s.status_code == 2]


def test_kv_handshake_carries_the_trace(mesh, receiver):
    _generate(mesh["gateway"], f"handshake-{uuid.uuid4().hex[:8]}")
    # Sent once per channel, by whichever request opened it: that request's trace holds both ends.
    spans = receiver.wait_for(lambda spans: any(s.name == "/tandem.v1.KVTransfer/Handshake" for s in spans),
                              SPANS_TIMEOUT_S)
    sent = _one(spans, "tandem-prefill", "/tandem.v1.KVTransfer/Handshake", server=False)
    received = _one(spans, "tandem-decode", "/tandem.v1.KVTransfer/Handshake", server=True)
    assert received.parent_span_id == sent.span_id and received.trace_id == sent.trace_id
    prefill = [s for s in spans if s.span_id == sent.parent_span_id]
    assert [(s.service, s.name) for s in prefill] == [("tandem-prefill", "/tandem.v1.Prefill/Prefill")]


def test_client_traceparent_is_honoured(mesh, receiver):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    request_id = f"continued-{uuid.uuid4().hex[:8]}"
    _generate(mesh["gateway"], request_id, metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")])
    spans = _request_trace(receiver, request_id)
    gateway = _one(spans, "tandem-gateway", "/tandem.v1.Gateway/Generate", server=True)
    assert gateway.trace_id == trace_id and gateway.parent_span_id == parent_id
    assert {s.service for s in spans} == set(EXPECTED)


def test_an_http_request_continues_the_clients_trace(mesh, receiver):
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()
    http = urllib.request.Request(f"http://{mesh['gateway'].http_address}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent_id}-01"})
    with urllib.request.urlopen(http, timeout=RPC_TIMEOUT_S) as response:
        usage = json.load(response)["usage"]

    def traced(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.trace_id == trace_id]

    def servers(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        # The gateway's HTTP server span, exported once the response has ended (after its children).
        return [s for s in traced(spans) if s.service == "tandem-gateway" and s.parent_span_id == parent_id]

    spans = receiver.wait_for(lambda all_spans: {s.service for s in traced(all_spans)} == set(EXPECTED)
                              and servers(all_spans), SPANS_TIMEOUT_S)
    [server] = servers(spans)
    assert server.is_server
    assert server.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4


def _invalid_request(gateway: WorkerProcess) -> str:
    """Send a request the gateway refuses (INVALID_ARGUMENT); its id."""
    request = gateway_pb2.GenerateRequest(request_id=f"bad-{uuid.uuid4().hex[:8]}", text="Hi",
                                          sampling=common_pb2.SamplingParams(temperature=500.0))
    with grpc.insecure_channel(gateway.address) as channel, pytest.raises(grpc.RpcError) as error:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=RPC_TIMEOUT_S))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return request.request_id


def test_errors_mark_the_span(mesh, receiver):
    request_id = _invalid_request(mesh["gateway"])
    [span] = [s for s in receiver.wait_for(
        lambda spans: any(s.attributes.get("tandem.request_id") == request_id for s in spans), SPANS_TIMEOUT_S,
    ) if s.attributes.get("tandem.request_id") == request_id]
    assert span.status_code == 2 and span.attributes["error.type"] == "INVALID_ARGUMENT"

    # A worker's RPC too: a decode request with a token id outside the vocabulary.
    request = decode_pb2.DecodeRequest(request_id=f"bad-{uuid.uuid4().hex[:8]}", prompt_token_ids=[1, 2, 10**9])
    with grpc.insecure_channel(mesh["decode"].address) as channel, pytest.raises(grpc.RpcError):
        list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=RPC_TIMEOUT_S))

    def refused(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.service == "tandem-decode" and s.is_server and s.status_code == 2]

    [span] = refused(receiver.wait_for(refused, SPANS_TIMEOUT_S))
    assert span.attributes["error.type"] == "INVALID_ARGUMENT" and span.parent_span_id == ""


def _scrape(worker: WorkerProcess) -> dict[tuple[str, frozenset], float]:
    """Every sample of a process's /metrics: (name, labels) -> value."""
    # Workers serve metrics on their own port, the gateway at /metrics of its HTTP API.
    address = worker.metrics_address or worker.http_address
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset({"model_name": MODEL, "model_version": "", **labels}.items()))
    return after[key] - before.get(key, 0.0)


def test_metrics_count_a_request(mesh):
    before = {role: _scrape(mesh[role]) for role in ("gateway", "prefill", "decode")}
    # A TTFT objective of an hour is met; a TPOT of 1 ms is not, on a CPU.
    chunks = _generate(mesh["gateway"], f"counted-{uuid.uuid4().hex[:8]}",
                       slo=common_pb2.Slo(ttft_ms=3_600_000, tpot_ms=1))
    usage = chunks[-1].usage
    _invalid_request(mesh["gateway"])
    after = {role: _scrape(mesh[role]) for role in ("gateway", "prefill", "decode")}

    for role in ("gateway", "decode"):
        assert _delta(before[role], after[role], "vllm:request_success_total", finished_reason="length") == 1, role
        assert _delta(before[role], after[role], "vllm:prompt_tokens_total") == usage.prompt_tokens, role
        assert _delta(before[role], after[role], "vllm:generation_tokens_total") == 6, role
        assert _delta(before[role], after[role], "vllm:time_to_first_token_seconds_count") == 1, role
        assert _delta(before[role], after[role], "vllm:e2e_request_latency_seconds_count") == 1, role
        assert _delta(before[role], after[role], "vllm:inter_token_latency_seconds_count") == 5, role
    gateway, prefill, decode = after["gateway"], after["prefill"], after["decode"]
    assert _delta(before["prefill"], prefill, "vllm:prompt_tokens_total") == usage.prompt_tokens
    assert _delta(before["prefill"], prefill, "vllm:request_queue_time_seconds_count") == 1
    assert _delta(before["prefill"], prefill, "tandem:kv_transfer_bytes_total", backend="grpc") > 0
    assert _delta(before["prefill"], prefill, "tandem:kv_transfer_seconds_count", backend="grpc") == 1
    assert _delta(before["gateway"], gateway, "tandem:routing_decisions_total", pool="decode",
                  worker=mesh["decode"].address) == 1
    assert _delta(before["gateway"], gateway, "tandem:request_rejections_total", code="INVALID_ARGUMENT") == 1
    assert _delta(before["gateway"], gateway, "tandem:slo_requests_total", objective="ttft", attained="true") == 1
    assert _delta(before["gateway"], gateway, "tandem:slo_requests_total", objective="tpot", attained="false") == 1
    assert _delta(before["gateway"], gateway, "tandem:slo_requests_total", objective="both", attained="false") == 1
    for role in ("gateway", "decode"):
        assert _delta(before[role], after[role], "tandem:requests_admitted_total") == 1, role
        assert _delta(before[role], after[role], "tandem:requests_served_total") == 1, role
    # The decode worker's TPOT by its own clock, against the objective the gateway sent it with.
    assert _delta(before["decode"], decode, "tandem:slo_requests_total", objective="tpot", attained="false") == 1
    # vLLM's per-request shapes and phases, at the gateway (one completion: n is 1).
    assert _delta(before["gateway"], gateway, "vllm:request_prompt_tokens_sum") == usage.prompt_tokens
    for histogram in ("vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                      "vllm:request_max_num_generation_tokens"):
        assert _delta(before["gateway"], gateway, f"{histogram}_sum") == 6, histogram
    assert _delta(before["gateway"], gateway, "vllm:request_params_n_sum") == 1
    for phase in ("prefill", "decode", "inference"):
        assert _delta(before["gateway"], gateway, f"vllm:request_{phase}_time_seconds_count") == 1, phase
    assert _delta(before["gateway"], gateway, "vllm:request_time_per_output_token_seconds_count") == 1
    # Each worker's engine steps: the decode worker computed at least the 5 tokens after the first.
    for worker in ("prefill", "decode"):
        assert _delta(before[worker], after[worker], "vllm:iteration_tokens_total_count") > 0, worker
        assert after[worker][("vllm:num_preemptions_total", SERVED)] == 0, worker
    assert _delta(before["decode"], decode, "vllm:iteration_tokens_total_sum") >= 5
    # Engine state, read when scraped: nothing runs now.
    for worker in (prefill, decode):
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                      "tandem:prefill_queued_tokens"):
            assert worker[(gauge, SERVED)] == 0, gauge
    assert decode[("tandem:kv_reserved_requests", SERVED)] == 0
    for worker in (prefill, decode):
        assert worker[("tandem:tensor_parallel_size", SERVED)] == 1
    assert not any(name == "tandem:kv_reserved_requests" for name, _ in prefill)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert gateway[(gauge, SERVED)] == 0, gauge
    # Both workers routable, each under its role.
    for role in ("prefill", "decode"):
        labels = SERVED | {("role", role), ("worker", mesh[role].address)}
        assert gateway[("tandem:worker_routable", labels)] == 1, role
    # No NVML on this machine: no GPU metrics at all.
    assert not any(name.startswith("tandem:gpu_") for name, _ in (*prefill, *decode))


def test_every_series_of_vllms_dashboard_is_served(mesh):
    before = _scrape(mesh["gateway"])
    # Over HTTP, two choices of one prompt: vLLM's parent request, counted once with n=2.
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "n": 2, "seed": 1}).encode()
    http = urllib.request.Request(f"http://{mesh['gateway'].http_address}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(http, timeout=RPC_TIMEOUT_S) as response:
        assert len(json.load(response)["choices"]) == 2
    scraped = [_scrape(mesh[role]) for role in ("gateway", "prefill", "decode")]
    served = {name for samples in scraped for name, labels in samples if ("model_name", MODEL) in labels}
    assert [name for name in DASHBOARD_SERIES if name not in served] == []
    gateway = scraped[0]
    assert _delta(before, gateway, "vllm:request_params_n_count") == 1
    assert _delta(before, gateway, "vllm:request_params_n_sum") == 2
    assert _delta(before, gateway, "vllm:request_max_num_generation_tokens_count") == 1
    assert _delta(before, gateway, "vllm:request_prompt_tokens_count") == 2


def test_speculation_is_counted_and_traced(mesh, receiver):
    before = _scrape(mesh["decode"])
    request_id = f"copied-{uuid.uuid4().hex[:8]}"
    passage = "The quick brown fox jumps over the lazy dog, and the dog sleeps on in the warm afternoon sun."
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, text=f"Repeat exactly: {passage}\nRepeated: {passage[:20]}",
        sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(mesh["gateway"].address, options=channel_options()) as channel:
        chunks = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=RPC_TIMEOUT_S))
    assert sum(len(response.chunk.token_ids) for response in chunks) == 16
    after = _scrape(mesh["decode"])
    drafts = _delta(before, after, "vllm:spec_decode_num_drafts_total")
    draft_tokens = _delta(before, after, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= draft_tokens <= 3 * drafts and 0 < accepted <= draft_tokens
    per_position = [_delta(before, after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(3)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)

    decode = _one(_request_trace(receiver, request_id), "tandem-decode", "/tandem.v1.Decode/Generate", server=True)
    attributes = decode.attributes
    assert attributes["tandem.spec_decode.draft_tokens"] >= attributes["tandem.spec_decode.accepted_tokens"] > 0
    assert 0 < attributes["tandem.spec_decode.acceptance_rate"] <= 1
