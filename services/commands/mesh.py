"""`tandem mesh`: a whole deployment on one machine, what `make run` starts.

A gateway, one prefill and one decode worker run as separate processes, exactly as they would
on separate machines (the engine flags, `--dtype` and the rest, go to both workers); with
`--model-repository`, one prefill and one decode worker for each version it lists (ports counted
up from the given ones), each loading its version, behind one gateway serving them all. This command
starts them, shows one request streamed through them, says how to call the gateway (gRPC, or the
OpenAI-compatible HTTP API), and stops them all on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence

from services.commands.engine_flags import add_engine_flags, engine_flag_args
from services.commands.kv_flags import add_kv_checksum_flag
from services.launcher import ReadyLine, ServerProcess, tandem_command
from services.repository.config import load_repository

_DEMO_PROMPT = "Explain in two sentences why LLM inference splits prefill and decode."


class MeshError(Exception):
    """A child process failed to start, died, or the demo request failed."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `mesh` subcommand."""
    mesh = sub.add_parser("mesh", help="run a gateway, a prefill and a decode worker on this machine")
    mesh.add_argument("--host", default="127.0.0.1", help="address every process binds to")
    mesh.add_argument("--gateway-port", type=int, default=50051, help="the gateway's gRPC port; 0 = a free port")
    mesh.add_argument("--http-port", type=int, default=8000,
                      help="the gateway's OpenAI-compatible HTTP port; 0 = a free port")
    mesh.add_argument("--prefill-port", type=int, default=50061, help="0 = a free port")
    mesh.add_argument("--decode-port", type=int, default=50071, help="0 = a free port")
    mesh.add_argument("--kv-backend", default="torch_dist", choices=["torch_dist", "grpc"])
    add_kv_checksum_flag(mesh)  # to both workers
    # The engine flags (model, dtype, formats, threads, cache, batching) go to both workers; the
    # gateway gets the model and its context length.
    add_engine_flags(mesh)
    mesh.add_argument("--startup-timeout", type=float, default=300.0, help="seconds allowed for the ready lines")
    mesh.add_argument("--grace-period", type=float, default=10.0,
                      help="seconds the children get to drain on shutdown before they are killed")
    mesh.add_argument("--demo-prompt", default=_DEMO_PROMPT)
    mesh.add_argument("--demo-max-tokens", type=int, default=96, help="0 = no demo request")
    mesh.set_defaults(func=run)


def _child(role: str, args: Sequence[str]) -> ServerProcess:
    """`tandem ARGS` as one of the mesh's children, its stdout relayed with a `[role]` prefix."""
    return ServerProcess(role, tandem_command(args), env={**os.environ, "OMP_NUM_THREADS": "1"},
                         on_line=lambda line: print(f"[{role}] {line}", flush=True))


def run(args: argparse.Namespace) -> int:
    """Start the mesh, show a request through it, serve until Ctrl-C/SIGTERM, then stop the children."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    children: list[ServerProcess] = []
    try:
        gateway, http = _start(args, children, stop)
        print(f"tandem mesh ready gateway={gateway} http={http}", flush=True)
        if args.demo_max_tokens > 0:
            _demo(gateway, args.demo_prompt, args.demo_max_tokens, stop)
        _print_usage(gateway, http)
        while not stop.wait(0.5):
            for child in children:
                if child.proc.poll() is not None:
                    raise MeshError(f"the {child.name} process exited with code {child.proc.returncode}")
        return 0
    except MeshError as error:
        print(f"tandem mesh: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        _stop_all(children, args.grace_period)


def _start(args: argparse.Namespace, children: list[ServerProcess], stop: threading.Event) -> tuple[str, str]:
    """Start the two workers together (their model loads overlap), then the gateway on the
    addresses they report; the gateway's gRPC and HTTP addresses once all are ready."""
    base = ["--log-level", args.log_level]
    common = ["--host", args.host, "--kv-checksum", args.kv_checksum]
    for index, version in enumerate(_versions(args)):
        named = ["--model-version", version] if version else []
        suffix = f" {version}" if version else ""
        # A worker asked for port 0 binds a free port itself and names it in its ready line: a port
        # picked here and bound later by the child could be taken by another process in between.
        prefill_port = args.prefill_port + index if args.prefill_port else 0
        decode_port = args.decode_port + index if args.decode_port else 0
        children.append(_child(f"prefill{suffix}", [*base, "prefill", *common, *engine_flag_args(args, "prefill"),
                                                    *named, "--port", str(prefill_port),
                                                    *_free_metrics_port(prefill_port)]))
        children.append(_child(f"decode{suffix}", [*base, "decode", *common, *engine_flag_args(args, "decode"),
                                                   *named, "--port", str(decode_port), "--kv-backend",
                                                   args.kv_backend, *_free_metrics_port(decode_port)]))
    workers = [ready.grpc for ready in _wait_ready(children, time.monotonic() + args.startup_timeout, stop)]
    prefill, decode = ",".join(workers[0::2]), ",".join(workers[1::2])
    # The gateway reports ready once it sees a serving worker in each pool.
    model = [*(["--model", args.model] if args.model else []),
             *(["--model-repository", args.model_repository] if args.model_repository else []),
             *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])]
    children.append(_child("gateway", [*base, "gateway", "--host", args.host, *model, "--port", str(args.gateway_port),
                                       "--http-port", str(args.http_port), "--prefill", prefill, "--decode", decode,
                                       "--wait-for-workers", str(args.startup_timeout)]))
    gateway = _wait_ready(children, time.monotonic() + args.startup_timeout, stop)[-1]
    return gateway.grpc, str(gateway.http)


