"""Build the CPU kernels (qmatmul.cpp's quantized products; fp16_pieces.cpp; rms_norm.cpp,
decode_attention.cpp, rotary.cpp and silu_mul.cpp, the decode step's other hot ops; decode_stack.cpp,
which calls them all for a decode batch; lora_bgmv.cpp, LoRA's products by adapter slot;
prefill_attention.cpp, bf16_gemm.cpp and int8_gemm.cpp, compiled to ops only where the build targets
AVX512-BF16 and VNNI) for the CPU at hand, once, into an ignored folder, as one library per variant.

Each variant is the same sources compiled with its own flags and needs the CPU flags its code uses;
a variant is built only where /proc/cpuinfo lists those flags, never compiled for a CPU without
them. The build directory is keyed by the variant, its CPU flags and a hash of the source, the
compiler flags and the torch build, so a build made for another CPU, source or torch is never
loaded; an existing build is loaded as is (no compiler runs). Builds land in a temporary folder
that is renamed into place, so processes starting together never load a half-written library.

    python -m engine.model.kernels   # the Makefile's step: every variant this CPU runs
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("qmatmul.cpp", "rms_norm.cpp", "decode_attention.cpp", "rotary.cpp",
                                          "silu_mul.cpp", "fp16_pieces.cpp", "decode_stack.cpp",
                                          "prefill_attention.cpp", "bf16_gemm.cpp", "int8_gemm.cpp", "argmax.cpp",
                                          "lora_bgmv.cpp"))
HEADERS = (_HERE / "qmatmul_core.h", _HERE / "exp8.h", _HERE / "ops.h", _HERE / "gemm_tiles.h")
BUILD_ROOT_ENV = "TANDEM_KERNELS_DIR"
_LIBRARY = "qmatmul.so"


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: the CPU flags its code needs and the compiler flags that emit it."""

    name: str
    cpu_flags: tuple[str, ...]
    compile_flags: tuple[str, ...]

    @property
    def namespace(self) -> str:
        """The torch.ops namespace this build registers its ops under."""
        return f"tandem_{self.name}"


# Best first: the first variant whose flags the CPU has is the one served.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
VARIANTS = (
    # The AVX2 code with AVX-512's 32 registers, plus the ops only AVX512-BF16 and VNNI run
    # (prefill_attention.cpp, bf16_gemm.cpp, int8_gemm.cpp); every CPU with AVX512-BF16 has VNNI.
    Variant("avx512bf16", ("avx2", "fma", "f16c", *_AVX512, "avx512_bf16", "avx512_vnni"),
            ("-mavx2", "-mfma", "-mf16c", *(f"-m{flag}" for flag in _AVX512), "-mavx512bf16", "-mavx512vnni")),
    Variant("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    Variant("scalar", (), ()),
)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where the file is unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str]) -> list[Variant]:
    """The variants a CPU with these flags can run, best first (the scalar one always)."""
    return [variant for variant in VARIANTS if set(variant.cpu_flags) <= flags]


def variant_named(name: str) -> Variant:
    """The variant called `name`; ValueError naming the known ones."""
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"unknown kernel variant {name!r} (known: {', '.join(v.name for v in VARIANTS)})")


def build_root() -> Path:
    """$TANDEM_KERNELS_DIR, else build/kernels/ at the project root (ignored by git)."""
    configured = os.environ.get(BUILD_ROOT_ENV)
    return Path(configured) if configured else Path(__file__).resolve().parents[3] / "build" / "kernels"


def _compile_flags(variant: Variant) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [
        "-O3", "-std=c++20", "-fPIC", "-fopenmp", "-ffp-contract=off", *variant.compile_flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", f"-DTANDEM_OPS={variant.namespace}",
        *(f"-I{path}" for path in include_paths()),
    ]


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths

    libraries = library_paths()
    return ["-shared", "-fopenmp", *(f"-L{path}" for path in libraries),
            *(f"-Wl,-rpath,{path}" for path in libraries), "-lc10", "-ltorch_cpu"]


def _run(command: list[str], variant: Variant) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"building the {variant.name} kernels failed:\n{result.stderr[-4000:]}")


def _compile(variant: Variant, output: Path) -> None:
    """One object per source, compiled side by side on every core (a single compiler process for
    all of them would leave the other cores idle), then linked."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++) to build the quantized kernels")
    flags = _compile_flags(variant)
    objects = [output.parent / f"{source.stem}.o" for source in SOURCES]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda source, obj: _run([compiler, *flags, "-c", str(source), "-o", str(obj)], variant),
                      SOURCES, objects))
    _run([compiler, *map(str, objects), *_link_flags(), "-o", str(output)], variant)
    for obj in objects:
        obj.unlink()


def build_dir(variant: Variant) -> Path:
    """Where this variant's build for this source, compiler flags and torch lives."""
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    key.update(" ".join([*_compile_flags(variant), *_link_flags()]).encode())
    key.update(f"{torch.__version__}|{torch.compiled_with_cxx11_abi()}|{sys.version_info[:2]}".encode())
    return build_root() / f"{_label(variant)}-{key.hexdigest()[:16]}"


def _label(variant: Variant) -> str:
    return "-".join((variant.name, *variant.cpu_flags))


def library(variant: Variant, flags: frozenset[str] | None = None) -> Path:
    """The built library of `variant`, compiling it first if it is not built yet.

    RuntimeError if this CPU lacks the variant's flags (its code would not run here) or the
    compiler fails (its output is in the message).
    """
    flags = cpu_flags() if flags is None else flags
    missing = sorted(set(variant.cpu_flags) - flags)
    if missing:
        raise RuntimeError(f"kernel variant {variant.name!r} needs CPU flags this CPU lacks: {', '.join(missing)}")
    target = build_dir(variant)
    if (target / _LIBRARY).exists():
        return target / _LIBRARY
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the %s kernels into %s (once; about a minute)", variant.name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _compile(variant, staging / _LIBRARY)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _LIBRARY).exists():  # not another process's finished build: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for stale in target.parent.glob(f"{_label(variant)}-*"):  # builds of earlier sources (loaded ones stay mapped)
        if stale != target:
            shutil.rmtree(stale, ignore_errors=True)
    return target / _LIBRARY


def main() -> int:
    """Build every variant this CPU runs, one after another (each compiles on every core); print where each is."""
    for variant in runnable(cpu_flags()):
        print(f"kernels {variant.name}: {library(variant)}")
    return 0
