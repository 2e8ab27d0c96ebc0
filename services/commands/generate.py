"""`tandem generate`: one prompt through an in-process engine."""

from __future__ import annotations

import argparse
import json
import sys

from services.commands.engine_flags import add_engine_flags, engine_config


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    gen = sub.add_parser("generate", help="run one prompt through an in-process engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    add_engine_flags(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate and print the completion (or one JSON object with --json)."""
    import torch

    from engine.compose import build_engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = build_engine(engine_config(args, "colocated"))
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = engine.tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
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
