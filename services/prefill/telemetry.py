"""What a finished prefill leaves in the trace and the metrics, built from its recorded timestamps."""

from __future__ import annotations

from collections.abc import Mapping

from services.common.prefill_site import PrefillResult
from services.common.worker_metrics import WorkerMetrics
from services.observability.spans import add_span, set_attributes, tracing_active


def record_prefill(result: PrefillResult, metrics: WorkerMetrics, parallel_sizes: Mapping[str, int]) -> None:
    """Metrics of one delivered prefill, and (when traced) its queue, compute and transfer spans as
    children of the Prefill RPC's span, which says the ranks the worker's model is split across
    (`parallel_sizes`: EngineConfig.parallel_sizes)."""
    output = result.output
    prompt_tokens, cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.prefix_cache(prompt_tokens, cached_tokens)
    metrics.queue_time.observe(result.queue_s)
    metrics.ttft.observe(result.done_at - result.added_at)
    metrics.kv_transfer(result.backend, result.kv_bytes, result.transfer_s)
    if not tracing_active():
        return
    set_attributes({
        "gen_ai.usage.input_tokens": prompt_tokens,
        "tandem.prefill.queue_s": result.queue_s,
        "tandem.prefill.compute_s": result.compute_s,
        "tandem.kv.transfer_s": result.transfer_s,
        **{f"tandem.{name}": size for name, size in parallel_sizes.items()},
    })
    add_span("prefill.queue", result.added_at, result.started_at, {"tandem.queue_s": result.queue_s})
    add_span("prefill.compute", result.started_at, result.done_at, {
        "tandem.prefill.computed_tokens": prompt_tokens - cached_tokens,
        "tandem.prefill.cached_tokens": cached_tokens,
    })
    add_span(
        "kv.transfer", result.started_at, result.delivered_at,
        {"tandem.kv.backend": result.backend, "tandem.kv.bytes": result.kv_bytes,
         "tandem.kv.transfer_s": result.transfer_s},
        events=[("kv.layer_queued", at, {"tandem.kv.layer": layer, "tandem.kv.bytes": num_bytes})
                for layer, at, num_bytes in result.layers],
    )
