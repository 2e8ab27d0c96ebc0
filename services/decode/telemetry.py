"""What one decode request leaves in the metrics (as its tokens stream) and in the trace (at its end,
from the timestamps the worker recorded)."""

from __future__ import annotations

from engine.outputs import RequestOutput
from services.common.worker_metrics import WorkerMetrics
from services.decode.worker import DecodeTimings
from services.observability.spans import add_event, add_span, set_attributes, tracing_active


class DecodeRecorder:
    """Feed it every output of one request (`output`), then call `trace` once it ended, however."""

    def __init__(self, metrics: WorkerMetrics, timings: DecodeTimings) -> None:
        self._metrics = metrics
        self._timings = timings
        self.first_at: float | None = None
        self._last_at = 0.0
        self._finished: RequestOutput | None = None

    def tpot_s(self, num_output_tokens: int) -> float:
        """Mean time per output token after the first, as of the last output."""
        if self.first_at is None or num_output_tokens < 2:
            return 0.0
        return (self._last_at - self.first_at) / (num_output_tokens - 1)

    def output(self, output: RequestOutput, now: float) -> None:
        """Account an output streamed at perf_counter time `now`."""
        metrics, timings = self._metrics, self._timings
        if self.first_at is None:
            self.first_at = now
            metrics.ttft.observe(now - timings.arrived_at)
        elif output.new_token_ids:
            metrics.output_gap(now - self._last_at, len(output.new_token_ids))
        self._last_at = now
        if not output.finished:
            return
        self._finished = output
        metrics.e2e.observe(now - timings.arrived_at)
        metrics.prompt_tokens.inc(output.num_prompt_tokens)
        metrics.generation_tokens.inc(output.num_output_tokens - timings.resumed_tokens)
        metrics.prefix_cache(output.num_prompt_tokens, timings.local_cached_tokens)
        metrics.succeeded(output.finish_reason or "abort")
        if timings.kv_done_at is not None and timings.joined_at is not None:
            # This worker's queue: from the prompt's KV being complete until the request joined the batch.
            metrics.queue_time.observe(timings.joined_at - timings.kv_done_at)

    def trace(self) -> None:
        """The request's stages as spans under the Decode RPC's span, and its figures on that span."""
        if not tracing_active():
            return
        timings = self._timings
        if timings.reserved_at is not None:
            add_span("decode.reserve", timings.arrived_at, timings.reserved_at,
                     {"tandem.decode.local_cached_tokens": timings.local_cached_tokens})
        if timings.prefill_replied_at is not None and timings.kv_done_at is not None:
            add_span("decode.kv_wait", timings.prefill_replied_at, timings.kv_done_at,
                     {"tandem.kv_wait_s": timings.kv_wait_s})
        if timings.kv_done_at is not None and timings.joined_at is not None:
            add_span("decode.batch_join", timings.kv_done_at, timings.joined_at)
        if self.first_at is None:
            return
        add_event("first_token", self.first_at)
        set_attributes({
            "tandem.ttft_s": self.first_at - timings.arrived_at,
            "tandem.prefill.queue_s": timings.prefill_queue_s,
            "tandem.prefill.compute_s": timings.prefill_compute_s,
            "tandem.kv_wait_s": timings.kv_wait_s,
        })
        output = self._finished
        if output is not None:
            add_event("finish", self._last_at, {"gen_ai.response.finish_reasons": [output.finish_reason or "abort"]})
            set_attributes({
                "gen_ai.usage.input_tokens": output.num_prompt_tokens,
                "gen_ai.usage.output_tokens": output.num_output_tokens,
                "tandem.tpot_s": self.tpot_s(output.num_output_tokens - timings.resumed_tokens),
                "tandem.e2e_s": self._last_at - timings.arrived_at,
            })
