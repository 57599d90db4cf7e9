"""Prompt logprobs and prompt-only requests (echo, max_tokens 0) on the scheduler's hooks."""
