"""Whether the executor computes step-invariant numerics (the default) or the fastest kernels.

Step-invariant ("deterministic") means: the logits of a sequence's position, and so its greedy or
seeded token, are bitwise the same however that position was grouped into steps — alone or among
63 co-runners, in a whole prefill, a chunked prefill or a decode, after swap or recompute, with or
without prefix-cache hits. Every reduction whose order could follow the shape of a step (GEMM
K-blocking chosen by the number of rows, attention split by chunk or by co-runners) is done in an
order fixed per row and per position instead. See docs/internals.md, "Step-invariant numerics".

Off (``--no-deterministic`` / ``LLMSERVE_DETERMINISTIC=0``) the CPU matmuls go to oneDNN, which
picks kernels by shape, so a near-tie can fall the other way after a recovery. It is not faster
on the development machine (docs/benchmarks.md, issue 24): the step-invariant GEMM
(``kernels/gemm.py``) matches it from 16 to 512 rows and streams one row's weights ~1.6x faster.
"""

from __future__ import annotations

from executor_svc.config import envs

_enabled: bool | None = None


def deterministic() -> bool:
    """True unless turned off by ``set_deterministic(False)`` or ``LLMSERVE_DETERMINISTIC=0``."""
    global _enabled
    if _enabled is None:
        _enabled = envs.deterministic()
    return _enabled


def set_deterministic(enabled: bool) -> None:
    """Set for the whole process (the executor's ``--[no-]deterministic``); call before loading."""
    global _enabled
    _enabled = enabled