def _versions(args: argparse.Namespace) -> list[str]:
    """NAME@VERSION of each version the mesh serves; [""] (one pair, no version) without a repository."""
    if args.model_repository is None:
        return [""]
    if args.model_version is not None or args.pool is not None:
        raise MeshError("--model-version/--pool: the mesh serves every version of --model-repository")
    if args.model is not None:
        raise MeshError("--model: the repository names the models; give one or the other")
    try:
        return [version.key for version in load_repository(args.model_repository).versions]
    except ValueError as error:
        raise MeshError(str(error)) from error


def _free_metrics_port(port: int) -> list[str]:
    """A child given a fixed port serves metrics on that port + 1000 (its default); one given a free
    port gets a free metrics port too (its ready line names it)."""
    return [] if port else ["--metrics-port", "0"]


def _wait_ready(children: Sequence[ServerProcess], deadline: float, stop: threading.Event) -> list[ReadyLine]:
    """Every child's ready line, in order, polled so that a stop request interrupts the wait."""
    while not all(child.ready for child in children):
        for child in children:
            if child.proc.poll() is not None and not child.ready:
                raise MeshError(f"the {child.name} process exited with code {child.proc.returncode} "
                                "before it was ready (its log is above)")
        if time.monotonic() > deadline:
            late = ", ".join(child.name for child in children if not child.ready)
            raise MeshError(f"not ready within --startup-timeout: {late}")
        if stop.wait(0.1):
            raise MeshError("interrupted while starting")
    return [child.ready for child in children if child.ready]


def _demo(gateway: str, prompt: str, max_tokens: int, stop: threading.Event) -> None:
    """Stream one chat request through the gateway, with TTFT and TPOT as this client saw them."""
    import grpc

    from services.client import TandemClient

    print(f"\nDemo request through the gateway: {prompt!r}\n", flush=True)
    tokens = 0
    started = time.perf_counter()
    first_at = last_at = started
    try:
        with TandemClient(gateway) as client, client.chat(
            [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0
        ) as stream:
            for chunk in stream:
                if stop.is_set():
                    break
                if chunk.token_ids:
                    last_at = time.perf_counter()
                    if not tokens:
                        first_at = last_at
                    tokens += len(chunk.token_ids)
                print(chunk.text, end="", flush=True)
    except grpc.RpcError as error:
        raise MeshError(f"the demo request failed: {error.code().name}: {error.details()}") from error
    tpot = (last_at - first_at) / (tokens - 1) if tokens > 1 else 0.0
    print(f"\n\n[{tokens} tokens; at the client: TTFT {(first_at - started) * 1000:.0f} ms, "
          f"TPOT {tpot * 1000:.1f} ms]", flush=True)


def _print_usage(gateway: str, http: str) -> None:
    tandem = os.path.join(os.path.dirname(sys.executable), "tandem")
    tandem = os.path.relpath(tandem) if os.path.exists(tandem) else "tandem"
    body = '{"chat": {"messages": [{"role": "user", "content": "Hello"}]}, "sampling": {"max_tokens": 64}}'
    chat = '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'
    print(f"\nThe gateway serves the OpenAI-compatible API at http://{http}/v1 and tandem.v1.Gateway at "
          f"{gateway} (gRPC with server reflection). Try:\n"
          f"  curl http://{http}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(chat)}\n"
          f"  {tandem} chat --gateway {gateway} \"Hello\"\n"
          f"  grpcurl -plaintext -d {shlex.quote(body)} {gateway} tandem.v1.Gateway/Generate\n"
          "Ctrl-C stops the mesh.", flush=True)


def _stop_all(children: Sequence[ServerProcess], grace_period: float) -> None:
    """SIGTERM every child, then SIGKILL whichever has not exited after the grace period."""
    for child in reversed(children):
        child.terminate()
    deadline = time.monotonic() + grace_period
    for child in children:
        code, killed = child.wait_or_kill(deadline - time.monotonic())
        if killed:
            print(f"tandem mesh: killed the {child.name} process after {grace_period:g} s", file=sys.stderr)
        if code != 0:
            print(f"tandem mesh: the {child.name} process exited with code {code}", file=sys.stderr, flush=True)
