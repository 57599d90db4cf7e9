"""Prompt logprobs (and echo) from a step's prefill rows (``prompt_logprobs``)."""
