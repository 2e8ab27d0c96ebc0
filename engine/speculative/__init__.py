"""Speculative decoding: a proposer drafts tokens, the target model verifies them in one step."""
