"""llama.cpp as a baseline: llama-cpp-python built for this CPU into the bench cache (build.py), and the
program its venv runs to time batch-1 decode and prefill on a GGUF file (offline.py)."""
