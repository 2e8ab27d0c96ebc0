"""`tandem generate`: one prompt through an in-process engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

from services.commands.engine_flags import EngineFlags, engine_config
from services.common.config_flags import add_flags, flag, from_args


@dataclass(frozen=True)
class GenerateFlags:
    """The flags of `tandem generate`: one field per flag."""

    prompt: str = flag(dataclasses.MISSING, "the prompt to complete")
    chat: bool = flag(False, "wrap the prompt in the model's chat template")
    max_tokens: int = flag(64, "tokens to generate at most")
    temperature: float = flag(0.0, "0 = greedy")
    top_p: float = flag(1.0, "nucleus sampling's probability mass (1: off)")
    top_k: int = flag(0, "sample among this many likeliest tokens (0: off)")
    seed: int | None = flag(None, "the sampler's seed (default: none, a fresh draw)")
    json: bool = flag(False, "print one JSON object on the last line")
    engine: EngineFlags = dataclasses.field(default_factory=EngineFlags)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    gen = sub.add_parser("generate", help="run one prompt through an in-process engine")
    add_flags(gen, GenerateFlags)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate and print the completion (or one JSON object with --json)."""
    import torch

    from engine.compose import build_engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    flags: GenerateFlags = from_args(GenerateFlags, args)
    torch.set_num_threads(flags.engine.threads)
    engine = build_engine(engine_config(flags.engine, "colocated"))
    if flags.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": flags.prompt}])
    else:
        prompt = engine.tokenizer.encode(flags.prompt)
    params = SamplingParams(max_tokens=flags.max_tokens, temperature=flags.temperature, top_p=flags.top_p,
                            top_k=flags.top_k, seed=flags.seed)
    [completion] = generate(engine, [prompt], params)
    if flags.json:
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
