"""Build llama-cpp-python for the CPU at hand into bench/.cache/llama-cpp-<key>/ (a venv of its own).

The key names the llama-cpp-python version, the architecture and every instruction set the build
compiles in, read from the CPU's flags, so that a build is only ever run on a CPU that has them all:
a machine with other flags gets (and builds) another key. Every ggml instruction-set option is set
explicitly, on or off, with GGML_NATIVE=OFF: `-march=native` compiled in whatever the build machine
advertised, and such a build died with SIGILL on a Xeon VM (issue 20). AMX stays off unless --amx
(the AVX-512 build without it is the one that ran there). Idempotent: a stamp marks a finished build.

    python -m bench.llamacpp.build [--amx] [--jobs 2]    # prints the venv's python
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from bench.common.machine import cpu_flags
from bench.common.paths import CACHE_DIR

LLAMA_CPP_PYTHON = "0.3.36"
# llama-cpp-python's own dependencies, pinned (the main venv's versions where it has them).
RUNTIME_PINS = ("numpy==2.4.6", "jinja2==3.1.6", "MarkupSafe==3.0.4", "diskcache==5.6.3", "typing-extensions==4.16.0")

_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what ggml's GGML_AVX512 compiles for
# (ggml option, short name in the key, the /proc/cpuinfo flags it needs), in ggml's order.
GGML_ISA: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", "sse42", ("sse4_2",)),
    ("GGML_AVX", "avx", ("avx",)),
    ("GGML_AVX2", "avx2", ("avx2",)),
    ("GGML_BMI2", "bmi2", ("bmi2",)),
    ("GGML_FMA", "fma", ("fma",)),
    ("GGML_F16C", "f16c", ("f16c",)),
    ("GGML_AVX_VNNI", "avxvnni", ("avx_vnni",)),
    ("GGML_AVX512", "avx512", _AVX512),
    ("GGML_AVX512_VBMI", "avx512vbmi", (*_AVX512, "avx512vbmi")),
    ("GGML_AVX512_VNNI", "avx512vnni", (*_AVX512, "avx512_vnni")),
    ("GGML_AVX512_BF16", "avx512bf16", (*_AVX512, "avx512_bf16")),
    ("GGML_AMX_TILE", "amxtile", ("amx_tile",)),
    ("GGML_AMX_INT8", "amxint8", ("amx_tile", "amx_int8")),
    ("GGML_AMX_BF16", "amxbf16", ("amx_tile", "amx_bf16")),
)


def ggml_options(flags: Iterable[str], amx: bool = False) -> dict[str, bool]:
    """Every ggml instruction-set option, on where the CPU has all the flags it needs (AMX's only
    with `amx`)."""
    have = set(flags)
    return {option: all(f in have for f in needs) and (amx or not option.startswith("GGML_AMX"))
            for option, _, needs in GGML_ISA}


def build_key(options: dict[str, bool], machine: str | None = None) -> str:
    """The cache folder's name: version, architecture and the options compiled in, e.g.
    `llama-cpp-0.3.36-x86_64-sse42-avx-avx2-bmi2-fma-f16c`."""
    names = [short for option, short, _ in GGML_ISA if options[option]]
    return "-".join(["llama-cpp", LLAMA_CPP_PYTHON, machine or platform.machine(), *(names or ["baseline"])])


def cmake_args(options: dict[str, bool]) -> list[str]:
    """CMake definitions for llama-cpp-python's build: no native tuning, each option explicit, the
    library alone (no multimodal helper, tests or examples), OpenMP threads as llama.cpp ships them."""
    args = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_OPENMP=ON",
            "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    return args + [f"-D{option}={'ON' if on else 'OFF'}" for option, on in options.items()]


def build_dir(amx: bool = False) -> Path:
    """Where this CPU's build lives (built or not)."""
    return CACHE_DIR / build_key(ggml_options(cpu_flags(), amx))


def python_of(folder: Path) -> Path:
    """The interpreter of the build's venv."""
    return folder / "venv" / "bin" / "python"


def stamp_of(folder: Path) -> Path:
    """Written last: the build finished."""
    return folder / ".built"


def ensure_build(amx: bool = False, jobs: int = 2) -> Path:
    """This CPU's build, built first if missing (tens of minutes on two cores); its venv's python.
    CalledProcessError if pip fails; the log is build.log beside the venv."""
    options = ggml_options(cpu_flags(), amx)
    folder = CACHE_DIR / build_key(options)
    if stamp_of(folder).exists():
        return python_of(folder)
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder / "venv")], check=True)
    env = {**os.environ, "CMAKE_ARGS": " ".join(cmake_args(options)), "FORCE_CMAKE": "1",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS, so it would hand one CPU's build to another key.
    command = [str(python_of(folder)), "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
               "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", *RUNTIME_PINS]
    with open(folder / "build.log", "w", encoding="utf-8") as log:
        log.write(f"CMAKE_ARGS={env['CMAKE_ARGS']}\n{' '.join(command)}\n")
        log.flush()
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    stamp_of(folder).write_text(env["CMAKE_ARGS"] + "\n", encoding="utf-8")
    return python_of(folder)


def main(argv: list[str] | None = None) -> int:
    """Build (if needed) and print the venv's python; exit 1 if the build failed."""
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--amx", action="store_true", help="compile in AMX where the CPU has it")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args(argv)
    print(f"[llama.cpp] {build_dir(args.amx).name}: {' '.join(cmake_args(ggml_options(cpu_flags(), args.amx)))}",
          file=sys.stderr, flush=True)
    try:
        print(ensure_build(args.amx, args.jobs))
    except subprocess.CalledProcessError as error:
        print(f"[llama.cpp] build failed ({error}); see {build_dir(args.amx) / 'build.log'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
