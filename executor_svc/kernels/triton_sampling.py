"""Per-row argmax and logsumexp on CUDA (Triton) in an order that depends on the row alone.

torch's CUDA reductions pick their launch shape from the whole tensor: with few rows a row's
sum is split across more threads than with many, so a position's logprob changed with the
number of rows sampled in its step (an H200 run of the invariance test with
LLMSERVE_CUDA_INVARIANT=1: every logit equal bit for bit, the logprobs not). Here one program
owns one row and walks the vocabulary in fixed chunks of ``_CHUNK`` lanes: each lane keeps its
running max (first index on ties) and then its running sum of exp(x - max), and the lanes are
reduced by one tree of fixed shape. Nothing depends on how many rows there are.

Without CUDA it runs in Triton's interpreter (``TRITON_INTERPRET=1``): that is how the CPU tests
check it against torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 2048


@triton.jit
def _argmax_lse_kernel(x_ptr, ids_ptr, lse_ptr, stride_row, vocab, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    lanes = tl.arange(0, CHUNK)
    best = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, vocab, CHUNK):
        cols = start + lanes
        v = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        better = v > best  # strict: an earlier chunk keeps a tie
        best_idx = tl.where(better, cols, best_idx)
        best = tl.where(better, v, best)
    m = tl.max(best, axis=0)
    big = 2147483647
    idx = tl.min(tl.where(best == m, best_idx, big), axis=0)
    idx = tl.where(idx == big, 0, idx)  # a row of NaNs: torch would say NaN's index; 0 here
    shift = tl.where(m == float("-inf"), 0.0, m)  # an all -inf row: lse -inf, never NaN
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, vocab, CHUNK):
        cols = start + lanes
        v = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        acc += tl.exp(v - shift)
    total = tl.sum(acc, axis=0)
    tl.store(ids_ptr + row, idx.to(tl.int64))
    tl.store(lse_ptr + row, shift + tl.log(total))


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` [n, vocab] (unit column stride): (argmax int64, logsumexp fp32)."""
    n, vocab = x.shape
    ids = torch.empty(n, dtype=torch.int64, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        _argmax_lse_kernel[(n,)](x, ids, lse, x.stride(0), vocab, CHUNK=_CHUNK, num_warps=8)
    return ids, lse
