"""What one decode request leaves in the metrics (as its stages pass and its tokens stream) and in the
trace (at its end, from the request's progress record)."""

from __future__ import annotations

from collections.abc import Mapping

from engine.outputs import RequestOutput
from services.common.failure import Failure, WorkerError
from services.common.worker_metrics import WorkerMetrics
from services.decode.progress import DecodeProgress, DecodeStage
from services.observability.spans import add_event, add_span, set_attributes, tracing_active

# A decode worker's objective (tandem:slo_requests) and refusal reason (tandem:requests_refused).
OBJECTIVES = ("tpot",)
NO_KV_ROOM = "no_kv_room"


class DecodeRecorder:
    """Hand it the request's `progress` record to update, feed it every output (`output`) and a
    failure (`failed`), then call `trace` once it ended, however."""

    def __init__(self, metrics: WorkerMetrics, arrived_at: float, resumed_tokens: int = 0,
                 parallel_sizes: Mapping[str, int] | None = None, tpot_objective_s: float | None = None) -> None:
        """`arrived_at`, `resumed_tokens`: as DecodeProgress's; `parallel_sizes`: the ranks the
        worker's model is split across (EngineConfig.parallel_sizes), for the trace;
        `tpot_objective_s`: the TPOT objective the gateway routed the request against (None: it sent
        none, and none is counted)."""
        self._metrics = metrics
        self.progress = DecodeProgress(arrived_at, resumed_tokens, on_enter=self._entered)
        self._parallel_sizes = dict(parallel_sizes or {})
        self._tpot_objective_s = tpot_objective_s
        self._admitted = False
        self._finished: RequestOutput | None = None

    def _entered(self, stage: DecodeStage) -> None:
        # Admitted once its KV has room: reserved for a prompt computed elsewhere, in the running
        # batch for one computed here (the engine queues it until then, never refusing it).
        if not self._admitted and stage in (DecodeStage.RESERVED, DecodeStage.DECODING):
            self._admitted = True
            self._metrics.admitted()

    def failed(self, error: Exception) -> None:
        """The request failed with `error`: counted as refused when this worker had no KV room for it."""
        if isinstance(error, WorkerError) and error.failure is Failure.NO_ROOM:
            self._metrics.refused(NO_KV_ROOM)

    def output(self, output: RequestOutput, now: float) -> None:
        """Account an output streamed at perf_counter time `now` (and stamp it on the progress record)."""
        metrics, progress = self._metrics, self.progress
        if progress.first_token_at is None:
            metrics.ttft.observe(now - progress.arrived_at)
        elif output.new_token_ids and progress.last_token_at is not None:
            metrics.output_gap(now - progress.last_token_at, len(output.new_token_ids))
        progress.streamed(now)
        if not output.finished:
            return
        self._finished = output
        metrics.e2e.observe(now - progress.arrived_at)
        metrics.prompt_tokens.inc(output.num_prompt_tokens)
        metrics.generation_tokens.inc(output.num_output_tokens - progress.resumed_tokens)
        metrics.prefix_cache(output.num_prompt_tokens, progress.local_cached_tokens)
        metrics.succeeded(output.finish_reason or "abort")
        metrics.served()
        if self._tpot_objective_s is not None:
            tpot_s = progress.tpot_s(output.num_output_tokens - progress.resumed_tokens)
            metrics.slo("tpot", tpot_s <= self._tpot_objective_s)
        joining, joined = progress.began(DecodeStage.JOINING), progress.began(DecodeStage.DECODING)
        if joining is not None and joined is not None:
            # This worker's queue: from the prompt's KV being complete until the request joined the batch.
            metrics.queue_time.observe(joined - joining)

    def trace(self) -> None:
        """The request's stages as spans under the Decode RPC's span, and its figures on that span."""
        if not tracing_active():
            return
        progress = self.progress
        set_attributes({f"tandem.{name}": size for name, size in self._parallel_sizes.items()})
        reserved = progress.began(DecodeStage.RESERVED)
        if reserved is not None:
            add_span("decode.reserve", progress.arrived_at, reserved,
                     {"tandem.decode.local_cached_tokens": progress.local_cached_tokens})
        replied, complete = progress.began(DecodeStage.TRANSFERRING), progress.began(DecodeStage.JOINING)
        kv_wait_s = progress.between(DecodeStage.TRANSFERRING, DecodeStage.JOINING)
        if replied is not None and complete is not None:
            add_span("decode.kv_wait", replied, complete, {"tandem.kv_wait_s": kv_wait_s})
        joined = progress.began(DecodeStage.DECODING)
        if complete is not None and joined is not None:
            add_span("decode.batch_join", complete, joined)
        first = progress.first_token_at
        if first is None:
            return
        add_event("first_token", first)
        queue_s, compute_s = progress.prefill_s()
        set_attributes({
            "tandem.ttft_s": first - progress.arrived_at,
            "tandem.prefill.queue_s": queue_s,
            "tandem.prefill.compute_s": compute_s,
            "tandem.kv_wait_s": kv_wait_s,
        })
        output = self._finished
        if output is not None and progress.last_token_at is not None:
            add_event("finish", progress.last_token_at,
                      {"gen_ai.response.finish_reasons": [output.finish_reason or "abort"]})
            set_attributes({
                "gen_ai.usage.input_tokens": output.num_prompt_tokens,
                "gen_ai.usage.output_tokens": output.num_output_tokens,
                "tandem.tpot_s": progress.tpot_s(output.num_output_tokens - progress.resumed_tokens),
                "tandem.e2e_s": progress.last_token_at - progress.arrived_at,
            })
            if output.num_draft_tokens:
                set_attributes({
                    "tandem.spec_decode.draft_tokens": output.num_draft_tokens,
                    "tandem.spec_decode.accepted_tokens": output.num_accepted_tokens,
                    "tandem.spec_decode.acceptance_rate": output.num_accepted_tokens / output.num_draft_tokens,
                })
