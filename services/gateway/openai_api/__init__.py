"""The OpenAI-compatible HTTP API of the gateway (/v1/completions, /v1/chat/completions, ...)."""
