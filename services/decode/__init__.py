"""The decode worker: reserves KV blocks, has prefill workers fill them, streams the tokens."""
