"""The model runtime shared by every pool: model, paged KV cache, scheduler, sampler."""
