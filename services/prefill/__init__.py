"""The prefill worker: computes prompts and pushes their KV pages to decode workers."""
