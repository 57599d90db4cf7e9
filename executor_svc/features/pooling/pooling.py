"""Pooling for embedding requests: a prompt-only sequence's final-norm hidden states reduced to
one float32 vector, as vLLM's pooling runner does for decoder checkpoints.

A sequence asks for it with ``SamplingParams.pooling`` (executor.proto ``PoolingParams``), which
the feature's ``check_new`` hook keeps as a ``PoolingState``, the sequence's entry in
``SeqState.features`` (``pooling_of``). The step that completes its prompt returns the vector
(``ExecuteModelResponse.pooled``) instead of a sampled token; the sequence is then finished by
the scheduler and its KV blocks freed as usual.

- LAST: the hidden state of the last prompt token. Only that row is needed, so a prefix-cache
  hit (fewer rows computed) changes nothing.
- MEAN: the mean over every prompt token. Under chunked prefill the rows of each chunk are kept
  (float32, keyed by the chunk's first position) until the last chunk; then all rows, in
  position order, are reduced at once, in float64. The reduction sees the same [n, hidden]
  tensor however the prompt was chunked or batched, so the result is bitwise the same (given
  step-invariant hidden states, which the kernels guarantee). The scheduler never uses the
  prefix cache for MEAN (every row must be computed here) and preempts such a sequence by
  recompute, never by swap (a swapped-in sequence would come back without its kept rows).

Then the vector is truncated to ``dimensions`` (Matryoshka-style) and, with ``normalize``,
divided by its L2 norm, in that order (as vLLM). Everything after the forward runs in float32
(float64 for the mean's sum), whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from protos import executor_pb2 as epb

__all__ = [
    "LAST",
    "MEAN",
    "PooledResult",
    "PoolingState",
    "check_pooling",
    "pool_step",
    "pool_vector",
    "pooled_to_proto",
    "pooling_of",
]

# The key of a sequence's entry in SeqState.features (and the feature's name).
FEATURE = "pooling"
LAST = epb.POOLING_TYPE_LAST
MEAN = epb.POOLING_TYPE_MEAN
_TYPES = {LAST: "LAST", MEAN: "MEAN"}


@dataclass(slots=True)
class PoolingState:
    """One sequence's pooling parameters and, for MEAN, the prompt rows computed so far.

    Built from the proto with each NewSequence (the feature's ``check_new``) and kept in its
    SeqState's ``features``, so a sequence that is dropped and re-sent (preemption by recompute)
    starts over with no rows.
    """

    type: int  # LAST or MEAN
    normalize: bool
    dimensions: int  # 0 = all of hidden_size
    # MEAN: float32 rows [n, hidden] by the position of the chunk's first token. Keyed rather
    # than appended, so a chunk computed twice (a retried step) is not counted twice.
    chunks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, pb: epb.PoolingParams) -> PoolingState:
        return cls(type=int(pb.type), normalize=bool(pb.normalize), dimensions=int(pb.dimensions))


def pooling_of(s: Any) -> PoolingState | None:
    """A sequence's pooling (a SeqState or the runner's view of it); None: it samples."""
    f = s.features
    return f.get(FEATURE) if f else None


@dataclass(slots=True)
class PooledResult:
    seq_id: str
    vector: torch.Tensor  # [dimensions or hidden_size] float32, on the CPU


def check_pooling(pb: epb.PoolingParams, hidden_size: int, field_name: str) -> str | None:
    """Why these pooling parameters are invalid for a model of `hidden_size`, or None."""
    if pb.type not in _TYPES:
        return f"{field_name}.type must be POOLING_TYPE_LAST or POOLING_TYPE_MEAN, got {pb.type}"
    if pb.dimensions > hidden_size:
        return f"{field_name}.dimensions: {pb.dimensions} exceeds hidden_size {hidden_size}"
    return None


def pool_vector(
    rows: torch.Tensor, pooling_type: int, *, normalize: bool, dimensions: int = 0
) -> torch.Tensor:
    """The embedding of one sequence from its final-norm hidden rows [num_prompt_tokens, hidden]
    (for LAST, the last row alone suffices): float32 [dimensions or hidden]."""
    if pooling_type == LAST:
        vec = rows[-1].to(torch.float32)
    elif pooling_type == MEAN:
        # float64 sum of the whole, position-ordered tensor: one reduction over one shape,
        # independent of how the rows were grouped into steps.
        vec = (rows.to(torch.float64).sum(dim=0) / rows.shape[0]).to(torch.float32)
    else:
        raise ValueError(f"unknown pooling type {pooling_type}")
    if dimensions:
        vec = vec[:dimensions]
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
    return vec.contiguous()


def pool_step(seqs: Sequence[Any], hidden: torch.Tensor) -> list[PooledResult]:
    """Pooling for one step: keeps MEAN chunks, returns the vectors of the pooling sequences
    whose prompt this step completes. `seqs` are the step's ScheduledSequences; `hidden`
    [num_tokens, hidden] is the forward's output, rows in their order (num_scheduled_tokens
    each)."""
    out = []
    row = 0
    for s in seqs:
        n = s.num_scheduled_tokens
        p = pooling_of(s)
        if p is not None:
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            if p.type == MEAN:
                p.chunks[start] = hidden[row : row + n].to(torch.float32, copy=True)
            if end == s.num_prompt_tokens:
                rows = hidden[row + n - 1 : row + n] if p.type == LAST else _all_rows(p, end)
                vec = pool_vector(rows, p.type, normalize=p.normalize, dimensions=p.dimensions)
                out.append(PooledResult(s.seq_id, vec.cpu()))
                p.chunks.clear()
        row += n
    return out


def _all_rows(p: PoolingState, num_tokens: int) -> torch.Tensor:
    """The kept MEAN chunks as one [num_tokens, hidden] tensor in position order; they must
    cover positions [0, num_tokens) exactly."""
    parts = []
    pos = 0
    for start in sorted(p.chunks):
        if start != pos:
            break
        parts.append(p.chunks[start])
        pos += p.chunks[start].shape[0]
    if pos != num_tokens:
        raise RuntimeError(
            f"mean pooling has rows for positions [0, {pos}) of {num_tokens}: a chunk was "
            "computed elsewhere (prefix cache or swap-in), which the scheduler must not do"
        )
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def pooled_to_proto(results: Sequence[PooledResult]) -> list[epb.PooledOutput]:
    """Packed little-endian float32: 4 bytes a component on the wire."""
    return [
        epb.PooledOutput(seq_id=r.seq_id, data=r.vector.numpy().astype("<f4", copy=False).tobytes())
        for r in results
    ]


def vector_from_bytes(data: bytes) -> np.ndarray:
    """The inverse of pooled_to_proto's packing (tests and tools)."""
    return np.frombuffer(data, dtype="<f4")
