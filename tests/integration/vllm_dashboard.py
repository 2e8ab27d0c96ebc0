"""What vLLM's own Grafana dashboard asks of Prometheus: its
examples/observability/prometheus_grafana/grafana.json (formerly under examples/online_serving/) on
vLLM's main branch after vllm-project/vllm#55283, as docs.vllm.ai/en/latest published it on
2026-09-23. test_observability checks our /metrics serve every series it queries;
test_prometheus_server runs its latency and throughput queries on a real Prometheus server."""

from __future__ import annotations

# Every series the dashboard queries (each with model_name="$model_name").
DASHBOARD_HISTOGRAMS = (
    "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:time_to_first_token_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_max_num_generation_tokens",
)
DASHBOARD_SERIES = (
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:request_success_total",
    *(f"{name}{suffix}" for name in DASHBOARD_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")),
)

# Its TTFT, TPOT and token throughput panels' queries (P99 of each latency), with Grafana's variables.
DASHBOARD_QUERIES = {
    "ttft_p99": 'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket'
                '{model_name="$model_name"}[$__rate_interval])))',
    "tpot_p99": 'histogram_quantile(0.99, sum by(le) (rate(vllm:request_time_per_output_token_seconds_bucket'
                '{model_name="$model_name"}[$__rate_interval])))',
    "prompt_tokens_per_s": 'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    "generation_tokens_per_s": 'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
}


def dashboard_query(name: str, model_name: str, rate_interval: str) -> str:
    """The dashboard's query `name` as Grafana would send it for this model and rate interval."""
    return DASHBOARD_QUERIES[name].replace("$model_name", model_name).replace("$__rate_interval", rate_interval)
