"""`tandem worker --role colocated|decode`: a worker serving tandem.v1.Decode.

A colocated worker computes prompts and decodes them in one engine, like vLLM: the baseline
disaggregation must beat, and a valid small deployment. It is a decode worker whose engine also
prefills, so it takes KV from prefill workers too when a gateway sends it a prefilled request.
"""

from __future__ import annotations

import argparse

from services.commands.decode import add_decode_flags, run


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `worker` subcommand."""
    worker = sub.add_parser("worker", help="serve a colocated (prefill + decode) or decode worker")
    worker.add_argument("--role", default="colocated", choices=["colocated", "decode"],
                        help="colocated: prefills locally and decodes; decode: the same as `tandem decode`")
    add_decode_flags(worker, default_port=50081)
    worker.set_defaults(func=run)
