"""Flags shared by every command that runs an engine, and their translation into EngineConfig."""

from __future__ import annotations

import argparse
from typing import get_args

from engine.config import (
    ActivationQuantization,
    CacheConfig,
    CpuWeightsOption,
    DTypeOption,
    EngineConfig,
    KVCacheDType,
    Quantization,
    Role,
    SchedulerConfig,
)
from engine.speculative.config import SpeculativeConfig
from services.repository.config import ModelVersion, load_repository

# One prompt of a few hundred tokens keeps a CPU core busy, so batching a second one into its step
# only delays the first one's first token (docs/benchmarks.md, "Decisions settled by experiments"). A GPU
# is far from saturated by a few prompts: there they batch up to the token budget.
CPU_PROMPT_BATCH_TOKENS = 256


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Model, device, cache and batching flags."""
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the shipped SmolLM2-135M)")
    parser.add_argument("--model-repository", default=None, metavar="TOML",
                        help="the deployment's model repository (services/repository): the worker serves "
                             "the version --model-version or --pool names, in that version's formats")
    parser.add_argument("--model-version", default=None, metavar="NAME@VERSION",
                        help="with --model-repository: the version to serve")
    parser.add_argument("--pool", default=None,
                        help="with --model-repository: serve the version the repository assigns to this pool")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=get_args(DTypeOption),
                        help="activations and arithmetic; auto (resolved at start-up, which the engine's log "
                             "says): bfloat16 on a GPU (float16 before compute capability 8.0) and on a CPU "
                             "with amx_bf16 or avx512_bf16, else float32")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--cpu-weights", default="auto", choices=get_args(CpuWeightsOption),
                        help="float32 on CPU: weights rounded to fp16 for a faster decode, exact (fp32, "
                             "oneDNN-packed), or one plain copy; auto: fp16 when --dtype auto chose float32, "
                             "fp32 when --dtype float32 was given (exact fp32 with --quantization none)")
    parser.add_argument("--quantization", default="auto", choices=get_args(Quantization),
                        help="weight format (weight-only; activations in --dtype); auto: the file's own "
                             "blocks where a kernel serves them, else none")
    parser.add_argument("--activation-quantization", default="auto", choices=get_args(ActivationQuantization),
                        help="int8: the products of integer-group weights quantize their inputs to int8 blocks "
                             "of 32 (as llama.cpp does) for the CPU's VNNI dot products; int16: 15 bits a block "
                             "as two int8 parts (bf16's accuracy, slower than int8); auto: int8 in bfloat16 on a "
                             "CPU with avx512_vnni and no AMX, else none")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=get_args(KVCacheDType),
                        help="KV cache element format; auto: the model's dtype")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache budget in MiB")
    parser.add_argument("--kv-cache-blocks", type=int, default=None, help="explicit KV block count (overrides MiB)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-prompt-batch-tokens", type=int, default=None,
                        help="a step starts another prompt only while its prompt tokens stay within this; "
                             f"0: no limit (default: {CPU_PROMPT_BATCH_TOKENS} on CPU, none on GPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="processes the model is split across (its heads, MLP features and vocabulary), "
                             "each holding its shard of the weights and a KV cache of --kv-cache-mib; prefill "
                             "and decode workers of different sizes exchange KV")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding on decode and colocated workers, in vLLM's keys: "
                             '\'{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, '
                             '"prompt_lookup_max": 4, "disable_by_batch_size": 8}\' (those are the defaults '
                             "of the keys left out); off when not given")


def engine_flag_args(args: argparse.Namespace, role: Role) -> list[str]:
    """The engine flags of `args` that differ from their defaults, as command-line arguments: what a
    command that starts engine processes (`tandem mesh`) passes on to those of `role` (a prefill
    worker gets no --speculative-config: it would refuse it). Every engine flag is named after its
    attribute (`--kv-cache-mib` sets `kv_cache_mib`)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_flags(parser)
    argv: list[str] = []
    for name, default in vars(parser.parse_args([])).items():
        if role == "prefill" and name == "speculative_config":
            continue
        value = getattr(args, name)
        if value != default:
            flag = "--" + name.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
    return argv


def engine_config(args: argparse.Namespace, role: Role, version: ModelVersion | None = None) -> EngineConfig:
    """The EngineConfig those flags describe (with --model-repository, the named version's model and
    formats in place of --model, --dtype, --quantization, --kv-cache-dtype and --max-model-len; with
    `version`, that one's: a hot swap's)."""
    version = version or repository_version(args)
    if version is not None:
        args = argparse.Namespace(**{**vars(args), "model": version.weights, "dtype": version.dtype,
                                     "quantization": version.quantization,
                                     "kv_cache_dtype": version.kv_cache_dtype,
                                     "max_model_len": version.max_model_len or args.max_model_len})
    return EngineConfig(
        model=args.model,
        served_model_name=version.model if version is not None else None,
        model_version=version.name if version is not None else "",
        role=role,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        cpu_weights=args.cpu_weights,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_quantization=args.activation_quantization,
        speculative=None if args.speculative_config is None else SpeculativeConfig.from_json(args.speculative_config),
        tensor_parallel_size=args.tensor_parallel_size,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.kv_cache_blocks,
            memory_bytes=None if args.kv_cache_blocks else args.kv_cache_mib * 1024 * 1024,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_prompt_batch_tokens=_prompt_batch_tokens(args)),
    )


def repository_version(args: argparse.Namespace) -> ModelVersion | None:
    """The repository's version this worker serves (None without --model-repository); ValueError
    naming the flag that is missing or at odds."""
    if args.model_repository is None:
        if args.model_version is not None or args.pool is not None:
            raise ValueError("--model-version/--pool: name the versions' file with --model-repository")
        return None
    if args.model is not None:
        raise ValueError("--model: the repository's version names the model; give one or the other")
    if (args.model_version is None) == (args.pool is None):
        raise ValueError("--model-repository: give exactly one of --model-version NAME@VERSION and --pool NAME")
    repository = load_repository(args.model_repository)
    if args.model_version is not None:
        try:
            return repository.find(args.model_version)
        except ValueError as error:
            raise ValueError(f"--model-version: {error}") from None
    return repository.for_pool(args.pool)


def _prompt_batch_tokens(args: argparse.Namespace) -> int | None:
    if args.max_prompt_batch_tokens is None:
        return CPU_PROMPT_BATCH_TOKENS if args.device == "cpu" else None
    return args.max_prompt_batch_tokens or None
