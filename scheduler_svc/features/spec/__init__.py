"""Speculative decoding on the scheduler's hooks (``feature.py``) and its flags (``flags.py``);
the proposals and their step budget are the scheduling core's (core/spec_decode.py)."""
