"""`tandem chat`: talk to a running gateway, the answer streamed to the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.config_flags import add_flags, flag, from_args

if TYPE_CHECKING:
    from services.client import TandemClient


@dataclass(frozen=True)
class ChatFlags:
    """The flags of `tandem chat` (its message is a positional argument)."""

    gateway: str = flag("127.0.0.1:50051", "the gateway's HOST:PORT")
    system: str | None = flag(None, "a system message that opens the conversation")
    max_tokens: int = flag(256, "tokens each answer may have at most")
    temperature: float = flag(0.0, "0 = greedy")
    timeout: float | None = flag(None, "seconds allowed for each answer")
    api_key: str | None = flag(None, "the gateway's API key (default: $TANDEM_API_KEY)")
    tls: bool = flag(False, "reach the gateway over TLS (system roots)")
    tls_ca: str | None = flag(None, "reach the gateway over TLS, trusting this PEM CA")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `chat` subcommand."""
    chat = sub.add_parser("chat", help="chat with a model through a gateway")
    chat.add_argument("message", nargs="?", default=None,
                      help="one user message; without it, each line read from stdin is a turn until EOF")
    add_flags(chat, ChatFlags)
    chat.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One answer to MESSAGE, or a conversation over stdin's lines."""
    import grpc

    from services.client import TandemClient

    flags: ChatFlags = from_args(ChatFlags, args)
    conversation: list[dict[str, str]] = []
    if flags.system:
        conversation.append({"role": "system", "content": flags.system})
    turns = [args.message] if args.message is not None else _stdin_turns()
    api_key = flags.api_key if flags.api_key is not None else os.environ.get("TANDEM_API_KEY")
    with TandemClient(flags.gateway, api_key=api_key, tls=flags.tls, ca_file=flags.tls_ca) as client:
        for turn in turns:
            conversation.append({"role": "user", "content": turn})
            try:
                answer = _stream_answer(client, conversation, flags)
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


def _stream_answer(client: TandemClient, conversation: list[dict[str, str]], flags: ChatFlags) -> str:
    """Print the reply as it arrives, then a summary line on stderr; returns the reply's text."""
    parts: list[str] = []
    for chunk in client.chat(conversation, max_tokens=flags.max_tokens, temperature=flags.temperature,
                             timeout=flags.timeout):
        parts.append(chunk.text)
        print(chunk.text, end="", flush=True)
        if chunk.finish_reason is not None:
            print()
        if chunk.usage is not None:
            print(f"[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated, "
                  f"finish={chunk.finish_reason}]", file=sys.stderr)
    return "".join(parts)
