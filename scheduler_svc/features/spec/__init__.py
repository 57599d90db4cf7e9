"""Speculative decoding's reply side on the scheduler's hooks (the proposals and their step
budget are the scheduling core's: core/spec_decode.py)."""
