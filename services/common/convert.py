"""Protobuf <-> engine conversions, used only at the edge of each gRPC handler.

Imports no torch (the gateway uses it too): engine outputs and stats are read by attribute, their
types are named for checkers only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from tandem.v1 import common_pb2, prefill_pb2

from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from services.common.chunk import Chunk, Timings, TokenLogprob, Usage
from services.common.step_model import StepModel

if TYPE_CHECKING:
    from engine.kv_cache.kv_events import EventBatch
    from engine.outputs import RequestOutput
    from engine.sampler import TokenLogprobs
    from services.common.worker import WorkerLoad

# What a proto field's zero value means when the engine's default differs from it.
_DEFAULT_MAX_TOKENS = SamplingParams.max_tokens

_FINISH_TO_PROTO = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {value: name for name, value in _FINISH_TO_PROTO.items()}


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a request's proto; unset fields take the engine defaults.

    Raises ValueError naming the field when a value is out of range.
    """
    return SamplingParams(
        max_tokens=msg.max_tokens or _DEFAULT_MAX_TOKENS,
        min_tokens=msg.min_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        structured=structured_from_proto(msg.structured) if msg.HasField("structured") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        prediction=tuple(msg.prediction),
        cache_salt=msg.cache_salt,
        lora_name=msg.lora_name,
    )


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    """The engine's StructuredOutput of a proto; ValueError naming the field."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("sampling.structured: set, but with no kind")
    if kind == "choice":
        text = json.dumps(list(msg.choice.choices))
    elif kind == "json_object":
        text = ""
    else:
        text = getattr(msg, kind)
    return StructuredOutput(kind, text, whitespace_flexible=not msg.disable_any_whitespace)


def structured_to_proto(spec: StructuredOutput) -> common_pb2.StructuredOutput:
    """The proto of an engine StructuredOutput."""
    msg = common_pb2.StructuredOutput(disable_any_whitespace=not spec.whitespace_flexible)
    if spec.kind == "choice":
        msg.choice.choices.extend(json.loads(spec.text))
    elif spec.kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, spec.kind, spec.text)
    return msg


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The proto of engine SamplingParams (every field set explicitly, so nothing depends on
    the receiver's defaults)."""
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        cache_salt=params.cache_salt,
        lora_name=params.lora_name,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(params.structured))
    msg.logit_bias.update(dict(params.logit_bias))
    msg.prediction.extend(params.prediction)
    return msg


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason.ValueType:
    """"stop"/"length"/"abort" -> the enum; None and "handoff" (not finished for the client) -> UNSPECIFIED."""
    return _FINISH_TO_PROTO.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_proto(value: common_pb2.FinishReason.ValueType) -> str | None:
    """The engine's finish reason string of the enum; None for UNSPECIFIED."""
    return _FINISH_FROM_PROTO.get(value)


def token_logprob_to_proto(logprobs: TokenLogprobs | TokenLogprob) -> common_pb2.TokenLogprob:
    """One generated token's logprob and top alternatives."""
    return common_pb2.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        top=[common_pb2.TopLogprob(token_id=token, logprob=lp) for token, lp in logprobs.top],
    )


def timings_to_proto(timings: Timings) -> common_pb2.Timings:
    """The wire form of a request's timings (field for field, by name)."""
    return common_pb2.Timings(**dataclasses.asdict(timings))


def timings_from_proto(msg: common_pb2.Timings) -> Timings:
    """A request's timings read off the wire (field for field, by name)."""
    return Timings(**{field.name: getattr(msg, field.name) for field in dataclasses.fields(Timings)})


def token_chunk(output: RequestOutput, timings: Timings | None = None) -> common_pb2.TokenChunk:
    """What one engine output adds to the client's stream; the final one carries finish reason,
    usage and (when given) timings."""
    chunk = common_pb2.TokenChunk(
        token_ids=output.new_token_ids,
        text=output.new_text,
        logprobs=[token_logprob_to_proto(lp) for lp in output.logprobs],
    )
    if output.finished:
        chunk.finish_reason = finish_reason_to_proto(output.finish_reason)
        chunk.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_output_tokens,
            cached_tokens=output.num_cached_tokens,
        ))
        if timings is not None:
            chunk.timings.CopyFrom(timings_to_proto(timings))
    return chunk


def chunk_from_proto(msg: common_pb2.TokenChunk, request_id: str) -> Chunk:
    """A relayed TokenChunk as plain data; usage and timings only where the message has them."""
    usage = msg.usage if msg.HasField("usage") else None
    return Chunk(
        request_id=request_id,
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        logprobs=tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
            for lp in msg.logprobs
        ),
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        usage=Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if usage else None,
        timings=timings_from_proto(msg.timings) if msg.HasField("timings") else None,
    )


