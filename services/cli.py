"""The `tandem` command line: it only translates flags into config and calls the code."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engine.config import CacheConfig, EngineConfig, SchedulerConfig


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the shipped SmolLM2-135M)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache budget in MiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")


def _engine_config(args: argparse.Namespace, role: str) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        role=role,  # type: ignore[arg-type]
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        cache=CacheConfig(
            block_size=args.block_size,
            memory_bytes=args.kv_cache_mib * 1024 * 1024,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )


def _generate(args: argparse.Namespace) -> int:
    import torch

    from engine.engine import Engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(_engine_config(args, "colocated"))
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = engine.tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed,
    )
    [completion] = generate(engine, [prompt], params)
    if args.json:
        print(json.dumps({
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(prompt),
            "ttft_s": round(completion.ttft_s, 6),
            "tpot_s": round(completion.tpot_s, 6),
        }))
    else:
        print(completion.text)
        print(
            f"[{len(prompt)} prompt tokens, {len(completion.token_ids)} generated, "
            f"finish={completion.finish_reason}, TTFT {completion.ttft_s * 1000:.0f} ms, "
            f"TPOT {completion.tpot_s * 1000:.1f} ms]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every `tandem` subcommand."""
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM inference")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run one prompt through an in-process engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    _add_engine_flags(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tandem` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
