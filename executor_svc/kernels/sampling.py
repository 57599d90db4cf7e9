"""The sampler's row reductions over ``csrc/sampling.cpp``."""

from __future__ import annotations

import torch

from executor_svc.config import envs, numerics
from executor_svc.kernels import library


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of fp32 logits [n, vocab]: (argmax int64, logsumexp fp32) in one kernel call.

    On the CPU the compiled library (~8x faster than torch's argmax plus logsumexp at
    64 x 49 152); on CUDA under the step-invariant experiment (LLMSERVE_CUDA_INVARIANT=1) a
    Triton kernel whose order depends on the row alone (kernels/triton_sampling.py). None
    otherwise, or when x is not an fp32 matrix with unit column stride.
    """
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1):
        return None
    if x.device.type == "cuda":
        if not (numerics.deterministic() and envs.cuda_invariant()):
            return None
        from executor_svc.kernels import triton_sampling  # triton: an extra, CUDA only

        return triton_sampling.argmax_logsumexp(x)
    if x.device.type != "cpu":
        return None
    lib = library.load()
    if lib is None:
        return None
    n = x.shape[0]
    ids = torch.empty(n, dtype=torch.int64)
    lse = torch.empty(n, dtype=torch.float32)
    rc = lib.llmserve_argmax_logsumexp_f32(
        x.data_ptr(), n, x.shape[1], x.stride(0), ids.data_ptr(), lse.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        return None
    return ids, lse


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of fp32 logits [n, vocab]. On CUDA by ``argmax_logsumexp``
    where it applies (the same bits whatever n); elsewhere torch's, whose CPU kernel already
    reduces each row on its own."""
    fused = argmax_logsumexp(x) if x.is_cuda else None
    return fused[1] if fused is not None else torch.logsumexp(x, dim=-1)
