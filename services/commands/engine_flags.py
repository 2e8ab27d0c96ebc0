"""The flags of every command that runs an engine, declared once as `EngineFlags`, and the
EngineConfig they describe."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import (
    ActivationQuantization,
    AttentionBackendName,
    CacheConfig,
    CpuWeightsOption,
    DTypeOption,
    EngineConfig,
    KVCacheDType,
    KVTierConfig,
    Quantization,
    Role,
    SchedulerConfig,
)
from engine.speculative.config import SpeculativeConfig
from engine.structured.config import StructuredOutputsConfig
from services.commands.lora_flags import LoraFlags, lora_config
from services.common.config_flags import flag
from services.repository.config import ModelVersion, load_repository

# One prompt of a few hundred tokens keeps a CPU core busy, so batching a second one into its step
# only delays the first one's first token (docs/benchmarks.md, "Decisions settled by experiments"). A GPU
# is far from saturated by a few prompts: there they batch up to the token budget.
CPU_PROMPT_BATCH_TOKENS = 256
_MIB = 1024 * 1024
_ENGINE = EngineConfig()
_CACHE = CacheConfig()
_SCHEDULER = SchedulerConfig()
_TIERS = KVTierConfig()


@dataclass(frozen=True)
class EngineFlags:
    """Model, device, formats, cache and batching: one field per flag, named after it
    (`--kv-cache-mib` is `kv_cache_mib`), as the command line gives them; `engine_config` turns
    them into the EngineConfig they describe."""

    model: str | None = flag(None, "GGUF file or HF directory (default: the shipped SmolLM2-135M)")
    model_repository: str | None = flag(
        None, "the deployment's model repository (services/repository): the worker serves the version "
        "--model-version or --pool names, in that version's formats", metavar="TOML")
    model_version: str | None = flag(None, "with --model-repository: the version to serve", metavar="NAME@VERSION")
    pool: str | None = flag(None, "with --model-repository: serve the version the repository assigns to this pool")
    device: str = flag(_ENGINE.device, "cpu or cuda[:N]")
    dtype: DTypeOption = flag(
        _ENGINE.dtype, "activations and arithmetic; auto (resolved at start-up, which the engine's log says): "
        "bfloat16 on a GPU (float16 before compute capability 8.0) and on a CPU with amx_bf16 or avx512_bf16, "
        "else float32")
    attention_backend: AttentionBackendName = flag(_ENGINE.attention_backend,
                                                   "attention kernels; auto: triton on a GPU, else torch")
    threads: int = flag(1, "torch CPU threads")
    cpu_weights: CpuWeightsOption = flag(
        _ENGINE.cpu_weights, "float32 on CPU: weights rounded to fp16 for a faster decode, exact (fp32, "
        "oneDNN-packed), or one plain copy; auto: fp16 when --dtype auto chose float32, fp32 when --dtype "
        "float32 was given (exact fp32 with --quantization none)")
    quantization: Quantization = flag(
        _ENGINE.quantization, "weight format (weight-only; activations in --dtype); auto: the file's own blocks "
        "where a kernel serves them, else none")
    activation_quantization: ActivationQuantization = flag(
        _ENGINE.activation_quantization, "int8: the products of integer-group weights quantize their inputs to "
        "int8 blocks of 32 (as llama.cpp does) for the CPU's VNNI dot products; int16: 15 bits a block as two "
        "int8 parts (bf16's accuracy, slower than int8); auto: int8 in bfloat16 on a CPU with avx512_vnni and "
        "no AMX, else none")
    kv_cache_dtype: KVCacheDType = flag(_ENGINE.kv_cache_dtype, "KV cache element format; auto: the model's dtype")
    kv_cache_mib: int = flag((_CACHE.memory_bytes or 0) // _MIB, "KV cache budget in MiB")
    kv_cache_blocks: int | None = flag(None, "explicit KV block count (overrides MiB)")
    block_size: int = flag(_CACHE.block_size, "tokens per KV cache block")
    kv_sliding_window: int | None = flag(
        _CACHE.sliding_window, "StreamingLLM on a full-attention model: each query attends to the last N positions "
        "(and the --kv-sink-tokens first); the blocks between are freed. Positions are those within the cache "
        "(N plus the sinks at most the model's context), so a conversation may outgrow the context up to "
        "--max-model-len. Refused for a model with its own sliding_window", metavar="N")
    kv_sink_tokens: int = flag(_CACHE.sink_tokens, "with --kv-sliding-window: the first tokens every query still "
                               "attends to (attention sinks), rounded up to whole blocks")
    kv_budget_tokens: int | None = flag(
        _CACHE.budget_tokens, "H2O/SnapKV eviction: once its prompt is computed, each request keeps at most N tokens "
        "of KV (whole blocks): its last --kv-budget-recent-tokens and the blocks its queries attended to most "
        "(a prompt's blocks first scored by its last queries); the rest are freed. Refused with "
        "--kv-sliding-window, speculative decoding, more than one process, or a model with its own sliding_window",
        metavar="N")
    kv_budget_recent_tokens: int | None = flag(
        _CACHE.budget_recent_tokens, "with --kv-budget-tokens: the recent positions always kept (default: half the "
        "budget)", metavar="N")
    kv_budget_observation_tokens: int = flag(
        _CACHE.budget_observation_tokens, "with --kv-budget-tokens: a prompt's last queries whose attention first "
        "scores its blocks (SnapKV's observation window)", metavar="N")
    max_num_seqs: int = flag(_SCHEDULER.max_num_seqs, "requests a step may run at once")
    max_num_batched_tokens: int = flag(_SCHEDULER.max_num_batched_tokens, "tokens a step may compute")
    max_prompt_batch_tokens: int | None = flag(
        None, "a step starts another prompt only while its prompt tokens stay within this; "
        f"0: no limit (default: {CPU_PROMPT_BATCH_TOKENS} on CPU, none on GPU)")
    max_model_len: int | None = flag(None, "longest prompt plus output (default and most: the model's context "
                                     "length; with --kv-sliding-window it may exceed it)")
    no_prefix_caching: bool = flag(False, "compute every prompt in full instead of reusing cached blocks")
    kv_host_tier: str | None = flag(
        None, "the node's KV host tier (`tandem kv-host-tier --socket PATH`): blocks the prefix cache computed are "
        "copied there in the background and a later prompt's prefix loads back from it, on any worker of the node",
        metavar="SOCKET")
    kv_disk_tier: str | None = flag(
        None, "a directory this worker keeps KV blocks in, below the host tier: bounded by --kv-disk-tier-mib, "
        "least recently used first, surviving restarts; every block is checked when read back", metavar="DIR")
    kv_disk_tier_mib: int = flag(_TIERS.disk_bytes // _MIB, "the disk tier's bound, MiB")
    tensor_parallel_size: int = flag(
        _ENGINE.tensor_parallel_size, "processes the model is split across (its heads, MLP features and "
        "vocabulary), each holding its shard of the weights and a KV cache of --kv-cache-mib; prefill and "
        "decode workers of different sizes exchange KV")
    enable_expert_parallel: bool = flag(
        _ENGINE.enable_expert_parallel, "a mixture-of-experts model's experts split whole over the "
        "--tensor-parallel-size ranks (EP size = TP size), each token's hidden state computed by its experts' "
        "ranks and summed back; attention stays tensor-parallel. Refused for a dense model, or experts the "
        "ranks do not divide")
    prefill_context_parallel_size: int = flag(
        _ENGINE.prefill_context_parallel_size, "processes (each holding the whole model) a long prompt's prefill "
        "is split across by sequence: a step computing one whole prompt of --prefill-context-parallel-min-tokens "
        "or more, nothing cached, gives each a contiguous slice of its tokens; the K/V of each layer are "
        "all-gathered and the pages kept by the worker's own process. Not with --tensor-parallel-size")
    prefill_context_parallel_min_tokens: int = flag(
        _ENGINE.prefill_context_parallel_min_tokens, "the shortest prompt --prefill-context-parallel-size splits "
        "(shorter ones run on one process: the gathers would cost more than the split saves)")
    pipeline_parallel_size: int = flag(
        _ENGINE.pipeline_parallel_size, "processes the decoder layers are split across in contiguous ranges "
        "(stages), each holding its layers' weights and KV blocks; a step's sequences pass through them in "
        "micro-batches so the stages overlap; with --tensor-parallel-size each stage is that many ranks (TP x PP "
        "processes). Prefill and decode workers of different sizes exchange KV. Not with "
        "--prefill-context-parallel-size")
    speculative_config: str | None = flag(
        None, "speculative decoding on decode and colocated workers, in vLLM's keys: "
        '\'{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
        '"disable_by_batch_size": 8}\' (those are the defaults of the keys left out); off when not given',
        metavar="JSON")
    structured_outputs_config: str | None = flag(
        None, "structured outputs, in vLLM's keys: '{\"backend\": \"auto\", \"disable_any_whitespace\": false}' "
        "(the defaults); backend auto or guidance is llguidance, vLLM's other backends are refused; give every "
        "worker of a deployment the same value", metavar="JSON")
    lora: LoraFlags = field(default_factory=LoraFlags)


def engine_config(flags: EngineFlags, role: Role) -> EngineConfig:
    """The EngineConfig those flags describe, with --model-repository the named version's model and
    formats in place of --model, --dtype, --quantization, --kv-cache-dtype and --max-model-len."""
    config = flags_engine_config(flags, role)
    version = repository_version(flags)
    return config if version is None else version.serving(config)


def flags_engine_config(flags: EngineFlags, role: Role) -> EngineConfig:
    """The EngineConfig of the flags alone, before a repository's version is applied to it."""
    return EngineConfig(
        model=flags.model,
        role=role,
        dtype=flags.dtype,
        device=flags.device,
        attention_backend=flags.attention_backend,
        max_model_len=flags.max_model_len,
        cpu_weights=flags.cpu_weights,
        quantization=flags.quantization,
        kv_cache_dtype=flags.kv_cache_dtype,
        activation_quantization=flags.activation_quantization,
        speculative=None if flags.speculative_config is None else SpeculativeConfig.from_json(flags.speculative_config),
        structured_outputs=StructuredOutputsConfig() if flags.structured_outputs_config is None else
        StructuredOutputsConfig.from_json(flags.structured_outputs_config),
        lora=lora_config(flags.lora),
        tensor_parallel_size=flags.tensor_parallel_size,
        enable_expert_parallel=flags.enable_expert_parallel,
        prefill_context_parallel_size=flags.prefill_context_parallel_size,
        prefill_context_parallel_min_tokens=flags.prefill_context_parallel_min_tokens,
        pipeline_parallel_size=flags.pipeline_parallel_size,
        cache=CacheConfig(
            block_size=flags.block_size,
            num_blocks=flags.kv_cache_blocks,
            memory_bytes=None if flags.kv_cache_blocks else flags.kv_cache_mib * _MIB,
            enable_prefix_caching=not flags.no_prefix_caching,
            sliding_window=flags.kv_sliding_window,
            sink_tokens=flags.kv_sink_tokens,
            budget_tokens=flags.kv_budget_tokens,
            budget_recent_tokens=flags.kv_budget_recent_tokens,
            budget_observation_tokens=flags.kv_budget_observation_tokens,
        ),
        kv_tiers=KVTierConfig(host_socket=flags.kv_host_tier, disk_dir=flags.kv_disk_tier,
                              disk_bytes=flags.kv_disk_tier_mib * _MIB),
        scheduler=SchedulerConfig(max_num_seqs=flags.max_num_seqs, max_num_batched_tokens=flags.max_num_batched_tokens,
                                  max_prompt_batch_tokens=_prompt_batch_tokens(flags)),
    )


def repository_version(flags: EngineFlags) -> ModelVersion | None:
    """The repository's version this worker serves (None without --model-repository); ValueError
    naming the flag that is missing or at odds."""
    if flags.model_repository is None:
        if flags.model_version is not None or flags.pool is not None:
            raise ValueError("--model-version/--pool: name the versions' file with --model-repository")
        return None
    if flags.model is not None:
        raise ValueError("--model: the repository's version names the model; give one or the other")
    if (flags.model_version is None) == (flags.pool is None):
        raise ValueError("--model-repository: give exactly one of --model-version NAME@VERSION and --pool NAME")
    repository = load_repository(flags.model_repository)
    if flags.model_version is not None:
        try:
            return repository.find(flags.model_version)
        except ValueError as error:
            raise ValueError(f"--model-version: {error}") from None
    return repository.for_pool(flags.pool)


def _prompt_batch_tokens(flags: EngineFlags) -> int | None:
    if flags.max_prompt_batch_tokens is None:
        return CPU_PROMPT_BATCH_TOKENS if flags.device == "cpu" else None
    return flags.max_prompt_batch_tokens or None
