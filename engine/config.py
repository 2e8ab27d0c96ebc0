"""Frozen, validated configuration for the engine.

Every knob lives here; the CLI only translates flags into these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.model.paths import served_model_id
from engine.speculative.config import FLAG as SPECULATIVE_FLAG
from engine.speculative.config import SpeculativeConfig
from engine.structured.config import StructuredOutputsConfig

Role = Literal["colocated", "prefill", "decode"]
DType = Literal["float32", "bfloat16", "float16"]
# What --dtype takes: a dtype, or "auto", which the engine resolves from the hardware at start-up.
DTypeOption = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "triton"]
CpuWeights = Literal["fp16", "fp32", "plain"]
CpuWeightsOption = Literal["auto", "fp16", "fp32", "plain"]
# vLLM's flag names and values. "auto" quantization: the file's own blocks where a kernel serves them,
# else none; "auto" KV cache dtype: the model's dtype.
Quantization = Literal["auto", "none", "gguf", "int8", "gptq", "awq"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "int8", "int4"]
# Tandem's own: whether the products of integer-group weights quantize their activations to int8
# (engine.model.int8_activations): "int8" one byte per activation, "int16" 15 bits as two int8 parts;
# "auto" int8 where a CPU's kernels multiply int8 faster than bf16.
ActivationQuantization = Literal["auto", "none", "int8", "int16"]


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {message}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF configs describe it (`rope_scaling`)."""

    rope_type: Literal["default", "linear", "dynamic", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _require(self.factor >= 1.0, "rope_scaling.factor", f"must be >= 1, got {self.factor}")
        _require(
            self.high_freq_factor > self.low_freq_factor,
            "rope_scaling.high_freq_factor",
            "must exceed low_freq_factor",
        )


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): each token's `top_k` experts of
    `num_experts` by the router's softmax, their SwiGLU outputs summed by those probabilities
    (renormalised over the top k where `normalize_top_k`), plus, for Qwen2-MoE, a shared expert of
    `shared_intermediate_size` features always run and scaled by sigmoid(its gate) where `shared_gate`.

    A rank's shard holds the experts `experts_held` (a range of ids: all of them, or its share under
    expert parallelism), each with `intermediate_size` features (its share under tensor parallelism).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False
    experts_held: tuple[int, int] | None = None  # [first, last) held here; None: every expert

    @property
    def held(self) -> range:
        """The ids of the experts this shard computes."""
        first, last = self.experts_held or (0, self.num_experts)
        return range(first, last)

    def __post_init__(self) -> None:
        _require(self.num_experts > 0, "num_experts", f"must be positive, got {self.num_experts}")
        _require(0 < self.top_k <= self.num_experts, "num_experts_per_tok",
                 f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        _require(self.intermediate_size > 0, "moe_intermediate_size", f"must be positive, got {self.intermediate_size}")
        _require(self.shared_intermediate_size >= 0, "shared_expert_intermediate_size",
                 f"must not be negative, got {self.shared_intermediate_size}")


@dataclass(frozen=True)
class PipelineStage:
    """The layers one pipeline stage holds: its ModelConfig.num_layers from `first_layer` on, of the
    model's `model_layers`."""

    first_layer: int
    model_layers: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2 with QKV bias, Qwen3 with
    per-head q/k norms), its MLP dense or a mixture of experts (`moe`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before the rotary embedding
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    architecture: str = "LlamaForCausalLM"  # the HF class name it was read as, for load reports
    stage: PipelineStage | None = None  # a pipeline stage's part of the layers; None: all of them
    # Mistral-style: each query attends to the last `sliding_window` positions only (itself included).
    sliding_window: int | None = None

    @property
    def first_layer(self) -> int:
        """The model's index of this config's first layer (0 but for a later pipeline stage)."""
        return 0 if self.stage is None else self.stage.first_layer

    @property
    def first_stage(self) -> bool:
        """Whether the layers start at the model's first (the stage embeds the tokens)."""
        return self.first_layer == 0

    @property
    def last_stage(self) -> bool:
        """Whether the layers end at the model's last (the stage computes the logits)."""
        return self.stage is None or self.first_layer + self.num_layers == self.stage.model_layers

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"{self.num_kv_heads} must divide num_heads={self.num_heads}",
        )
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        _require(self.rope_theta > 0, "rope_theta", "must be positive")
        if self.sliding_window is not None:
            _require(self.sliding_window > 0, "sliding_window", f"must be positive, got {self.sliding_window}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks, sized by an explicit count or a memory budget."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    # StreamingLLM on a full-attention model: each query attends to the last `sliding_window`
    # positions and the first `sink_tokens` (rounded up to whole blocks); the blocks between are
    # freed. Positions are those within the cache (keys are cached unrotated), so a request may
    # outgrow the model's context up to EngineConfig.max_model_len (engine.attention.streaming).
    sliding_window: int | None = None
    sink_tokens: int = 0
    # H2O/SnapKV on a full-attention model: each request keeps at most `budget_tokens` of KV (whole
    # blocks) once its prompt is computed, its last `budget_recent_tokens` (None: half the budget)
    # and the blocks its queries attended to most, a prompt's scored by its last
    # `budget_observation_tokens` queries; the rest are freed (engine.kv_cache.kv_budget).
    budget_tokens: int | None = None
    budget_recent_tokens: int | None = None
    budget_observation_tokens: int = 16

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block_size", f"must be positive, got {self.block_size}")
        if self.budget_tokens is not None:
            _require(self.budget_tokens > 0, "kv_budget_tokens", f"must be positive, got {self.budget_tokens}")
            _require(self.sliding_window is None, "kv_budget_tokens", "is not served with kv_sliding_window")
        _require(self.budget_recent_tokens is None or self.budget_tokens is not None, "kv_budget_recent_tokens",
                 "applies only with kv_budget_tokens")
        _require(self.budget_observation_tokens >= 1, "kv_budget_observation_tokens",
                 f"must be at least 1, got {self.budget_observation_tokens}")
        if self.sliding_window is not None:
            _require(self.sliding_window > 0, "kv_sliding_window", f"must be positive, got {self.sliding_window}")
        _require(self.sink_tokens >= 0, "kv_sink_tokens", f"must not be negative, got {self.sink_tokens}")
        _require(self.sink_tokens == 0 or self.sliding_window is not None, "kv_sink_tokens",
                 "applies only with kv_sliding_window")
        _require(
            self.num_blocks is not None or self.memory_bytes is not None,
            "num_blocks",
            "set num_blocks or memory_bytes",
        )
        if self.num_blocks is not None:
            _require(self.num_blocks > 0, "num_blocks", f"must be positive, got {self.num_blocks}")
        if self.memory_bytes is not None:
            _require(self.memory_bytes > 0, "memory_bytes", "must be positive")


@dataclass(frozen=True)
class KVTierConfig:
    """KV tiers below the worker's memory (engine.kv_tiers): blocks the prefix cache computed are
    written to them in the background and loaded back on a later prompt's hit. Off unless named."""

    # The node's host tier owner's Unix socket (`tandem kv-host-tier`), shared by the node's workers.
    host_socket: str | None = None
    # A directory this worker alone keeps blocks in, surviving restarts, bounded by `disk_bytes`.
    disk_dir: str | None = None
    disk_bytes: int = 4 * 1024**3

    @property
    def enabled(self) -> bool:
        """Whether any lower tier is configured."""
        return self.host_socket is not None or self.disk_dir is not None

    def __post_init__(self) -> None:
        _require(self.disk_bytes > 0, "kv_disk_tier_mib", f"must be positive, got {self.disk_bytes} bytes")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served over the base (engine.lora), vLLM's knobs: up to `max_loras` adapters
    in one step, each of rank at most `max_lora_rank`, and up to `max_cpu_loras` (None: as many as
    `max_loras`) read and kept in memory, the least recently used idle one dropped beyond.
    `modules`: (name, directory) of the adapters known at start-up; more can be added while serving."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept read in memory at most."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", f"must be at least 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, "max_lora_rank", f"must be at least 1, got {self.max_lora_rank}")
        _require(self.cpu_capacity >= self.max_loras, "max_cpu_loras",
                 f"{self.max_cpu_loras} must be at least max_loras ({self.max_loras})")
        names = [name for name, _ in self.modules]
        _require(len(names) == len(set(names)), "lora_modules", f"a name given twice: {sorted(names)}")
        _require(all(names), "lora_modules", "an adapter needs a name (NAME=PATH)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget continuous batching (vLLM v1 style)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # A step starts a second (or later) prompt only if all its prompt tokens, the new prompt's
    # whole remaining part included, stay within this; None: only the token budget limits. Once a
    # device is saturated (a few hundred tokens on a CPU core), batching another prompt no longer
    # speeds anything up, it only holds back the first prompt's first token until both are done.
    max_prompt_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs", f"must be positive, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens > 0,
            "max_num_batched_tokens",
            f"must be positive, got {self.max_num_batched_tokens}",
        )
        if self.max_prompt_batch_tokens is not None:
            _require(self.max_prompt_batch_tokens > 0, "max_prompt_batch_tokens",
                     f"must be positive, got {self.max_prompt_batch_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs: which model, which role, how big a cache, which formats.

    The "auto" formats are resolved once, when the engine starts (engine.formats, which says why in
    the engine's start-up line): `dtype` "auto" is bfloat16 on a GPU that computes it (compute
    capability 8.0 and up, else float16) and on a CPU that multiplies bf16 natively (AMX-BF16 or
    AVX512-BF16 in /proc/cpuinfo), float32 on any other CPU.
    """

    model: str | None = None  # path to a GGUF file or an HF directory; None = the shipped model
    role: Role = "colocated"
    dtype: DTypeOption = "auto"  # activations and arithmetic
    device: str = "cpu"
    attention_backend: AttentionBackendName = "auto"
    # None: the model's max_position_embeddings, the most it may be but under StreamingLLM's window
    # (cache.sliding_window), where it bounds a conversation longer than the context.
    max_model_len: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # float32 on CPU: how the matrix products hold their weights (engine.model.linear). "fp16" rounds
    # them to fp16 for a product that reads half the bytes (and gives quantized products an fp16
    # copy for inputs of 6 rows and more, engine.model.quantized_linear); "fp32" keeps them exact, pre-packed for
    # oneDNN; "plain" keeps one copy. Both packed formats hold a second copy of the weights. "auto":
    # fp16 when dtype "auto" chose float32 (the fast default), fp32 when float32 was asked for (so
    # dtype float32 with quantization none is exact fp32), plain where no float32 product runs on a
    # CPU; fp16 or fp32 there is refused at start-up.
    cpu_weights: CpuWeightsOption = "auto"
    quantization: Quantization = "auto"  # weight-only: activations stay in `dtype`
    kv_cache_dtype: KVCacheDType = "auto"
    activation_quantization: ActivationQuantization = "auto"
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoraConfig | None = None  # None: no adapters (vLLM's --enable-lora off)
    # Ranks (processes) the model is split across, Megatron-style (engine.parallel); each holds its
    # shard of the weights and of the KV cache, `cache` being each rank's budget.
    tensor_parallel_size: int = 1
    # A mixture of experts' experts split whole over those ranks (EP size = TP size, as vLLM's
    # --enable-expert-parallel without data parallelism) instead of each expert's features.
    enable_expert_parallel: bool = False
    # Ranks (processes, each holding the whole model) a long prompt's prefill is split across by
    # sequence (vLLM's --prefill-context-parallel-size; engine.parallel.context_parallel): a step that
    # computes one whole prompt of at least `prefill_context_parallel_min_tokens` tokens, nothing
    # cached, gives each rank a contiguous slice of its tokens.
    prefill_context_parallel_size: int = 1
    prefill_context_parallel_min_tokens: int = 1024
    # Stage processes the decoder layers are split across in contiguous ranges, each holding its
    # layers' weights and KV blocks; a step's sequences go through them in micro-batches
    # (engine.parallel.pipeline).
    pipeline_parallel_size: int = 1
    # What the worker serves the weights as (vLLM's served_model_name; None: the file's name up to
    # its first dot), and which of the model repository's versions they are ("" outside one).
    served_model_name: str | None = None
    model_version: str = ""

    @property
    def parallel_sizes(self) -> dict[str, int]:
        """The ranks of each kind of parallelism the model is split by, named as load reports,
        metrics ("tandem:<name>") and traces ("tandem.<name>") say them."""
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "expert_parallel_size": self.tensor_parallel_size if self.enable_expert_parallel else 1,
                "prefill_context_parallel_size": self.prefill_context_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size}

    @property
    def world_size(self) -> int:
        """The processes of this engine: its tensor-parallel, prefill context-parallel or pipeline ranks."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size * self.pipeline_parallel_size

    @property
    def served_name(self) -> str:
        """The model name load reports, metrics and traces carry."""
        return self.served_model_name or served_model_id(self.model)

    def __post_init__(self) -> None:
        _require(self.role in ("colocated", "prefill", "decode"), "role", f"unknown role {self.role!r}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size",
                 f"must be at least 1, got {self.tensor_parallel_size}")
        _require(self.prefill_context_parallel_size >= 1, "prefill_context_parallel_size",
                 f"must be at least 1, got {self.prefill_context_parallel_size}")
        _require(self.prefill_context_parallel_size == 1 or self.tensor_parallel_size == 1,
                 "prefill_context_parallel_size", f"{self.prefill_context_parallel_size} with tensor_parallel_size "
                 f"{self.tensor_parallel_size} is not served (each context-parallel rank holds the whole model)")
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
                 f"must be at least 1, got {self.pipeline_parallel_size}")
        _require(self.pipeline_parallel_size == 1 or self.prefill_context_parallel_size == 1,
                 "pipeline_parallel_size", f"{self.pipeline_parallel_size} with prefill_context_parallel_size "
                 f"{self.prefill_context_parallel_size} is not served")
        _require(self.prefill_context_parallel_min_tokens >= 2, "prefill_context_parallel_min_tokens",
                 f"must be at least 2, got {self.prefill_context_parallel_min_tokens}")
        _require(not self.kv_tiers.enabled or self.world_size == 1, "kv_host_tier",
                 f"KV tiers serve a single-process engine, not a world of {self.world_size} ranks")
        if self.speculative is not None and self.role == "prefill":
            raise ValueError(f"{SPECULATIVE_FLAG}: the prefill role samples only a prompt's first token, so it "
                             "cannot speculate; give the flag to decode or colocated workers")
        _require(self.dtype in get_args(DTypeOption), "dtype",
                 f"unknown dtype {self.dtype!r} (choose from {', '.join(get_args(DTypeOption))})")
        _require(self.device == "cpu" or self.device.startswith("cuda"), "device", f"unknown device {self.device!r}")
        _require(
            self.attention_backend in ("auto", "torch", "triton"),
            "attention_backend",
            f"unknown backend {self.attention_backend!r}",
        )
        _require(self.cpu_weights in get_args(CpuWeightsOption), "cpu_weights",
                 f"unknown format {self.cpu_weights!r} (choose from {', '.join(get_args(CpuWeightsOption))})")
        _require(self.quantization in get_args(Quantization), "quantization",
                 f"unknown method {self.quantization!r} (choose from {', '.join(get_args(Quantization))})")
        _require(self.activation_quantization in get_args(ActivationQuantization), "activation_quantization",
                 f"unknown format {self.activation_quantization!r} "
                 f"(choose from {', '.join(get_args(ActivationQuantization))})")
        _require(self.kv_cache_dtype in get_args(KVCacheDType), "kv_cache_dtype",
                 f"unknown dtype {self.kv_cache_dtype!r} (choose from {', '.join(get_args(KVCacheDType))})")
        if self.max_model_len is not None:
            _require(self.max_model_len > 0, "max_model_len", "must be positive")
