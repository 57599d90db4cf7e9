"""Turning sampled token ids into client output: tokenizer, incremental detokenizer, and
per-sequence output state (stop conditions, text deltas, logprobs)."""
