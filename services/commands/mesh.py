"""`tandem mesh`: a whole deployment on one machine, what `make run` starts.

A gateway and two workers run as separate processes, exactly as they would on separate machines
(the engine flags, `--dtype` and the rest, go to both workers): by default two colocated workers,
each computing prompts and decoding, the gateway placing each request on one of them or both
(`--shape flexible`); or one prefill and one decode worker (`--shape fixed`). With
`--model-repository`, two workers for each version it lists (ports counted up from the given ones),
each loading its version, behind one gateway serving them all. This command
starts them, shows one request streamed through them, says how to call the gateway (gRPC, or the
OpenAI-compatible HTTP API), and stops them all on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engine.config import Role
from services.commands.address_flags import AddressFlags
from services.commands.engine_flags import EngineFlags
from services.commands.gateway import PORT as GATEWAY_PORT
from services.commands.gateway import GatewayFlags
from services.commands.kv_flags import KVLinkFlags
from services.commands.log_flags import LogFlags
from services.commands.worker import PORTS as WORKER_PORTS
from services.commands.worker import WorkerFlags
from services.common.config_flags import add_flags, flag, from_args, to_argv
from services.launcher import ReadyLine, ServerProcess, tandem_command
from services.repository.config import load_repository

_DEMO_PROMPT = "Explain in two sentences why LLM inference splits prefill and decode."


class MeshError(Exception):
    """A child process failed to start, died, or the demo request failed."""


@dataclass(frozen=True)
class MeshFlags:
    """The flags of `tandem mesh`: one field per flag."""

    host: str = flag("127.0.0.1", "address every process binds to")
    gateway_port: int = flag(GATEWAY_PORT, "the gateway's gRPC port; 0 = a free port")
    http_port: int = flag(GatewayFlags.http_port, "the gateway's OpenAI-compatible HTTP port; 0 = a free port")
    shape: Literal["flexible", "fixed"] = flag(
        "flexible", "flexible: two colocated workers, either of which computes a request's prompt and either "
        "decodes it; fixed: a prefill worker and a decode worker")
    worker_port: int = flag(WORKER_PORTS["worker"], "--shape flexible: the first worker's port, the second's is "
                                                    "the next; 0 = free ports")
    prefill_port: int = flag(WORKER_PORTS["prefill"], "--shape fixed: the prefill worker's port; 0 = a free port")
    decode_port: int = flag(WORKER_PORTS["decode"], "--shape fixed: the decode worker's port; 0 = a free port")
    kv: KVLinkFlags = dataclasses.field(default_factory=KVLinkFlags)  # to both workers
    # The engine flags (model, dtype, formats, threads, cache, batching) go to both workers; the
    # gateway gets the model and its context length.
    engine: EngineFlags = dataclasses.field(default_factory=EngineFlags)
    startup_timeout: float = flag(300.0, "seconds allowed for the ready lines")
    grace_period: float = flag(10.0, "seconds the children get to drain on shutdown before they are killed")
    demo_prompt: str = flag(_DEMO_PROMPT, "the request the mesh shows once it is ready")
    demo_max_tokens: int = flag(96, "0 = no demo request")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `mesh` subcommand."""
    mesh = sub.add_parser("mesh", help="run a gateway and two workers (colocated, or a prefill and a decode one) "
                                       "on this machine")
    add_flags(mesh, MeshFlags)
    mesh.set_defaults(func=run)


def _child(role: str, args: Sequence[str]) -> ServerProcess:
    """`tandem ARGS` as one of the mesh's children, its stdout relayed with a `[role]` prefix."""
    return ServerProcess(role, tandem_command(args), env={**os.environ, "OMP_NUM_THREADS": "1"},
                         on_line=lambda line: print(f"[{role}] {line}", flush=True))


def run(args: argparse.Namespace) -> int:
    """Start the mesh, show a request through it, serve until Ctrl-C/SIGTERM, then stop the children."""
    flags: MeshFlags = from_args(MeshFlags, args)
    log = LogFlags(args.log_level)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    children: list[ServerProcess] = []
    try:
        gateway, http = _start(flags, log, children, stop)
        # The ready line's form is every server's (services.launcher.ReadyLine): a script starts a mesh as it
        # starts one worker.
        print(f"tandem mesh ready grpc={gateway} http={http}", flush=True)
        if flags.demo_max_tokens > 0:
            _demo(gateway, flags.demo_prompt, flags.demo_max_tokens, stop)
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
        _stop_all(children, flags.grace_period)


