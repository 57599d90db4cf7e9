"""A step-invariant GEMM for CUDA (Triton): ``x [M, K] @ w [K, N] (+ bias)`` whose every output
element is computed the same way whatever M is.

cuBLAS picks its kernel (tile shape, split-K, the order it sums K in) by the problem's shape, M
included, so one row of a 1-row decode step and the same row inside an 8192-row prefill get
different low bits (an H100 run measured 3e-6 to 1e-5 on the logits, docs/benchmarks.md "CUDA").
Here the tile shape, the K step and the warp layout are fixed per weight matrix (they depend on
N and K only), there is no split-K, and each program sums K in ascending BLOCK_K slices into one
fp32 accumulator: a row's result depends on that row and the weights alone. The price is
cuBLAS's shape-tuned speed (measured in docs/benchmarks.md, "CUDA").

Experimental, off by default: ``LLMSERVE_CUDA_INVARIANT=1`` (with step-invariant numerics)
routes every CUDA linear and the lm_head here. Measured on an H100 (docs/benchmarks.md, "CUDA"):
an 8192-token prefill 2.3x slower than cuBLAS, decode at batch 256 1.8x, and the CUDA
step-invariance test still failed with it on (together with the fixed-tile attention), for a
reason that session could not look into: a later GPU session should run that test with
``--runxfail`` and find the first op that differs. Each row's bits not depending on the row
count is tested (in the interpreter on CPU; on CUDA by the same test).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_K = 64
GROUP_M = 8


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products, not TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Programs walk the output in groups of GROUP_M row tiles so neighbours share weight tiles
    # in L2; the order changes which program computes a tile, never how it is computed.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn[None, :] < N), other=0.0)
        if IEEE:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _block_n(n: int, k: int) -> int:
    """Output columns per program, from the weight's shape alone: narrow enough that a layer's
    programs cover the GPU in a decode step (one row tile), wide where N alone does that."""
    del k
    if n >= 16384:
        return 128
    return 64 if n >= 8192 else 32


def matmul(x: torch.Tensor, w_io: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ w_io [K, N] (+ bias)`` in x's dtype, fp32 accumulation, step-invariant."""
    m, k = x.shape
    k2, n = w_io.shape
    assert k == k2, f"inner dimensions differ: x {tuple(x.shape)}, w {tuple(w_io.shape)}"
    assert x.dtype == w_io.dtype, f"x is {x.dtype}, w is {w_io.dtype}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n = _block_n(n, k)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x,
        w_io,
        out,
        bias if bias is not None else out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w_io.stride(0),
        w_io.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        GROUP_M=GROUP_M,
        num_warps=4,
        num_stages=4 if x.element_size() == 2 else 2,
    )
    return out
