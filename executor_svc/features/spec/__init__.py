"""Speculative decoding: verification of proposals (``verify``), the draft model (``draft``)."""
