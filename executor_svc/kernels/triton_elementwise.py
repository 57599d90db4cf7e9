"""Fused elementwise kernels for CUDA (Triton): residual add + RMSNorm, SiLU-and-multiply, and
the neox rotary embedding, one pass over memory each.

Unfused, these are 5-10 torch kernels apiece, each reading and writing the whole activation:
on an H100 they took 35 % of a Llama-3-8B-shaped 8192-token prefill step (docs/benchmarks.md,
"CUDA"). Each kernel rounds where Hugging Face's bf16/fp16 reference rounds (the residual sum,
the normalised row before the weight, the activation before the product), with fp32 math in
between; the rotary embedding computes in fp32 and rounds once.

Without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the CPU
tests check them against the torch forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    sum_ptr,
    out_ptr,
    stride_x,
    stride_d,
    stride_s,
    stride_o,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream's rounding
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for rows of ``x`` [num_tokens, hidden]; with
    ``delta`` None the first is ``x`` itself."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            delta if delta is not None else x,
            weight,
            total,
            out,
            x.stride(0),
            delta.stride(0) if delta is not None else 0,
            total.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=8 if hidden >= 4096 else 4,
        )
    return total, out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded as torch's silu output is
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [num_tokens, 2 * inter] (gate first)."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    base = x_ptr + tok * stride_xt + head * stride_xh
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + tok * stride_ct + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_ct + i, mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    obase = out_ptr + tok * stride_ot + head * stride_oh
    tl.store(obase + i, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(obase + HALF + i, (x2 * c + x1 * s).to(dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding of ``x`` [num_tokens, heads, head_dim] (head_dim contiguous) with
    ``cos``/``sin`` [num_tokens, 1, head_dim / 2]; a new contiguous tensor."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if tokens:
        half = dim // 2
        _rope_kernel[(tokens, heads)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            out.stride(0),
            out.stride(1),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
        )
    return out
