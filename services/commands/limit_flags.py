"""The limit flags of the serving commands and their translation into GrpcLimits and RequestLimits.

Each flag is its field's name (`--max-message-bytes` is `max_message_bytes`); the dataclasses
validate, and their errors are reworded to name the flag.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.common.grpc_limits import DEFAULT_MAX_CONCURRENT_STREAMS, DEFAULT_MAX_MESSAGE_BYTES, GrpcLimits

if TYPE_CHECKING:
    from services.gateway.limits import RequestLimits


def add_grpc_limit_flags(parser: argparse.ArgumentParser) -> None:
    """`--max-message-bytes` and `--max-concurrent-streams`, for every gRPC server."""
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest gRPC message this process's server and channels send or receive")
    parser.add_argument("--max-concurrent-streams", type=int, default=DEFAULT_MAX_CONCURRENT_STREAMS,
                        help="gRPC calls one client connection may have open at once (further calls wait)")


def add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The gateway's limits on client requests (see services.gateway.limits)."""
    from services.gateway.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_REQUESTS

    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt, in tokens (default: the model's context less one)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="longest prompt plus max_tokens (default: the model's context)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest HTTP request body; larger ones get 413")
    parser.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                        help="HTTP API requests in flight at once (streams included); beyond it 429")


def grpc_limits(args: argparse.Namespace) -> GrpcLimits:
    """The GrpcLimits the flags give; ValueError naming the flag."""
    with _naming_flags():
        return GrpcLimits(args.max_message_bytes, args.max_concurrent_streams)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The RequestLimits the flags give; ValueError naming the flag."""
    from services.gateway.limits import RequestLimits

    with _naming_flags():
        return RequestLimits(args.max_prompt_tokens, args.max_total_tokens, args.max_body_bytes,
                             args.max_concurrent_requests)


@contextlib.contextmanager
def _naming_flags() -> Iterator[None]:
    """Re-raise a limit's ValueError ("max_x: ...") as one naming its flag ("--max-x: ...")."""
    try:
        yield
    except ValueError as error:
        field, _, rest = str(error).partition(": ")
        raise ValueError(f"--{field.replace('_', '-')}: {rest}") from None
