"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) and its weight loaders for GGUF files and HF directories."""
