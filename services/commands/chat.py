"""`tandem chat`: talk to a running gateway, the answer streamed to the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.client import TandemClient


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `chat` subcommand."""
    chat = sub.add_parser("chat", help="chat with a model through a gateway")
    chat.add_argument("message", nargs="?", default=None,
                      help="one user message; without it, each line read from stdin is a turn until EOF")
    chat.add_argument("--gateway", default="127.0.0.1:50051", help="the gateway's HOST:PORT")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    chat.add_argument("--timeout", type=float, default=None, help="seconds allowed for each answer")
    chat.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                      help="the gateway's API key (default: $TANDEM_API_KEY)")
    chat.add_argument("--tls", action="store_true", help="reach the gateway over TLS (system roots)")
    chat.add_argument("--tls-ca", default=None, help="reach the gateway over TLS, trusting this PEM CA")
    chat.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One answer to MESSAGE, or a conversation over stdin's lines."""
    import grpc

    from services.client import TandemClient

    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    turns = [args.message] if args.message is not None else _stdin_turns()
    with TandemClient(args.gateway, api_key=args.api_key, tls=args.tls, ca_file=args.tls_ca) as client:
        for turn in turns:
            conversation.append({"role": "user", "content": turn})
            try:
                answer = _stream_answer(client, conversation, args)
            except grpc.RpcError as error:
                print(f"tandem chat: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            conversation.append({"role": "assistant", "content": answer})
    return 0


def _stdin_turns() -> Iterator[str]:
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _stream_answer(client: TandemClient, conversation: list[dict[str, str]], args: argparse.Namespace) -> str:
    """Print the reply as it arrives, then a summary line on stderr; returns the reply's text."""
    parts: list[str] = []
    for chunk in client.chat(conversation, max_tokens=args.max_tokens, temperature=args.temperature,
                             timeout=args.timeout):
        parts.append(chunk.text)
        print(chunk.text, end="", flush=True)
        if chunk.finish_reason is not None:
            print()
        if chunk.usage is not None:
            print(f"[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated, "
                  f"finish={chunk.finish_reason}]", file=sys.stderr)
    return "".join(parts)