def _start(flags: MeshFlags, log: LogFlags, children: list[ServerProcess],
           stop: threading.Event) -> tuple[str, str]:
    """Start the workers together (their model loads overlap), then the gateway on the addresses
    they report; the gateway's gRPC and HTTP addresses once all are ready."""
    for index, version in enumerate(_versions(flags.engine)):
        suffix = f" {version}" if version else ""
        # A worker asked for port 0 binds a free port itself and names it in its ready line: a port
        # picked here and bound later by the child could be taken by another process in between.
        for role, name, port in _pair(flags, index):
            worker = _worker_flags(flags, role, port, version)
            argv = [*to_argv(log), "worker", *to_argv(worker, defaults={"port": WORKER_PORTS["worker"]})]
            children.append(_child(f"{name}{suffix}", argv))
    workers = [ready.grpc for ready in _wait_ready(children, time.monotonic() + flags.startup_timeout, stop)]
    # The gateway reports ready once it sees a serving worker in each pool.
    if flags.shape == "flexible":
        pools = {"colocated": ",".join(workers)}
    else:
        pools = {"prefill": ",".join(workers[0::2]), "decode": ",".join(workers[1::2])}
    gateway = GatewayFlags(
        address=AddressFlags(flags.host, flags.gateway_port), http_port=flags.http_port, **pools,
        model=flags.engine.model, model_repository=flags.engine.model_repository,
        max_model_len=flags.engine.max_model_len, wait_for_workers=flags.startup_timeout)
    children.append(_child("gateway", [*to_argv(log), "gateway", *to_argv(gateway, defaults={"port": GATEWAY_PORT})]))
    ready = _wait_ready(children, time.monotonic() + flags.startup_timeout, stop)[-1]
    return ready.grpc, str(ready.http)


def _pair(flags: MeshFlags, index: int) -> list[tuple[Role, str, int]]:
    """(role, name, port) of the two workers of the mesh's `index`th version: ports counted up from
    the given ones, 0 staying 0 (a free port)."""
    def port(first: int, offset: int) -> int:
        return first + offset if first else 0

    if flags.shape == "flexible":
        return [("colocated", f"worker {n + 1}", port(flags.worker_port, 2 * index + n)) for n in range(2)]
    return [("prefill", "prefill", port(flags.prefill_port, index)),
            ("decode", "decode", port(flags.decode_port, index))]


def _worker_flags(flags: MeshFlags, role: Role, port: int, version: str) -> WorkerFlags:
    """One of the mesh's workers: the mesh's engine and KV flags, serving `version` ("" without a
    repository) on `port`. A prefill worker is not asked to speculate (it would refuse to) and takes
    only the checksum flag of the KV link's. A worker given a fixed port serves metrics on that port
    + 1000 (its default); one given a free port gets a free metrics port too (its ready line names it)."""
    engine = dataclasses.replace(flags.engine, model_version=version or None)
    kv = flags.kv
    if role == "prefill":
        engine = dataclasses.replace(engine, speculative_config=None)
        kv = KVLinkFlags(kv_checksum=kv.kv_checksum)
    return WorkerFlags(role=role, address=AddressFlags(flags.host, port), kv=kv, engine=engine,
                       metrics_port=None if port else 0)


def _versions(engine: EngineFlags) -> list[str]:
    """NAME@VERSION of each version the mesh serves; [""] (one pair, no version) without a repository."""
    if engine.model_repository is None:
        return [""]
    if engine.model_version is not None or engine.pool is not None:
        raise MeshError("--model-version/--pool: the mesh serves every version of --model-repository")
    if engine.model is not None:
        raise MeshError("--model: the repository names the models; give one or the other")
    try:
        return [version.version_key for version in load_repository(engine.model_repository).versions]
    except ValueError as error:
        raise MeshError(str(error)) from error


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
