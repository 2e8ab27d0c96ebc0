"""services.common.config_flags: flags generated from frozen dataclasses, parsed back into them, and
passed on as arguments (the mesh's children); the worker command and its aliases built from one."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args, get_type_hints

import pytest

from services.cli import build_parser
from services.commands.engine_flags import EngineFlags
from services.commands.gateway import GatewayFlags
from services.commands.mesh import MeshFlags, _pair, _worker_flags
from services.commands.worker import PORTS, WorkerFlags
from services.common.config_flags import add_flags, flag, from_args, to_argv


@dataclass(frozen=True)
class _Inner:
    depth: int = flag(2, "an inner knob")

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"depth: must not be negative, got {self.depth}")


@dataclass(frozen=True)
class _Outer:
    name: str = flag(dataclasses.MISSING, "required")
    mode: Literal["a", "b"] = flag("a", "a choice")
    path: Path | None = flag(None, "a file", metavar="FILE")
    switch: bool = flag(False, "a switch")
    tags: tuple[str, ...] = flag((), "repeatable")
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    internal: int = 0  # no flag: set by the command


def _parser(**defaults: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Outer, defaults=defaults)
    return parser


def test_each_field_becomes_its_flag_and_parses_back_into_the_config():
    args = _parser().parse_args(["--name", "x", "--mode", "b", "--path", "/p", "--switch", "--tags", "t1",
                                 "--tags", "t2", "--depth", "5"])
    config = from_args(_Outer, args)
    assert config == _Outer("x", "b", Path("/p"), True, ("t1", "t2"), _Inner(5))
    assert _parser().parse_args(["--name", "x"]).depth == 2
    assert not hasattr(args, "internal")
    with pytest.raises(SystemExit):
        _parser().parse_args([])  # --name is required
    with pytest.raises(SystemExit):
        _parser().parse_args(["--name", "x", "--mode", "c"])


def test_to_argv_gives_the_arguments_of_the_values_that_are_not_defaults():
    config = _Outer("x", "b", Path("/p"), True, ("t1", "t2"), _Inner(5))
    argv = to_argv(config)
    assert argv == ["--name", "x", "--mode", "b", "--path", "/p", "--switch", "--tags", "t1", "--tags", "t2",
                    "--depth", "5"]
    assert from_args(_Outer, _parser().parse_args(argv)) == config
    assert to_argv(_Outer("x")) == ["--name", "x"]
    # A command's own default is left out, another value is passed.
    assert to_argv(_Outer("x", inner=_Inner(7)), defaults={"depth": 7}) == ["--name", "x"]
    assert from_args(_Outer, _parser(depth=7).parse_args(["--name", "x"])).inner.depth == 7


def test_a_configs_error_names_the_flag():
    with pytest.raises(ValueError, match=r"^--depth: must not be negative, got -1$"):
        from_args(_Outer, _parser().parse_args(["--name", "x", "--depth", "-1"]))


def _worker(*argv: str) -> WorkerFlags:
    return from_args(WorkerFlags, build_parser().parse_args(list(argv)))


def test_the_aliases_are_the_worker_command_with_its_role_and_port():
    assert _worker("prefill") == WorkerFlags(role="prefill", address=_worker("prefill").address)
    assert (_worker("prefill").address.port, _worker("decode").address.port) == (PORTS["prefill"], PORTS["decode"])
    assert _worker("worker", "--role", "decode", "--port", "1") == _worker("decode", "--port", "1")
    assert _worker("worker", "--role", "prefill", "--port", "1") == _worker("prefill", "--port", "1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--kv-backend", "grpc"])
    with pytest.raises(ValueError, match=r"^--kv-backend: a decode or colocated worker's flag"):
        _worker("worker", "--role", "prefill", "--kv-backend", "grpc")
    with pytest.raises(ValueError, match=r"^--memory-limit-mib: a decode or colocated worker's flag"):
        _worker("worker", "--role", "prefill", "--memory-limit-mib", "64")


def test_the_mesh_passes_its_workers_their_flags_as_arguments_they_parse_back():
    mesh = MeshFlags(engine=EngineFlags(dtype="float32", kv_cache_mib=64,
                                        speculative_config='{"num_speculative_tokens": 3}'))
    for role in ("prefill", "decode", "colocated"):
        worker = _worker_flags(mesh, role, 0, "m@v")
        parsed = _worker("worker", *to_argv(worker, defaults={"port": PORTS["worker"]}))
        assert parsed == worker
        assert parsed.engine.model_version == "m@v" and parsed.metrics_port == 0 and parsed.engine.kv_cache_mib == 64
    # A prefill worker would refuse to speculate, so it is not told to.
    assert _worker_flags(mesh, "prefill", 1, "").engine.speculative_config is None
    assert _worker_flags(mesh, "decode", 1, "").engine.speculative_config == mesh.engine.speculative_config


def test_the_mesh_starts_two_colocated_workers_unless_asked_for_fixed_pools():
    # Each version's pair on ports counted up from the given ones; 0 stays 0 (each binds a free port).
    assert _pair(MeshFlags(), 1) == [("colocated", "worker 1", 50083), ("colocated", "worker 2", 50084)]
    assert _pair(MeshFlags(worker_port=0), 1) == [("colocated", "worker 1", 0), ("colocated", "worker 2", 0)]
    assert _pair(MeshFlags(shape="fixed"), 1) == [("prefill", "prefill", 50062), ("decode", "decode", 50072)]


def test_every_flag_of_the_gateway_parses_back_from_its_arguments():
    argv = ["gateway", "--port", "1", "--prefill", "h:1", "--decode", "h:2", "--remote-ttft-share", "0.5",
            "--max-prompt-tokens", "9", "--planner-deployment", "m@v:decode=d", "--metrics-auth", "on"]
    flags = from_args(GatewayFlags, build_parser().parse_args(argv))
    assert from_args(GatewayFlags, build_parser().parse_args(["gateway", *to_argv(flags)])) == flags
    assert flags.cluster.planner_deployment == ("m@v:decode=d",) and flags.requests.max_prompt_tokens == 9


def test_the_kv_backend_flag_offers_the_backends_kvtransfer_has():
    from kvtransfer.descriptor import Backend
    from services.commands.kv_flags import KVLinkFlags

    assert get_args(get_type_hints(KVLinkFlags)["kv_backend"]) == get_args(Backend)
