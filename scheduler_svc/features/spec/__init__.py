"""Speculative decoding on the scheduler's hooks (``feature.py``) and its flags (``flags.py``);
the proposer, the verification and the counters (``decode.py``: ``SpecDecoder``, the scheduling
core's lookahead, core/lookahead.py)."""