def chunk_to_proto(chunk: Chunk) -> common_pb2.TokenChunk:
    """The TokenChunk message of a Chunk (the inverse of `chunk_from_proto`)."""
    msg = common_pb2.TokenChunk(
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=[token_logprob_to_proto(lp) for lp in chunk.logprobs],
        finish_reason=finish_reason_to_proto(chunk.finish_reason),
    )
    if chunk.usage is not None:
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=chunk.usage.prompt_tokens,
            completion_tokens=chunk.usage.completion_tokens,
            cached_tokens=chunk.usage.cached_tokens,
        ))
    if chunk.timings is not None:
        msg.timings.CopyFrom(timings_to_proto(chunk.timings))
    return msg


def load_report(load: WorkerLoad, events: EventBatch | None = None) -> common_pb2.LoadReport:
    """A worker's LoadReport, with the block `events` a load stream reads next (None: none, as a
    single GetLoad answer carries)."""
    stats = load.stats
    return common_pb2.LoadReport(
        worker_id=load.worker_id,
        role=load.role,
        queued_prompt_tokens=stats.num_waiting_tokens,
        running_requests=stats.num_running,
        waiting_requests=stats.num_waiting,
        free_kv_blocks=stats.num_free_blocks,
        total_kv_blocks=stats.num_total_blocks,
        block_size=stats.block_size,
        cached_kv_blocks=stats.num_cached_blocks,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        tpot_s=load.decode_step_s,
        reserved_requests=load.reserved_requests,
        # usage is a fraction of the total; round, since e.g. 0.3 * 10 is 2.999...
        used_kv_blocks=round(stats.kv_usage * stats.num_total_blocks),
        finished_requests=load.finished_requests,
        context_tokens=stats.num_context_tokens,
        step_model=step_model_to_proto(load.step_model),
        max_num_batched_tokens=stats.max_num_batched_tokens,
        kv_delivery_wait_s=load.kv_delivery_wait_s,
        dtype=load.formats.dtype,
        quantization=load.formats.quantization,
        cpu_weights=load.formats.cpu_weights,
        kv_cache_dtype=load.formats.kv_cache_dtype,
        activation_quantization=load.formats.activation_quantization,
        tensor_parallel_size=load.tensor_parallel_size,
        expert_parallel_size=load.expert_parallel_size,
        prefill_context_parallel_size=load.prefill_context_parallel_size,
        pipeline_parallel_size=load.pipeline_parallel_size,
        model_name=load.model_name,
        model_version=load.model_version,
        kv_layout=load.kv_layout,
        retiring_versions=load.retiring_versions,
        block_hash_salt=load.block_hash_salt,
        probe_block_hashes=load.probe_block_hashes,
        kv_events=[common_pb2.KVBlockEvent(tier=event.tier, stored=event.stored, block_hashes=event.block_hashes)
                   for event in (events.events if events is not None else ())],
        kv_events_reset=events is not None and events.reset,
        kv_load_s_per_block=load.kv_load_s_per_block,
        host_tier_id=load.host_tier_id,
        kv_events_seq=events.cursor if events is not None else load.kv_events_seq,
        lora_adapters=[common_pb2.LoraAdapterState(**dataclasses.asdict(state)) for state in stats.lora_adapters],
        max_loras=stats.max_loras,
    )


def step_model_to_proto(model: StepModel) -> common_pb2.StepModel:
    """A fitted step model as sent in load reports."""
    return common_pb2.StepModel(base_s=model.base_s, per_prompt_token_s=model.per_prompt_token_s,
                                per_sequence_s=model.per_sequence_s, per_context_token_s=model.per_context_token_s,
                                draft_rows_per_sequence=model.draft_rows_per_sequence,
                                tokens_per_decode_step=model.tokens_per_decode_step,
                                speculation_max_batch=model.speculation_max_batch)


def step_model_from_proto(message: common_pb2.StepModel) -> StepModel:
    """A reported step model."""
    return StepModel(message.base_s, message.per_prompt_token_s, message.per_sequence_s, message.per_context_token_s,
                     draft_rows_per_sequence=message.draft_rows_per_sequence,
                     tokens_per_decode_step=message.tokens_per_decode_step or 1.0,
                     speculation_max_batch=message.speculation_max_batch)


def kv_budget_to_proto(budget: KVBudget) -> prefill_pb2.KVBudget:
    """A decode worker's KV budget, for the prefill worker that picks the blocks it keeps."""
    return prefill_pb2.KVBudget(tokens=budget.tokens, recent_tokens=budget.recent_tokens,
                                observation_tokens=budget.observation_tokens)


def kv_budget_from_proto(msg: prefill_pb2.KVBudget, block_size: int) -> KVBudget:
    """The budget a request's pages are picked by, at the receiver's `block_size`; ValueError
    naming kv_budget if it keeps no block to choose."""
    try:
        return KVBudget(msg.tokens, msg.recent_tokens, block_size, msg.observation_tokens)
    except ValueError as error:
        raise ValueError(f"kv_budget: {error}") from None


def kept_blocks_from_proto(msg: prefill_pb2.PrefillResponse) -> KeptBlocks | None:
    """The blocks a prefill worker kept under the request's budget (None: it named none)."""
    if not msg.kept_blocks:
        return None
    return KeptBlocks(tuple(msg.kept_blocks), tuple(msg.kept_scores))
