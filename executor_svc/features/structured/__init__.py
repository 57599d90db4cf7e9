"""Structured outputs: allowed-token masks applied to the logits (``token_mask``)."""
