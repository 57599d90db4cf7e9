"""Embedding requests for the scheduling core: prompt-only requests that carry pooling parameters.

An embedding input is scheduled like any prompt-only request (max_tokens 0): chunked prefill,
routing and preemption as usual, no token sampled, finished after the step that completes its
prompt, its blocks then freed (no KV is kept for it; its full blocks stay in the prefix cache
like anyone's). Two differences, both for MEAN pooling, whose per-chunk rows live in the
executor until the prompt is complete:

- it never takes a prefix-cache hit (every prompt position must be computed by the forward);
  LAST pooling needs only the last position and uses the prefix cache as usual;
- it is preempted by recompute, never by swap (a swapped-in sequence is re-sent to the
  executor without the rows it had collected).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams

__all__ = ["EmbedSamplingParams", "PoolingParams", "PoolingType", "embed_request", "swappable"]


class PoolingType(enum.IntEnum):
    """Values as the protos' PoolingType."""

    LAST = 1
    MEAN = 2


@dataclass(slots=True, frozen=True)
class PoolingParams:
    type: PoolingType
    normalize: bool
    dimensions: int  # keep the first `dimensions` components; 0 = all (hidden_size)


@dataclass(slots=True)
class EmbedSamplingParams(SamplingParams):
    """A prompt-only request's parameters plus its pooling (the step message sends both)."""

    pooling: PoolingParams | None = None


def embed_request(
    req_id: str, token_ids: list[int], pooling: PoolingParams, *, priority: int, arrival_time: float
) -> Request:
    """The scheduling core's request for one embedding input."""
    params = EmbedSamplingParams(n=1, max_tokens=0, temperature=0.0, pooling=pooling)
    req = Request(req_id, token_ids, params, priority=priority, arrival_time=arrival_time)
    for seq in req.seqs:
        seq.use_prefix_cache = pooling.type == PoolingType.LAST
    req.swappable = swappable(req)
    return req


def swappable(req: Request) -> bool:
    """False for a MEAN-pooling request: its executor-side rows do not survive a swap."""
    pooling = getattr(req.sampling_params, "pooling", None)
    return pooling is None or pooling.type != PoolingType.MEAN
